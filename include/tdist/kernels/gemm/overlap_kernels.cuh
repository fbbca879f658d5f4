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
    if (i != skip)
      tdist::device::signal_wait_until<tdist::device::Scope::kSystem>(flags + i, tdist::device::Cmp::kGe,
                                                                      tdist::device::u64{1});
}

namespace tdist::kernels::gemm {

// The reduction of ReduceParams (overlap_params.cuh): the collectives' fp32 reduce_range over each
// block's share of the rows x n elements.
template <typename T>
__global__ void __launch_bounds__(512) overlap_reduce(ReduceParams p) {
  using namespace tdist::kernels::coll;
  if (p.flags != nullptr && threadIdx.x < static_cast<unsigned>(p.num_sources) &&
      static_cast<int>(threadIdx.x) != p.skip_wait)
    tdist::device::signal_wait_until<tdist::device::Scope::kSystem>(p.flags + threadIdx.x, tdist::device::Cmp::kGe,
                                                                    u64{1});
  __shared__ const char* srcs[kMaxOverlapRanks];
  bool vec = reinterpret_cast<u64>(p.out) % 16 == 0;
  for (int s = 0; s < p.num_sources; ++s) vec = vec && reinterpret_cast<u64>(p.src[s]) % 16 == 0;
  if (threadIdx.x < static_cast<unsigned>(p.num_sources))
    srcs[threadIdx.x] = static_cast<const char*>(p.src[threadIdx.x]);
  __syncthreads();
  u64 lo, hi;
  block_range(p.rows * p.n, blockIdx.x, gridDim.x, 8, lo, hi);
  reduce_range<T>(static_cast<T*>(p.out), srcs, p.num_sources, lo, hi, vec);
}

}  // namespace tdist::kernels::gemm
