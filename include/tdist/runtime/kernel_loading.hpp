// Loading kernels before they are needed.
//
// CUDA loads a kernel's code lazily, at its first launch (CUDA_MODULE_LOADING=LAZY, the default),
// and loading can wait for kernels already running on the device. A kernel that spins until a
// kernel launched after it (on this GPU or, through a peer's signal, on another) has run would then
// wait forever. Load every kernel of such a pair before launching either one.
#pragma once

#include <cuda_runtime_api.h>

#include "tdist/common/cuda_check.hpp"

namespace tdist {

// Forces the module holding `kernel` (a __global__ function) to load now.
inline void preload_kernel(const void* kernel) {
  cudaFuncAttributes attributes;
  TDIST_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
}

template <typename... Kernels>
void preload_kernels(Kernels... kernels) {
  (preload_kernel(reinterpret_cast<const void*>(kernels)), ...);
}

}  // namespace tdist
