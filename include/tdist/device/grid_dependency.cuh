// Programmatic dependent launch (sm_90 and later). A kernel launched with the programmatic stream
// serialization attribute (jit::LaunchConfig::programmatic_dependent_launch) may be scheduled while
// the kernel before it on the stream is still running, which hides its launch latency behind that
// kernel's tail. Such a kernel must call wait_for_prior_grid() before it reads or writes anything the
// kernel before it may touch: the call returns once that grid has completed and its writes are
// visible. allow_dependent_launch() lets the next kernel on the stream be scheduled once every block
// of this grid has called it (or exited). In a kernel launched without the attribute both are no-ops,
// so a kernel can carry them whatever its launcher chooses.
//
// Before the wait a kernel may warm L2 with what it is about to read (prefetch_l2), steered by
// reads that bypass L1 (ld.global.cg): L2 is the GPU's point of coherence, so a prefetched line is
// never stale, while a line left in L1 could be. Values read before the wait may predate the prior
// grid's writes; they may choose addresses to prefetch, never enter a result.
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

// A hint: the 128-byte line holding p is brought into L2. p must lie in an allocation.
TDIST_DEVICE void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

}  // namespace tdist::device
#endif  // __CUDACC__
