// Random bf16 / fp16 inputs for the GEMM benchmarks: uniform in [-1, 1), a different stream of values
// per seed, written as raw 2-byte words.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>

__global__ void fill_random(unsigned short* p, size_t count, unsigned long long seed, bool bf16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned long long x = (seed + i) * 0x9E3779B97F4A7C15ull ^ (seed << 17);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = static_cast<float>(x >> 40) * 0x1.0p-24f * 2.0f - 1.0f;
    if (bf16) {
      __nv_bfloat16 v = __float2bfloat16(u);
      memcpy(p + i, &v, 2);
    } else {
      __half v = __float2half(u);
      memcpy(p + i, &v, 2);
    }
  }
}
