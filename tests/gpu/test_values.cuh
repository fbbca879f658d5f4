// Inputs of the GEMM-based GPU tests that any rank can recompute for any other rank, and the
// conversions between float and the element types (host and device).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tdist::test {

// Element i of a (seed, rank) array: a multiple of 1/64 in [-1, 1], exact in bf16, fp16 and fp32, so
// the reference sees exactly what the op sees.
__host__ __device__ inline float input_value(uint64_t seed, int rank, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed ^ (static_cast<uint64_t>(rank + 1) * 0xD1B54A32D192ED03ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int>(x % 129) - 64) / 64.0f;
}

template <typename T>
__host__ __device__ T to_t(float v);
template <>
__host__ __device__ inline float to_t<float>(float v) {
  return v;
}
template <>
__host__ __device__ inline __half to_t<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__host__ __device__ inline __nv_bfloat16 to_t<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
__host__ __device__ inline float to_f(float v) { return v; }
__host__ __device__ inline float to_f(__half v) { return __half2float(v); }
__host__ __device__ inline float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

}  // namespace tdist::test
