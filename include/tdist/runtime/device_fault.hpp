// The host side of an aborted device wait (device/timeout.cuh): the process's fault record in
// host-mapped memory, and the error the host raises from it.
//
// Under the abort action (the default), the first device wait of the process to time out fills
// the record and every other wait gives up, so kernels return and the CUDA context stays usable.
// Nothing synchronises to look: every JIT launch checks the record first (a plain read of pinned
// memory) and throws tdist::DeviceTimeoutError, and check_device_faults() does the same on demand
// (after a stream synchronise, it sees every fault of the work synchronised).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "tdist/common/error.hpp"
#include "tdist/device/timeout.cuh"

namespace tdist {

// A device wait timed out (a peer never signalled). The world's flags are out of step after it:
// save what is needed, then end the process (a world rebuilt in the same process is not supported
// yet: a test of it gave wrong results).
class DeviceTimeoutError : public TimeoutError {
 public:
  explicit DeviceTimeoutError(const std::string& what) : TimeoutError(what) {}
};

// The process's record, allocated on first use (cudaHostAlloc, mapped and portable: one record
// serves every device of the process). Its address is the same on the host and the devices.
device::FaultRecord* device_fault_record();

// The action that TDIST_WAIT_TIMEOUT_ACTION asks for ("abort", the default, or "trap").
device::TimeoutAction wait_timeout_action_from_env();

// Whether a device wait of this process has given up (a plain read of the record).
bool device_fault_recorded();

// The message of a recorded fault, or nothing while no wait has given up.
std::optional<std::string> device_fault_message();

// The message for a given record (a complete one); separate for tests.
std::string describe_device_fault(const device::FaultRecord& record);

// Throws DeviceTimeoutError when a device wait of this process has given up.
void check_device_faults();

// Records a fault found by the host (an NCCL operation past its deadline): the device waits of the
// process give up as after a timed-out wait, and the error names `detail`. No-op when a fault is
// already recorded.
void record_host_fault(device::WaitSite site, int rank, double timeout_seconds, const std::string& detail);

// Names of device memory, so that a fault's message can name the op whose flag a wait watched: the
// device record holds only the address. The symmetric heap names each block it hands out
// (SymmetricHeap::name_block: "tdist's AllGather-GEMM"), in this rank's mapping and the peers'.
// Ranges do not overlap (a later name replaces every earlier one it touches). Thread-safe.
void name_memory(const void* base, size_t bytes, const std::string& owner);
// Forgets the names of every range that starts in [base, base + bytes).
void forget_memory_names(const void* base, size_t bytes);
// The name of the range holding `address`, if any.
std::optional<std::string> memory_owner(uint64_t address);

// Forgets a recorded fault, so waits wait again. Only for a process that has rebuilt its world
// (or a test): the flags of the old world are still out of step.
void clear_device_fault();

}  // namespace tdist
