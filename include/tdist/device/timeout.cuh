// Bounded spinning. Every spin-wait of the device API gives up after a timeout and says where it
// was stuck (rank, block, thread, address, expected and seen value), so a missing signal ends the
// kernel with a diagnostic instead of hanging the job. What happens then is the host's choice:
//   - abort (the default): the first wait to time out writes a FaultRecord into host-mapped memory
//     and prints the diagnostic; from then on every wait of the process gives up at its next clock
//     check, so the kernels drain and return. The CUDA context stays usable: the host raises
//     tdist::TimeoutError from the record at its next launch or check (runtime/device_fault.hpp),
//     and the program can still copy its tensors out (save a checkpoint). What the drained kernels
//     wrote is garbage and the world's symmetric flags are out of step: save, then end the process
//     (a world rebuilt in the same process is not supported yet).
//   - trap: print and __trap(); the context is lost (what a debugger or compute-sanitizer wants).
// Contract for kernels: a wait can return without its condition holding (after an abort), so a
// value read from a waited flag must be bounded before it serves as an index or a count.
//
// The timeout, the action, the rank printed and the record's address live in
// `tdist_device_config`, one copy per compiled module (per translation unit under nvcc without
// -rdc, per program under the JIT). Time is read from %globaltimer, which counts real nanoseconds
// whatever the SM clock, so no clock-rate conversion is needed. The host sets the value at run
// time, without recompiling:
//   - nvcc-compiled code: tdist::configure_waits(rank, seconds) (runtime/wait_config.hpp) from a
//     host function of the same translation unit as the kernels (it writes that unit's copy);
//   - JIT-compiled modules: the JIT writes the symbol after loading the module.
// The seconds come from TDIST_WAIT_TIMEOUT_S (else kDefaultWaitTimeoutSeconds), the action from
// TDIST_WAIT_TIMEOUT_ACTION (abort | trap). This header holds device code only; the host side is
// runtime/wait_config.hpp and runtime/device_fault.hpp.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

// Which wait gave up; the host names it in its message (runtime/device_fault.hpp).
// kNcclOp: recorded by the host (World's NCCL watchdog), not by a device wait.
enum class WaitSite : u32 { kSignalWaitUntil = 1, kLlRead, kLl128Read, kGemmChunk, kEpCountFlag, kUser, kNcclOp };

// What a timed-out wait does (see the top of this file).
enum class TimeoutAction : u32 { kAbort = 0, kTrap = 1 };

// The first timed-out wait of a process, in host-mapped (pinned) memory that the host reads
// without synchronising. `state` goes kFaultNone -> kFaultClaimed (one thread won the record and
// writes the fields) -> kFaultRecorded (complete).
struct FaultRecord {
  u32 state;
  u32 site;  // WaitSite
  int rank;
  u32 cmp;  // Cmp
  u32 block[3];
  u32 thread[3];
  u64 address;
  u64 expected;
  u64 seen;
  u64 timeout_ns;
};

constexpr u32 kFaultNone = 0, kFaultClaimed = 1, kFaultRecorded = 2;

struct WaitConfig {
  u64 timeout_ns;
  int rank;  // printed in diagnostics; -1 until configured
  TimeoutAction action;
  FaultRecord* fault;  // host-mapped; null: waits trap, as nothing could report the fault
};

constexpr double kDefaultWaitTimeoutSeconds = 60.0;

// Name of the per-module WaitConfig variable, for loaders that write it (the JIT).
constexpr const char* kWaitConfigSymbol = "tdist_device_config";

}  // namespace tdist::device

#if defined(__CUDACC__)
#if defined(__CUDACC_RTC__) || defined(TDIST_JIT_MODULE)
// One program per module (NVRTC, or nvcc under the JIT): external linkage lets the JIT find the
// symbol by its plain name.
extern "C" __device__ tdist::device::WaitConfig tdist_device_config;
__device__ tdist::device::WaitConfig tdist_device_config = {
    static_cast<tdist::device::u64>(tdist::device::kDefaultWaitTimeoutSeconds * 1e9), -1,
    tdist::device::TimeoutAction::kAbort, nullptr};
