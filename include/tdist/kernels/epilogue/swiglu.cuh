// SwiGLU of a GEMM's output, the gated activation of LLaMA-style MLPs: d = silu(gate) * up, where
// each row of h holds the gate columns first and the up columns after them.
//
//   h  T[rows][2 * n_half]   row-major: h[i][j] the gate, h[i][n_half + j] the up projection
//   d  T[rows][n_half]       row-major: d[i][j] = silu(h[i][j]) * h[i][n_half + j], fp32 math
//
// n_half a multiple of 8 and both pointers 16-byte aligned: each thread moves 16-byte vectors (8
// elements of 2 bytes). Compiles under NVRTC and nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tdist/kernels/collectives/common.cuh"  // to_f32 / from_f32

namespace tdist::kernels::epilogue {

using device::u32;
using device::u64;

template <typename T>
__global__ void __launch_bounds__(256) swiglu_rows(const T* __restrict__ h, T* __restrict__ d, u64 rows, u32 n_half) {
  constexpr int kV = 16 / sizeof(T);  // elements per 16-byte vector
  const u64 vectors_per_row = n_half / kV;
  const u64 total = rows * vectors_per_row;
  for (u64 v = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<u64>(gridDim.x) * blockDim.x) {
    const u64 row = v / vectors_per_row, col = (v % vectors_per_row) * kV;
    const T* gate_row = h + row * 2 * n_half;
    const uint4 g = *reinterpret_cast<const uint4*>(gate_row + col);
    const uint4 u = *reinterpret_cast<const uint4*>(gate_row + n_half + col);
    const T* ge = reinterpret_cast<const T*>(&g);
    const T* ue = reinterpret_cast<const T*>(&u);
    uint4 y;
    T* ye = reinterpret_cast<T*>(&y);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const float x = coll::to_f32(ge[j]);
      ye[j] = coll::from_f32<T>(x / (1.0f + __expf(-x)) * coll::to_f32(ue[j]));
    }
    *reinterpret_cast<uint4*>(d + row * n_half + col) = y;
  }
}

}  // namespace tdist::kernels::epilogue
