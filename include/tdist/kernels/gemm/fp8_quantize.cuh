// Row quantisation to e4m3 with one fp32 scale per row and 128 columns (DeepSeek-V3's activation
// scales): the A operand of the FP8 grouped GEMM (sm90_fp8_gemm.cuh), in one pass over the input.
// With kSwiGlu the quantised rows are SiLU(gate) * up of a [gate | up] input, computed in fp32, so
// that the MoE layer's activation between its two projections is read once and written in e4m3.
//
// Layouts (row-major, T = __nv_bfloat16, __half or float):
//   x       T[rows][ldx]             kSwiGlu: gate = columns [0, k), up = columns [k, 2 k)
//   q       e4m3[rows][ldq]          columns [0, k)
//   scales  f32 scales[r * scale_ld + kb * scale_kb_stride]: row-major [rows][ceil(k / 128)] or
//           column-major [ceil(k / 128)][>= rows] (the FP8 GEMM's faster A scales)
// Block (r, kb) covers columns [128 kb, 128 kb + 128) of row r (zeros past k): scale = max(amax,
// 1e-12) x fp32(1 / 448) and q = e4m3(v / scale), rounded to nearest, saturating at +-448; v ~ q x scale. The
// same arithmetic as tdist.moe.quantize_fp8_rows's torch form, so the two agree bit for bit on the
// same input rows.
//
// Work: one warp per block, lane l on columns 128 kb + 4 l .. + 3 (k a multiple of 16, so a lane's
// four columns are all inside k or all past it); blocks in a grid-stride loop. Memory bound: each
// element is read once (twice the columns with kSwiGlu) and written as one byte. The parameters
// are plain C++ (host, nvcc, NVRTC); the kernel compiles under nvcc and NVRTC.
#pragma once

#include "tdist/kernels/gemm/config.cuh"  // kFp8BlockK

namespace tdist::kernels::gemm {

using device::u32;
using device::u64;

constexpr int kQuantizeThreads = 256;
constexpr float kE4m3Max = 448.0f;              // the largest finite e4m3 value
constexpr float kInvE4m3Max = 1.0f / kE4m3Max;  // scales are amax times this, as torch divides by a scalar
constexpr float kMinAmax = 1e-12f;              // an all-zero block's amax: a tiny positive scale, q = 0

struct Fp8QuantizeParams {
  const void* x;
  u64 ldx;  // elements
  void* q;
  u64 ldq;  // bytes
  float* scales;
  u64 scale_ld;         // row stride of the scales: ceil(k / 128) when dense row-major, 1 column-major
  u64 scale_kb_stride;  // 1 row-major
  u64 rows;
  u32 k;
};

}  // namespace tdist::kernels::gemm

#if defined(__CUDACC__)
#include <cuda_fp8.h>

#include "tdist/device/grid_dependency.cuh"
#include "tdist/kernels/collectives/common.cuh"  // to_f32

namespace tdist::kernels::gemm {

// Four consecutive T of a row as fp32 (8 or 16 bytes; 8-byte aligned for 2-byte T, 16 for float).
template <typename T>
TDIST_DEVICE void load4(const T* p, float (&v)[4]) {
  if constexpr (sizeof(T) == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = coll::to_f32(e[j]);
  }
}

template <typename T, bool kSwiGlu>
__global__ void __launch_bounds__(kQuantizeThreads) fp8_quantize_rows(Fp8QuantizeParams p) {
  constexpr u32 kWarps = kQuantizeThreads / 32;
  const u32 lane = threadIdx.x % 32;
  const u32 blocks_per_row = (p.k + kFp8BlockK - 1) / kFp8BlockK;
  const u64 items = p.rows * blocks_per_row;
  const T* x = static_cast<const T*>(p.x);
  device::wait_for_prior_grid();  // the input's producer, under programmatic dependent launch
  device::allow_dependent_launch();
  for (u64 item = static_cast<u64>(blockIdx.x) * kWarps + threadIdx.x / 32; item < items;
       item += static_cast<u64>(gridDim.x) * kWarps) {  // warp-uniform: every lane shuffles
    const u64 row = item / blocks_per_row;
    const u32 kb = static_cast<u32>(item % blocks_per_row);
    const u32 col = kb * kFp8BlockK + 4 * lane;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (col < p.k) {
      const T* src = x + row * p.ldx + col;
      load4(src, v);
      if constexpr (kSwiGlu) {
        float up[4];
        load4(src + p.k, up);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = v[j] / (1.0f + expf(-v[j])) * up[j];  // SiLU(gate) * up
      }
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = fmaxf(amax, kMinAmax) * kInvE4m3Max;
    if (col < p.k) {
      const __nv_fp8x2_storage_t lo =
          __nv_cvt_float2_to_fp8x2(make_float2(v[0] / scale, v[1] / scale), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t hi =
          __nv_cvt_float2_to_fp8x2(make_float2(v[2] / scale, v[3] / scale), __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<u32*>(static_cast<unsigned char*>(p.q) + row * p.ldq + col) =
          static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
    }
    if (lane == 0) p.scales[row * p.scale_ld + kb * p.scale_kb_stride] = scale;
  }
}

}  // namespace tdist::kernels::gemm
#endif  // __CUDACC__
