// Bounded spinning. Every spin-wait of the device API gives up after a timeout, prints where it
// was stuck (rank, block, thread, address, expected and seen value) and traps, so a missing
// signal ends the kernel with a diagnostic instead of hanging the job.
//
// The timeout and the rank printed live in `tdist_device_config`, one copy per compiled module
// (per translation unit under nvcc without -rdc, per program under the JIT). Time is read from
// %globaltimer, which counts real nanoseconds whatever the SM clock, so no clock-rate conversion
// is needed. The host sets the value at run time, without recompiling:
//   - nvcc-compiled code: tdist::configure_waits(rank, seconds) (runtime/wait_config.hpp) from a
//     host function of the same translation unit as the kernels (it writes that unit's copy);
//   - JIT-compiled modules: the JIT writes the symbol after loading the module.
// The default seconds come from TDIST_WAIT_TIMEOUT_S when the host configures, else kDefault. This
// header holds device code only; the host side is runtime/wait_config.hpp.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

struct WaitConfig {
  u64 timeout_ns;
  int rank;  // printed in diagnostics; -1 until configured
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
    static_cast<tdist::device::u64>(tdist::device::kDefaultWaitTimeoutSeconds * 1e9), -1};
#else
// Internal linkage: each translation unit (each module without -rdc) owns its copy.
static __device__ tdist::device::WaitConfig tdist_device_config = {
    static_cast<tdist::device::u64>(tdist::device::kDefaultWaitTimeoutSeconds * 1e9), -1};
#endif  // __CUDACC_RTC__

namespace tdist::device {

TDIST_DEVICE u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Tracks one spin-wait's deadline; checks the clock only every few polls to keep polling cheap.
class SpinDeadline {
 public:
  TDIST_DEVICE SpinDeadline() : start_(global_timer_ns()), polls_(0) {}

  // True once the wait has run past the configured timeout.
  TDIST_DEVICE bool expired() {
    if ((++polls_ & 255u) != 0) return false;
    return global_timer_ns() - start_ > tdist_device_config.timeout_ns;
  }

 private:
  u64 start_;
  u32 polls_;
};

// Prints the diagnostic of a timed-out wait and traps (the kernel ends with an error the host sees
// as cudaErrorLaunchFailure / illegal instruction).
__device__ __noinline__ inline void wait_timed_out(const char* what, const void* address, Cmp cmp, u64 expected,
                                                   u64 seen) {
  printf(
      "tdist: %s timed out after %.1f s: rank %d, block (%d,%d,%d), thread (%d,%d,%d), "
      "address %p, waiting for value %s %llu, seen %llu\n",
      what, static_cast<double>(tdist_device_config.timeout_ns) * 1e-9, tdist_device_config.rank, blockIdx.x,
      blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, address, cmp_name(cmp), expected, seen);
  __trap();
}

}  // namespace tdist::device
#endif  // __CUDACC__