#else
// Internal linkage: each translation unit (each module without -rdc) owns its copy.
static __device__ tdist::device::WaitConfig tdist_device_config = {
    static_cast<tdist::device::u64>(tdist::device::kDefaultWaitTimeoutSeconds * 1e9), -1,
    tdist::device::TimeoutAction::kAbort, nullptr};
#endif  // __CUDACC_RTC__

namespace tdist::device {

TDIST_DEVICE u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// True once some wait of this process has given up: the others stop waiting too.
TDIST_DEVICE bool fault_recorded() {
  const FaultRecord* f = tdist_device_config.fault;
  return f != nullptr && *reinterpret_cast<const volatile u32*>(&f->state) != kFaultNone;
}

// Tracks one spin-wait's deadline; checks the clock only every few polls to keep polling cheap.
class SpinDeadline {
 public:
  TDIST_DEVICE SpinDeadline() : start_(global_timer_ns()), polls_(0) {}

  // True once the wait has run past the configured timeout, or another wait has given up.
  TDIST_DEVICE bool expired() {
    if ((++polls_ & 255u) != 0) return false;
    return global_timer_ns() - start_ > tdist_device_config.timeout_ns || fault_recorded();
  }

 private:
  u64 start_;
  u32 polls_;
};

// Claims the process's fault record and fills it; false when another wait claimed it first (or
// there is none). Inline and printf-free, so the GEMM's waits can use it (see gemm/overlap.cuh).
TDIST_DEVICE bool record_fault(WaitSite site, const void* address, Cmp cmp, u64 expected, u64 seen) {
  FaultRecord* f = tdist_device_config.fault;
  if (f == nullptr || atomicCAS(&f->state, kFaultNone, kFaultClaimed) != kFaultNone) return false;
  f->site = static_cast<u32>(site);
  f->rank = tdist_device_config.rank;
  f->cmp = static_cast<u32>(cmp);
  f->block[0] = blockIdx.x, f->block[1] = blockIdx.y, f->block[2] = blockIdx.z;
  f->thread[0] = threadIdx.x, f->thread[1] = threadIdx.y, f->thread[2] = threadIdx.z;
  f->address = reinterpret_cast<u64>(address);
  f->expected = expected;
  f->seen = seen;
  f->timeout_ns = tdist_device_config.timeout_ns;
  __threadfence_system();  // the fields before the state, for the host's plain reads
  *reinterpret_cast<volatile u32*>(&f->state) = kFaultRecorded;
  return true;
}

// True when a timed-out wait traps rather than records and returns.
TDIST_DEVICE bool waits_trap() {
  return tdist_device_config.action == TimeoutAction::kTrap || tdist_device_config.fault == nullptr;
}

// A wait ran out: under kTrap, print the diagnostic and trap (the host sees the launch fail);
// under kAbort, the first wait of the process records and prints it, and every wait returns.
__device__ __noinline__ inline void wait_timed_out(const char* what, WaitSite site, const void* address, Cmp cmp,
                                                   u64 expected, u64 seen) {
  const bool trap = waits_trap();
  if (!trap && !record_fault(site, address, cmp, expected, seen)) return;  // a follower of the first fault
  printf(
      "tdist: %s timed out after %.1f s: rank %d, block (%d,%d,%d), thread (%d,%d,%d), "
      "address %p, waiting for value %s %llu, seen %llu%s\n",
      what, static_cast<double>(tdist_device_config.timeout_ns) * 1e-9, tdist_device_config.rank, blockIdx.x,
      blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, address, cmp_name(cmp), expected, seen,
      trap ? "" : "; aborting this process's waits");
  if (trap) __trap();
}

}  // namespace tdist::device
#endif  // __CUDACC__
