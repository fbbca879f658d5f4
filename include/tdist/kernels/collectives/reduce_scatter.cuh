// ReduceScatter kernels. Input: num_ranks slices of C elements (p.count = C); output: C elements,
// rank r gets the fp32-accumulated sum over ranks of slice r.
//
// rs_fused<T> (pull and reduce in one kernel): block b of every rank owns the same element range
// R_b of each slice.
//   1. copy slice s's R_b, for every s != me, into this rank's workspace slot (skipped when
//      p.zero_copy: peers read `in` itself);
//   2. exchange phase 0 with block b of every peer;
//   3. out[R_b] = sum over ranks r (in rank order) of rank r's slice `me`, read over NVLink;
//   4. zero copy only: exchange phase 1 (no peer still reads `in` after the call).
// rs_ce_pipelined<T> (the SM half of the copy-engine variant): the peers' copy engines put their
// slice `me` into this rank's workspace slot 0 at [r * C] in `pieces` pieces (ce_piece_start),
// raising ce_flags[c * n + r] after piece c; every block adds up its share of piece c once piece c's
// flags are up, while the later pieces are still in flight.
#pragma once

#include "tdist/kernels/collectives/common.cuh"

namespace tdist::kernels::coll {

// Pieces of the copy-engine ReduceScatter: piece c of k covers elements [start(c), start(c + 1)) of
// the C a peer sends, halving in size (C/2, C/4, ..., the last two equal). Each copy costs the copy
// engine a few microseconds, and the reduction of the last piece is left after the last copy: the
// halving keeps both few and small. Starts are multiples of 8 elements (16-byte vectors).
TDIST_HOST_DEVICE u64 ce_piece_start(u64 C, int k, int c) {
  if (c <= 0) return 0;
  if (c >= k) return C;
  return (C - (C >> c)) / 8 * 8;
}

}  // namespace tdist::kernels::coll

#if defined(__CUDACC__)
namespace tdist::kernels::coll {

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) rs_fused(CollParams p) {
  const u64 e = begin_call(p.epoch);
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 C = p.count, sz = sizeof(T);
  u64 lo, hi;
  block_range(C, blockIdx.x, gridDim.x, 8, lo, hi);
  char* slot = slot_of(p, e);
  const char* in = static_cast<const char*>(p.in);
  if (!p.zero_copy)
    for (int s = 0; s < n; ++s)
      if (s != me) block_copy(slot + (s * C + lo) * sz, in + (s * C + lo) * sz, (hi - lo) * sz);
  exchange(p, 0, e);
  __shared__ const char* srcs[kMaxLsaRanks];
  const char* shared_src = p.zero_copy ? in : slot;
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    srcs[r] = (r == me ? in : static_cast<const char*>(p.heap.symm_at(shared_src, r))) + me * C * sz;
  __syncthreads();
  reduce_range<T>(static_cast<T*>(p.out), srcs, n, lo, hi, p.vec != 0);
  if (p.zero_copy) exchange(p, 1, e);
  end_call(p.epoch, e);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) rs_ce_pipelined(CollParams p, const u64* ce_flags, int pieces) {
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 C = p.count, sz = sizeof(T);
  __shared__ const char* srcs[kMaxLsaRanks];
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    srcs[r] = r == me ? static_cast<const char*>(p.in) + me * C * sz : p.ws + r * C * sz;
  for (int c = 0; c < pieces; ++c) {
    if (static_cast<int>(threadIdx.x) < n && static_cast<int>(threadIdx.x) != me)
      signal_wait_until<Scope::kSystem>(ce_flags + c * n + threadIdx.x, Cmp::kGe, u64{1});
    __syncthreads();
    const u64 c_lo = ce_piece_start(C, pieces, c), c_hi = ce_piece_start(C, pieces, c + 1);
    u64 lo, hi;
    block_range(c_hi - c_lo, blockIdx.x, gridDim.x, 8, lo, hi);
    reduce_range<T>(static_cast<T*>(p.out), srcs, n, c_lo + lo, c_lo + hi, p.vec != 0);
  }
}

}  // namespace tdist::kernels::coll
#endif
