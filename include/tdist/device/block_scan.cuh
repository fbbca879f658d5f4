// Exclusive prefix sums across one thread block (device code only; nvcc and NVRTC).
#pragma once

#include "tdist/device/common.cuh"

#if defined(__CUDACC__)
namespace tdist::device {

// Exclusive prefix over the block's kThreads threads (a multiple of 32, all of them calling) of N
// values per thread, in place, and their totals over the block. warp_sums: shared scratch of
// kThreads / 32 rows. Ends with a barrier, so warp_sums may be reused at once; the barrier at its
// middle also orders every thread's earlier shared and global writes before the others' later ones.
template <u32 kThreads, int N>
__device__ __forceinline__ void block_exclusive_scan(u32 (&v)[N], u32 (&total)[N], u32 (*warp_sums)[N]) {
  static_assert(kThreads % 32 == 0, "whole warps");
  const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  u32 incl[N];
#pragma unroll
  for (int c = 0; c < N; ++c) {
    u32 x = v[c];
#pragma unroll
    for (u32 d = 1; d < 32; d <<= 1) {
      const u32 y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    incl[c] = x;
    if (lane == 31) warp_sums[warp][c] = x;
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < N; ++c) {
    u32 before = 0, all = 0;
    for (u32 w = 0; w < kThreads / 32; ++w) {
      const u32 s = warp_sums[w][c];
      before += w < warp ? s : 0;
      all += s;
    }
    v[c] = before + incl[c] - v[c];
    total[c] = all;
  }
  __syncthreads();  // warp_sums free again
}

}  // namespace tdist::device
#endif
