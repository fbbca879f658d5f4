// AllReduce on SMs, fp32 accumulation in rank order (every rank's result is bit-identical).
// p.count = elements of the buffer.
//
// ar_one_shot<T>: block b of every rank owns element range R_b.
//   1. copy in[R_b] into this rank's workspace slot (skipped when p.zero_copy);
//   2. exchange phase 0;
//   3. out[R_b] = sum over ranks of their R_b, read over NVLink (num_ranks reads per element);
//   4. zero copy only: exchange phase 1 (peers read `in` until then; out must differ from in).
// ar_two_shot<T>: the buffer is cut into num_ranks slices of S elements (S a multiple of 8, the
// last slices shorter or empty when count < num_ranks * S); block b owns range R_b of each slice.
// A rank whose slice is empty reduces nothing (reduce_range of an empty range writes nothing: it
// must not touch its slot, which the owners of the other slices are reading).
//   1. copy R_b of every slice into the workspace slot (skipped when p.zero_copy);
//   2. exchange phase 0;
//   3. reduce R_b of slice `me` over all ranks (reduce-scatter) into the slot (at the same offset)
//      and into out;
//   4. exchange phase 1;
//   5. read R_b of slice s from rank s's slot for every s != me (all-gather) into out.
//   Each rank reads (num_ranks - 1) / num_ranks of the buffer twice instead of (num_ranks - 1)
//   times: the method for large buffers. No closing exchange is needed even in zero copy: a peer
//   raises phase 1 only after it has read its slice of `in`.
#pragma once

#include "tdist/kernels/collectives/common.cuh"

namespace tdist::kernels::coll {

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ar_one_shot(CollParams p) {
  const u64 e = begin_call(p.epoch);
  const int n = p.heap.num_ranks;
  const u64 sz = sizeof(T);
  u64 lo, hi;
  block_range(p.count, blockIdx.x, gridDim.x, 8, lo, hi);
  char* slot = slot_of(p, e);
  const char* in = static_cast<const char*>(p.in);
  if (!p.zero_copy) block_copy(slot + lo * sz, in + lo * sz, (hi - lo) * sz);
  exchange(p, 0, e);
  __shared__ const char* srcs[kMaxLsaRanks];
  gather_sources(p, in, slot, srcs);
  reduce_range<T>(static_cast<T*>(p.out), srcs, n, lo, hi, p.vec != 0);
  if (p.zero_copy) exchange(p, 1, e);
  end_call(p.epoch, e);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ar_two_shot(CollParams p) {
  const u64 e = begin_call(p.epoch);
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 sz = sizeof(T), count = p.count;
  const u64 S = two_shot_slice(count, n);
  u64 lo, hi;
  block_range(S, blockIdx.x, gridDim.x, 8, lo, hi);
  char* slot = slot_of(p, e);
  const char* in = static_cast<const char*>(p.in);
  T* out = static_cast<T*>(p.out);
  // [a, b) of slice s within the buffer, clipped to count.
  auto clip = [&](int s, u64& a, u64& b) {
    a = s * S + lo;
    b = s * S + hi;
    if (a > count) a = count;
    if (b > count) b = count;
  };
  if (!p.zero_copy) {
    for (int s = 0; s < n; ++s) {
      u64 a, b;
      clip(s, a, b);
      block_copy(slot + a * sz, in + a * sz, (b - a) * sz);
    }
  }
  exchange(p, 0, e);
  __shared__ const char* srcs[kMaxLsaRanks];
  gather_sources(p, in, slot, srcs);
  u64 a, b;
  clip(me, a, b);
  // Reduce into the slot (peers read it in step 5), then copy to out.
  reduce_range<T>(reinterpret_cast<T*>(slot), srcs, n, a, b, p.vec != 0);
  __syncthreads();
  block_copy(out + a, slot + a * sz, (b - a) * sz);
  exchange(p, 1, e);
  for (int k = 1; k < n; ++k) {
    const int s = (me + k) % n;
    clip(s, a, b);
    tdist::device::detail::group_copy<BlockGroup>(out + a, p.heap.symm_at(slot, s) + a * sz, (b - a) * sz);
  }
  end_call(p.epoch, e);
}

}  // namespace tdist::kernels::coll
