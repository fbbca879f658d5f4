// Programmatic dependent launch (sm_90 and later). A kernel launched with the programmatic stream
// serialization attribute (jit::LaunchConfig::programmatic_dependent_launch) may be scheduled while
// the kernel before it on the stream is still running, which hides its launch latency behind that
// kernel's tail. Such a kernel must call wait_for_prior_grid() before it reads or writes anything the
// kernel before it may touch: the call returns once that grid has completed and its writes are
// visible. allow_dependent_launch() lets the next kernel on the stream be scheduled once every block
// of this grid has called it (or exited). In a kernel launched without the attribute both are no-ops,
// so a kernel can carry them whatever its launcher chooses.
#pragma once

#include "tdist/device/common.cuh"

#if defined(__CUDACC__)
namespace tdist::device {

TDIST_DEVICE void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

TDIST_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace tdist::device
#endif  // __CUDACC__
