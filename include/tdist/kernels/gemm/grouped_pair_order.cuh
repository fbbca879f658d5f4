// The m-tile order under which a 2-CTA cluster shares B in a grouped walk (sm90_gemm.cuh with
// kClusterM = 2, GroupedScheduler). A cluster takes the tiles at linear positions 2q and 2q + 1 of
// the walk: with an even raster group_m, the same n-tile of the m-tiles at walk positions 2j and
// 2j + 1. Both multiply one B (each CTA then loads half of it for both) only when the two m-tiles
// belong to one group. In the plain walk (position = m-tile) a group whose first m-tile is odd
// straddles pairs: with 1 to 3 tiles per group, about half of the pairs that could share do not.
// This order keeps every group's m-tiles two by two at even positions:
//   positions [0, 2P)   pair j of group g at 2 (pairs(g) + j), 2 (pairs(g) + j) + 1: its m-tiles
//                       first(g) + 2j, first(g) + 2j + 1, groups in order
//   positions [2P, T)   the last m-tile of every group with an odd count, groups in order
// where group g owns m-tiles [first(g), first(g) + count(g)) (group_tiles, below), pairs(g) =
// sum over groups before g of count / 2, P = pairs(G) and T the walk's m-tiles. The order is a
// permutation of [0, T) when the offsets follow the layout's rules; for offsets that break them,
// every entry is still an m-tile below T (a position no group writes keeps its own index).
// One block computes it on the device (the offsets live there): a scan over the groups.
#pragma once

#include "tdist/kernels/gemm/grouped_scheduler.cuh"

namespace tdist::kernels::gemm {

constexpr u32 kPairOrderThreads = 512;

// The m-tiles of group `g` of a prepared walk: [*first, *first + *count), clipped to its tiles_m.
TDIST_HOST_DEVICE void group_tiles(const GroupedScheduler& s, u32 g, u32* first, u32* count) {
  const u64 begin = (s.offset(g) + s.block_m - 1) / s.block_m, end = (s.offset(g + 1) + s.block_m - 1) / s.block_m;
  const u32 b = begin < s.tiles_m ? static_cast<u32>(begin) : s.tiles_m;
  const u32 e = end < s.tiles_m ? static_cast<u32>(end) : s.tiles_m;
  *first = b;
  *count = e > b ? e - b : 0;
}

}  // namespace tdist::kernels::gemm

#if defined(__CUDACC__)
#include "tdist/device/block_scan.cuh"

namespace tdist::kernels::gemm {

// Writes the order above into order[0 .. tiles) for `groups` groups whose m-tiles tiles_of(g, &first,
// &count) gives (in increasing order, together at most `tiles`), run by all kThreads threads of the
// block: thread i takes a run of consecutive groups. warp_sums: shared scratch of kThreads / 32 rows.
template <u32 kThreads, typename TilesOf>
__device__ __forceinline__ void write_pair_order(TilesOf tiles_of, u32 groups, u32 tiles, u32* order,
                                                 u32 (*warp_sums)[2]) {
  const u32 tid = threadIdx.x;
  for (u32 p = tid; p < tiles; p += kThreads) order[p] = p;
  const u32 per = (groups + kThreads - 1) / kThreads;
  const u32 g_begin = tid * per < groups ? tid * per : groups;
  const u32 g_end = g_begin + per < groups ? g_begin + per : groups;
  u32 v[2] = {0, 0}, total[2];  // this thread's pairs and lone tiles, then those of the threads before it
  for (u32 g = g_begin; g < g_end; ++g) {
    u32 first, count;
    tiles_of(g, &first, &count);
    v[0] += count / 2;
    v[1] += count % 2;
  }
  // Its barrier also orders the identity writes above before the writes below.
  device::block_exclusive_scan<kThreads, 2>(v, total, warp_sums);
  u32 pair = v[0], lone = 2 * total[0] + v[1];
  for (u32 g = g_begin; g < g_end; ++g) {
    u32 first, count;
    tiles_of(g, &first, &count);
    for (u32 i = 0; i + 1 < count; i += 2, ++pair)
      if (2 * pair + 1 < tiles) {  // always, for offsets that follow the rules
        order[2 * pair] = first + i;
        order[2 * pair + 1] = first + i + 1;
      }
    if (count % 2 == 1 && lone < tiles) order[lone++] = first + count - 1;
  }
}

// The order of the walk `sched` (a plain one: no order table) into order[0 .. T). One block of
// kThreads threads (kPairOrderThreads; a template, so that only the module naming it compiles it).
template <u32 kThreads>
__global__ void __launch_bounds__(kThreads) grouped_pair_order(GroupedScheduler sched, u32* order) {
  __shared__ u32 warp_sums[kThreads / 32][2];
  const GroupedScheduler s = sched.prepare();
  write_pair_order<kThreads>([&](u32 g, u32* first, u32* count) { group_tiles(s, g, first, count); }, s.num_groups,
                             s.tiles_m, order, warp_sums);
}

}  // namespace tdist::kernels::gemm
#endif
