// The overlap ops' kernels beside the GEMM (include/tdist/ops/gemm_overlap.hpp): the flag wait
// between chunked GEMMs and the fp32 reduction of ReduceScatter partials. Compiles under NVRTC and
// nvcc.
#pragma once

#include "tdist/device/signal.cuh"
#include "tdist/kernels/collectives/common.cuh"  // to_f32 / from_f32
#include "tdist/kernels/gemm/overlap_params.cuh"

// One thread waits until flags[i] >= 1 for i in [first, first + count) except i == `skip` (-1: none).
extern "C" __global__ void tdist_overlap_wait_flags(const tdist::device::u64* flags, int first, int count, int skip) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int i = first; i < first + count; ++i)
    if (i != skip) tdist::device::signal_wait_until<tdist::device::Scope::kSystem>(flags + i, tdist::device::Cmp::kGe, tdist::device::u64{1});
}

namespace tdist::kernels::gemm {

// The reduction of ReduceParams (overlap_params.cuh).
template <typename T>
__global__ void __launch_bounds__(512) overlap_reduce(ReduceParams p) {
  using namespace tdist::kernels::coll;
  if (p.flags != nullptr && threadIdx.x < static_cast<unsigned>(p.num_sources) && static_cast<int>(threadIdx.x) != p.skip_wait)
    tdist::device::signal_wait_until<tdist::device::Scope::kSystem>(p.flags + threadIdx.x, tdist::device::Cmp::kGe, u64{1});
  __syncthreads();
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  const u64 tid = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool vec = p.n % 8 == 0 && p.out_ld % 8 == 0 && reinterpret_cast<u64>(p.out) % 16 == 0;
  for (int s = 0; s < p.num_sources; ++s) vec = vec && reinterpret_cast<u64>(p.src[s]) % 16 == 0;
  if (vec) {
    // 8 elements (16 bytes) per step.
    const u64 row_vecs = p.n / 8, total = p.rows * row_vecs;
    for (u64 v = tid; v < total; v += stride) {
      const u64 row = v / row_vecs, col = (v % row_vecs) * 8;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int s = 0; s < p.num_sources; ++s) {
        const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.src[s]) + row * p.n + col);
        const T* e = reinterpret_cast<const T*>(&x);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += to_f32(e[i]);
      }
      uint4 y;
      T* o = reinterpret_cast<T*>(&y);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = from_f32<T>(acc[i]);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row * p.out_ld + col) = y;
    }
  } else {
    const u64 total = p.rows * p.n;
    for (u64 e = tid; e < total; e += stride) {
      const u64 row = e / p.n, col = e % p.n;
      float acc = 0;
      for (int s = 0; s < p.num_sources; ++s) acc += to_f32(static_cast<const T*>(p.src[s])[row * p.n + col]);
      static_cast<T*>(p.out)[row * p.out_ld + col] = from_f32<T>(acc);
    }
  }
}

}  // namespace tdist::kernels::gemm
