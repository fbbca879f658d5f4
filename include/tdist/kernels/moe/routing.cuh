// MoE routing under tensor parallelism, on the GPU: the (token, k) pairs of the router's top-k ids
// sorted by expert into the row layout of the grouped GEMM, and the tile orders of the overlapped
// ops. Plain C++ above the kernels (host, nvcc, NVRTC): the host reference (ops/moe.hpp) and the
// kernels share the rules written here.
//
// Inputs: topk_ids int32[M][topk] (every token's experts, the same on every rank), M tokens split
// over the ranks as RowChunks{M, world}: rank r owns tokens [begin(r), +rows(r)).
//
// Pair order: this rank walks the pairs "rotated", its own tokens first: position q in [0, M topk)
// is token t = (begin(rank) + q / topk) mod M, slot k = q mod topk. A token's relative source is
// rel(t) = (owner(t) - rank) mod world, non-decreasing along q.
//
// Row layout ("m-grouped contiguous", kernels/gemm/grouped_scheduler.cuh), int32 everywhere:
//   offsets      [E + 1]     expert e owns rows [offsets[e], offsets[e + 1]), its count padded up to
//                            kMoeTile (= kGroupedAlignment); offsets[0] = 0
//   counts       [E]         real pairs of expert e (rows [offsets[e], +counts[e]) hold them)
//   token_of_row [capacity]  the token of each row, -1 for padding rows; within an expert the pairs
//                            keep their rotated order, so rows come in rel order (own tokens first)
//   row_of_pair  [M][topk]   the row of pair (t, k): undoes the sort
// capacity = moe_capacity(M, topk, E) bounds offsets[E] for any routing.
//
// Compact order (optional outputs, for the backward's torch._grouped_mm, which takes any group
// sizes): the same pairs in the same order without the padding; pair c of [0, M topk):
//   compact_offsets  [E + 1]    expert e owns [compact_offsets[e], +counts[e])
//   row_of_compact   [M topk]   its row above: c - compact_offsets[e] + offsets[e]
//   token_of_compact [M topk]   its token
//   pair_of_compact  [M topk]   its pair t topk + k
//   compact_of_pair  [M][topk]  the inverse of pair_of_compact
//
// Tiles: tile i holds rows [i kMoeTile, +kMoeTile) (one expert; at least one real row). Two orders,
// each as world lists of u32[max_tiles] plus a count per list:
//   ag order, list j: tiles whose last real row has rel j, i.e. whose rows all come from source
//            chunks (rank + 0 .. j) mod world: AllGather + grouped GEMM runs list j once chunk
//            (rank + j) mod world has landed (list 0: this rank's tokens only, before any wait)
//   rs order, list s: tiles whose earliest-needed row is at step s of the ReduceScatter's order
//            rel 1, 2, ..., world - 1, 0 (peers first, own tokens last): step(rel) =
//            (rel + world - 1) mod world, the tile's key = min step over its real rows; after list s
//            every row of rel (s + 1) mod world is computed
// Tiles keep increasing index within a list.
// Pair order: u32[offsets[E] / kMoeTile], every tile once, each expert's tiles two by two at even
// positions (kernels/gemm/grouped_pair_order.cuh): the walk of the grouped GEMM in a 2-CTA cluster.
#pragma once

#include "tdist/kernels/gemm/grouped_pair_order.cuh"
#include "tdist/kernels/gemm/grouped_scheduler.cuh"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/kernels/moe/common.cuh"

namespace tdist::kernels::moe {

constexpr u32 kRouteThreads = 256;

// Rows any routing of m tokens, top-k of `experts`, can need: every pair plus a partial tile per
// non-empty expert, rounded down to whole tiles (offsets[E] is a multiple of kMoeTile).
TDIST_HOST_DEVICE u64 moe_capacity(u64 m, u32 topk, u32 experts) {
  const u64 pairs = m * topk;
  const u64 padded_experts = pairs < experts ? pairs : experts;
  return (pairs + padded_experts * (kMoeTile - 1)) / kMoeTile * kMoeTile;
}
TDIST_HOST_DEVICE u64 moe_max_tiles(u64 m, u32 topk, u32 experts) { return moe_capacity(m, topk, experts) / kMoeTile; }

// The rotated pair order of `rank` (layout above).
struct RotatedPairs {
  gemm::RowChunks split;  // tokens per rank
  u32 topk;
  int rank;

  TDIST_HOST_DEVICE u64 first_token() const { return split.begin(rank); }
  TDIST_HOST_DEVICE u64 token(u64 q) const {
    const u64 t = first_token() + q / topk;
    return t >= split.m ? t - split.m : t;
  }
  TDIST_HOST_DEVICE u32 slot(u64 q) const { return static_cast<u32>(q % topk); }
  TDIST_HOST_DEVICE int rel(u64 token) const {
    return (split.chunk_of(token) - rank + split.num_ranks) % split.num_ranks;
  }
};

// ReduceScatter step of a relative source: peers first (rel 1 at step 0), own tokens last.
TDIST_HOST_DEVICE int rs_step(int rel, int world) { return (rel + world - 1) % world; }

// Segments: the rotated pairs of each relative source j (one rank's tokens, pairs
// [rel_begin(j), rel_begin(j + 1))) cut into runs of `segment` pairs, source after source, so that no
// segment spans two sources: per-segment expert counts then give every expert's pairs per source,
// which is all the tile lists need (a tile's rows are a run of its expert's pairs, in rel order).
struct RouteSegments {
  RotatedPairs pairs;
  u32 segment;  // pairs per segment, a multiple of kRouteThreads

  // Pairs fit int32 (check_moe_routing_args), so 32-bit arithmetic: no 64-bit division routine on
  // the device.
  TDIST_HOST_DEVICE int world() const { return pairs.split.num_ranks; }
  TDIST_HOST_DEVICE u32 rel_pairs(int j) const {  // RowChunks::rows of rank + j, times topk
    const u32 m = static_cast<u32>(pairs.split.m), w = static_cast<u32>(world());
    const u32 r = static_cast<u32>((pairs.rank + j) % world());
    return (m / w + (r < m % w ? 1u : 0u)) * pairs.topk;
  }
  TDIST_HOST_DEVICE u32 rel_segments(int j) const { return (rel_pairs(j) + segment - 1) / segment; }
  TDIST_HOST_DEVICE u32 count() const {
    u32 n = 0;
    for (int j = 0; j < world(); ++j) n += rel_segments(j);
    return n;
  }
  // Pairs [*begin, *end) of segment s (empty past the last segment).
  TDIST_HOST_DEVICE void range(u32 s, u64* begin, u64* end) const {
    u64 first_pair = 0;
    for (int j = 0; j < world(); ++j) {
      const u64 len = rel_pairs(j);  // u64: begin + segment may pass 2^32 below
      const u32 n = rel_segments(j);
      if (s < n) {
        *begin = first_pair + static_cast<u64>(s) * segment;
        *end = *begin + segment < first_pair + len ? *begin + segment : first_pair + len;
        return;
      }
      s -= n;
      first_pair += len;
    }
    *begin = *end = 0;
  }
};

// Segment size: a block of the count and build kernels per segment. Long segments cost the build
// kernel's placement (phase 4: a step with three block barriers per kRouteThreads pairs of its
// segment); many segments cost its phase 1, where every block reads every segment's counts (a round
// of 8 loads per 8 segments, for each kRouteThreads experts). For P pairs in S segments and
// c = ceil(E / kRouteThreads):
//   time ~ a (P / S) / kRouteThreads + b S c / 8,  minimal at S* = sqrt(a 8 P / (b c kRouteThreads))
// with a = 4 b (fitted on one H200: the routing's time over segments of 256 to 4096 pairs, 256 to
// 524288 pairs, 8 to 1024 experts; docs/moe.md), i.e. S* = sqrt(P / (8 c)). The size is P / S*
// rounded up to a multiple of kRouteThreads, so that at most S* segments hold whole runs (and a
// segment per source may be partial: count() <= S* + world).
TDIST_HOST_DEVICE u64 route_isqrt(u64 v) {  // floor(sqrt(v)), no library call (NVRTC)
  u64 r = 0;
  for (u64 bit = u64{1} << 31; bit > 0; bit >>= 1)
    if ((r + bit) * (r + bit) <= v) r += bit;
  return r;
}
TDIST_HOST_DEVICE u64 route_target_segments(u64 pairs, u32 experts) {
  const u64 c = (experts + kRouteThreads - 1) / kRouteThreads;
  const u64 s = route_isqrt(pairs / (8 * (c > 0 ? c : 1)));
  return s > 0 ? s : 1;
}
TDIST_HOST_DEVICE u32 route_segment_size(u64 pairs, u32 experts) {
  const u64 s = route_target_segments(pairs, experts);
  const u64 per = (pairs + s - 1) / s;
  const u64 size = (per + kRouteThreads - 1) / kRouteThreads * kRouteThreads;
  return static_cast<u32>(size > kRouteThreads ? size : kRouteThreads);
}
// Segments any routing of up to `pairs` pairs over `world` ranks can need (the count buffer's rows):
// route_target_segments grows with the pairs.
TDIST_HOST_DEVICE u64 route_max_segments(u64 pairs, u32 experts, int world) {
  return route_target_segments(pairs, experts) + static_cast<u64>(world);
}

// The two list keys of tile i of an expert with `count` pairs, from the expert's pairs per source:
// cum(j) = its pairs of rel < j (cum(0) = 0, cum(world) = count). The tile's real rows are the
// expert's pairs [i kMoeTile, min((i + 1) kMoeTile, count)) in rel order, so the rels it holds are
// those of non-empty sources between the rels of its first and last row.
struct TileKeys {
  int ag, rs;
};
template <typename Cum>
TDIST_HOST_DEVICE TileKeys tile_keys(Cum cum, u32 count, u32 i, int world) {
  auto at = [&](int j) -> u32 { return j == 0 ? 0u : j == world ? count : cum(j); };
  const u32 first = i * kMoeTile;
  const u32 last = (first + kMoeTile < count ? first + kMoeTile : count) - 1;
  int rel_first = 0, rel_last = 0;  // the largest j with cum(j) <= row
  for (int j = 1; j < world; ++j) {
    const u32 c = at(j);
    if (c <= first) rel_first = j;
    if (c <= last) rel_last = j;
  }
  int rs = world - 1;
  for (int j = rel_first; j <= rel_last; ++j)
    if (at(j + 1) > at(j)) rs = rs_step(j, world) < rs ? rs_step(j, world) : rs;
  return {rel_last, rs};
}

// The first expert id outside [0, experts) that the count kernel met since the host last took the
// report: ordinary device memory, claimed by the thread that wins `owner` (0 -> 1) and read by the
// host after a synchronisation (MoeRouter::check_errors), which zeroes it again.
struct BadIdRecord {
  u32 owner;
  int id;
  u32 token, slot;
};

struct RouteParams {
  const int* topk_ids;  // int32[M][topk]
  BadIdRecord* bad;     // owner 0 until an id outside [0, experts) is met
  RouteSegments segments;
  u32 experts;
  u32 num_segments;     // segments.count()
  u32* segment_counts;  // u32[num_segments][E]: pairs of each expert per segment (count kernel)
  int* offsets;         // int32[E + 1]
  int* counts;          // int32[E]
  int* token_of_row;    // int32[capacity]
  int* row_of_pair;     // int32[M][topk]
  // The compact order (layout above); compact_offsets null: none written.
  int* compact_offsets;   // int32[E + 1]
  int* row_of_compact;    // int32[M topk]
  int* token_of_compact;  // int32[M topk]
  int* pair_of_compact;   // int32[M topk]
  int* compact_of_pair;   // int32[M][topk]
  u32* ag_order;        // u32[world][max_tiles]
  u32* ag_count;        // u32[world]
  u32* rs_order;        // u32[world][max_tiles]
  u32* rs_count;        // u32[world]
  u32* pair_order;      // u32[max_tiles]
  u32 max_tiles;
};

}  // namespace tdist::kernels::moe

#if defined(__CUDACC__)
#include "tdist/device/block_scan.cuh"
#include "tdist/device/grid_dependency.cuh"

namespace tdist::kernels::moe {

constexpr u32 kRouteWarps = kRouteThreads / 32;

// An id outside [0, experts) is routed to expert 0 by both kernels (so that every buffer stays
// consistent and no kernel traps, which would lose the CUDA context); kCheck: the count kernel also
// prints and records the first one, which MoeRouter::check_errors reports naming topk_ids.
template <bool kCheck>
__device__ __forceinline__ int route_expert(const RouteParams& p, u64 q, u64* token_out, u32* slot_out) {
  // Pairs and rows fit int32 (check_moe_routing_args): 32-bit division, no 64-bit division routine.
  const RotatedPairs& pairs = p.segments.pairs;
  const u32 q32 = static_cast<u32>(q);
  u64 t = pairs.first_token() + q32 / pairs.topk;
  t = t >= pairs.split.m ? t - pairs.split.m : t;
  const u32 k = q32 % pairs.topk;
  int e = p.topk_ids[t * pairs.topk + k];
  if (e < 0 || static_cast<u32>(e) >= p.experts) {
    if (kCheck && atomicCAS(&p.bad->owner, 0u, 1u) == 0u) {
      printf(
          "tdist moe routing: topk_ids[%llu][%u] = %d is outside [0, %u) (the number of experts); routed to "
          "expert 0, reported by check_errors()\n",
          static_cast<unsigned long long>(t), k, e, p.experts);
      p.bad->id = e;
      p.bad->token = static_cast<u32>(t);
      p.bad->slot = k;
    }
    e = 0;
  }
  *token_out = t;
  *slot_out = k;
  return e;
}

// Per segment: pairs of each expert (grid: num_segments blocks of kRouteThreads).
//
// All four kernels of this file are launched as programmatic dependents (MoeKernels): each waits for
// the grid before it to complete before touching memory, and lets the next be scheduled at once (the
// next waits likewise), so launch gaps hide behind the kernel before.
__global__ void __launch_bounds__(kRouteThreads) moe_route_count(RouteParams p) {
  __shared__ u32 hist[kMaxMoeExperts];
  device::wait_for_prior_grid();  // the ids may be the prior kernel's output
  device::allow_dependent_launch();
  for (u32 e = threadIdx.x; e < p.experts; e += kRouteThreads) hist[e] = 0;
  __syncthreads();
  u64 begin, end;
  p.segments.range(blockIdx.x, &begin, &end);
  for (u64 q = begin + threadIdx.x; q < end; q += kRouteThreads) {
    u64 t;
    u32 k;
    atomicAdd(&hist[route_expert<true>(p, q, &t, &k)], 1u);
  }
  __syncthreads();
  u32* out = p.segment_counts + static_cast<u64>(blockIdx.x) * p.experts;
  for (u32 e = threadIdx.x; e < p.experts; e += kRouteThreads) out[e] = hist[e];
}

// An expert's pairs of rel < j, j = 1 .. world - 1, in the build kernel's scratch (tile_keys' cum).
struct SharedCum {
  const u32* first;  // scratch + expert
  u32 experts;
  TDIST_DEVICE u32 operator()(int j) const { return first[static_cast<u32>(j - 1) * experts]; }
};

// The m-tiles of expert e from the padded offsets (shared memory): write_pair_order's groups.
struct ExpertTiles {
  const int* offs;
  TDIST_DEVICE void operator()(u32 e, u32* first, u32* count) const {
    *first = static_cast<u32>(offs[e]) / kMoeTile;
    *count = static_cast<u32>(offs[e + 1] - offs[e]) / kMoeTile;
  }
};

// Everything after the counts, in one launch of num_segments blocks (one when there are no pairs) of
// kRouteThreads threads. Every block reads the whole count table (route_max_segments rows at most)
// and derives the same per-expert totals, padded offsets and pairs per source, so no block
// waits on another:
//   1. per expert (a thread each): the total, this segment's prefix, the prefix at each source's
//      first segment;
//   2. padded offsets (a block scan over experts; the compact ones likewise, after 3);
//   3. the last block lists the tiles (keys from the pairs per source, a thread per run of tiles, list
//      positions from a block scan over the runs); every block marks its share of the padding rows;
//   4. this segment's pairs placed, stable in the rotated order (warp match_any plus per-warp counts).
//   5. the last block writes the pair order (after 4, where fewer registers are live).
// Block 0 writes counts and offsets (and compact_offsets).
__global__ void __launch_bounds__(kRouteThreads, 1) moe_route_build(RouteParams p) {
  constexpr u32 kScratch = kRouteWarps * kMaxMoeExperts;
  static_assert(kScratch >= (kMaxMoeRanks - 1) * kMaxMoeExperts, "scratch holds the pairs per source");
  __shared__ int offs[kMaxMoeExperts + 1];
  __shared__ u32 total[kMaxMoeExperts];    // pairs per expert
  __shared__ u32 running[kMaxMoeExperts];  // this segment's next row per expert
  __shared__ u32 seg_first[kMaxMoeRanks + 1];
  // Phases 1-3: cum[(j - 1) E + e] = pairs of expert e with rel < j (j = 1 .. world - 1);
  // phase 4: warp_count[w E + e] = pairs of expert e in warp w's 32 of the current 256.
  __shared__ u32 scratch[kScratch];
  __shared__ u32 warp_sums[kRouteWarps][kMaxMoeRanks];
  const u32 E = p.experts, tid = threadIdx.x;
  const int world = p.segments.world();
  const u32 my = blockIdx.x;
  device::wait_for_prior_grid();  // the count kernel's table
  device::allow_dependent_launch();
  if (tid == 0) {
    u32 s = 0;
    for (int j = 0; j < world; ++j) {
      seg_first[j] = s;
      s += p.segments.rel_segments(j);
    }
    seg_first[world] = s;
  }
  __syncthreads();

  // 1. Totals and prefixes; the table's loads batched so several are in flight per thread.
  for (u32 e = tid; e < E; e += kRouteThreads) {
    u32 run = 0, mine = 0;
    for (int j = 0; j < world; ++j) {
      if (j > 0) scratch[(j - 1) * E + e] = run;
      const u32 end = seg_first[j + 1];
      for (u32 s0 = seg_first[j]; s0 < end; s0 += 8) {
        u32 c[8];
#pragma unroll
        for (u32 u = 0; u < 8; ++u) c[u] = s0 + u < end ? p.segment_counts[static_cast<u64>(s0 + u) * E + e] : 0;
#pragma unroll
        for (u32 u = 0; u < 8; ++u) {
          if (s0 + u == my && s0 + u < end) mine = run;
          run += c[u];
        }
      }
    }
    total[e] = run;
    running[e] = mine;
    if (my == 0) p.counts[e] = static_cast<int>(run);
  }
  __syncthreads();

  // 2. Padded offsets: thread tid owns experts [tid per, +per).
  const u32 per = (E + kRouteThreads - 1) / kRouteThreads;
  const u32 e_begin = tid * per < E ? tid * per : E, e_end = e_begin + per < E ? e_begin + per : E;
  {
    u32 v[1] = {0}, all[1];
    for (u32 e = e_begin; e < e_end; ++e) v[0] += (total[e] + kMoeTile - 1) / kMoeTile * kMoeTile;
    device::block_exclusive_scan<kRouteThreads, 1>(v, all, reinterpret_cast<u32(*)[1]>(&warp_sums[0][0]));
    u32 o = v[0];
    for (u32 e = e_begin; e < e_end; ++e) {
      offs[e] = static_cast<int>(o);
      o += (total[e] + kMoeTile - 1) / kMoeTile * kMoeTile;
    }
    if (tid == 0) offs[E] = static_cast<int>(all[0]);
  }
  __syncthreads();
  if (my == 0)
    for (u32 e = tid; e <= E; e += kRouteThreads) p.offsets[e] = offs[e];

  // 3. Tile lists (last block) and padding rows (every block, a share each).
  if (my == gridDim.x - 1) {
    // Thread tid lists tiles [t_begin, t_end) in expert order: a share of the tiles rather than of the
    // experts, since with few experts and many tokens a thread per expert would list its tiles alone
    // (8 experts, 65536 tokens, top-2: 128 tiles each).
    const u32 tiles = static_cast<u32>(offs[E]) / kMoeTile, per_thread = (tiles + kRouteThreads - 1) / kRouteThreads;
    const u32 t_begin = tid * per_thread < tiles ? tid * per_thread : tiles;
    const u32 t_end = t_begin + per_thread < tiles ? t_begin + per_thread : tiles;
    u32 e_first = 0;  // the expert of tile t_begin: the last e with offs[e] <= its first row (offs[0] = 0)
    for (u32 hi = E; hi - e_first > 1;) {
      const u32 mid = (e_first + hi) / 2;
      (static_cast<u32>(offs[mid]) <= t_begin * kMoeTile ? e_first : hi) = mid;
    }
    // The key of tile t in `order`, its expert e advanced from the previous tile's.
    auto key_of = [&](int order, u32 t, u32& e) {
      while (static_cast<u32>(offs[e + 1]) <= t * kMoeTile) ++e;  // past experts without pairs
      const TileKeys k =
          tile_keys(SharedCum{scratch + e, E}, total[e], t - static_cast<u32>(offs[e]) / kMoeTile, world);
      return order == 0 ? k.ag : k.rs;
    };
    // One order at a time (ag, then rs): kMaxMoeRanks running positions per thread in registers.
    for (int order = 0; order < 2; ++order) {
      u32* lists = order == 0 ? p.ag_order : p.rs_order;
      u32 n[kMaxMoeRanks], all[kMaxMoeRanks];  // this thread's tiles per key, then their first positions
#pragma unroll
      for (u32 j = 0; j < kMaxMoeRanks; ++j) n[j] = 0;
      for (u32 t = t_begin, e = e_first; t < t_end; ++t) {
        const int key = key_of(order, t, e);
#pragma unroll
        for (int j = 0; j < static_cast<int>(kMaxMoeRanks); ++j) n[j] += key == j ? 1 : 0;
      }
      device::block_exclusive_scan<kRouteThreads, kMaxMoeRanks>(n, all, warp_sums);
      for (u32 t = t_begin, e = e_first; t < t_end; ++t) {
        const int key = key_of(order, t, e);
        u32 pos = 0;
#pragma unroll
        for (int j = 0; j < static_cast<int>(kMaxMoeRanks); ++j)  // constant indices: registers
          if (key == j) pos = n[j]++;
        lists[static_cast<u64>(key) * p.max_tiles + pos] = t;
      }
      if (tid < static_cast<u32>(world)) {
        u32 count = 0;
#pragma unroll
        for (u32 j = 0; j < kMaxMoeRanks; ++j) count = j == tid ? all[j] : count;
        (order == 0 ? p.ag_count : p.rs_count)[tid] = count;
      }
    }
  }
  // Padding rows: a warp per expert, its lanes over the expert's at most kMoeTile - 1 padding rows.
  for (u32 e = my * kRouteWarps + tid / 32; e < E; e += gridDim.x * kRouteWarps)
    for (u32 r = static_cast<u32>(offs[e]) + total[e] + tid % 32; r < static_cast<u32>(offs[e + 1]); r += 32)
      p.token_of_row[r] = -1;
  __syncthreads();  // scratch becomes warp_count

  // The compact offsets (a block scan, as the padded ones), in total[], which phase 3 was the last
  // to read: computed here rather than in phase 2 so that no register stays live across phase 3.
  const bool compact = p.compact_offsets != nullptr;
  u32* compact_offs = total;
  if (compact) {
    u32 v[1] = {0}, all[1];
    for (u32 e = e_begin; e < e_end; ++e) v[0] += total[e];
    device::block_exclusive_scan<kRouteThreads, 1>(v, all, reinterpret_cast<u32(*)[1]>(&warp_sums[0][0]));
    for (u32 e = e_begin, c = v[0]; e < e_end; ++e) {
      const u32 n = total[e];
      compact_offs[e] = c;
      if (my == 0) p.compact_offsets[e] = static_cast<int>(c);
      c += n;
    }
    if (my == 0 && tid == 0) p.compact_offsets[E] = static_cast<int>(all[0]);
  }

  // 4. Place this segment's pairs.
  u32* warp_count = scratch;
  for (u32 e = tid; e < E; e += kRouteThreads) {
    running[e] += static_cast<u32>(offs[e]);
    for (u32 w = 0; w < kRouteWarps; ++w) warp_count[w * E + e] = 0;
  }
  __syncthreads();
  const u32 warp = tid / 32, lane = tid % 32;
  const u32 topk = p.segments.pairs.topk;
  u64 begin, end;
  p.segments.range(my, &begin, &end);
  u64 q = begin + tid, t = 0;
  u32 k = 0;
  bool valid = q < end;
  u32 e = valid ? static_cast<u32>(route_expert<false>(p, q, &t, &k)) : 0xffffffffu;
  for (u64 step = begin; step < end; step += kRouteThreads) {
    // The next 256 pairs' ids load while this step's rows are placed.
    const u64 q_next = q + kRouteThreads;
    u64 t_next = 0;
    u32 k_next = 0;
    const bool valid_next = q_next < end;
    const u32 e_next = valid_next ? static_cast<u32>(route_expert<false>(p, q_next, &t_next, &k_next)) : 0xffffffffu;
    const u32 same = __match_any_sync(0xffffffffu, e);
    const bool leader = (same & ((1u << lane) - 1)) == 0;
    if (valid && leader) warp_count[warp * E + e] = __popc(same);
    __syncthreads();
    if (valid) {
      u32 row = running[e] + __popc(same & ((1u << lane) - 1));
      for (u32 w = 0; w < warp; ++w) row += warp_count[w * E + e];
      p.token_of_row[row] = static_cast<int>(t);
      p.row_of_pair[t * topk + k] = static_cast<int>(row);
      if (compact) {
        const u32 c = row - static_cast<u32>(offs[e]) + compact_offs[e];
        const int pair = static_cast<int>(t * topk + k);
        p.row_of_compact[c] = static_cast<int>(row);
        p.token_of_compact[c] = static_cast<int>(t);
        p.pair_of_compact[c] = pair;
        p.compact_of_pair[pair] = static_cast<int>(c);
      }
    }
    __syncthreads();
    if (valid && leader) {
      atomicAdd(&running[e], static_cast<u32>(__popc(same)));
      warp_count[warp * E + e] = 0;
    }
    __syncthreads();
    q = q_next, t = t_next, k = k_next, valid = valid_next, e = e_next;
  }

  // 5. The pair order (last block).
  if (my == gridDim.x - 1)
    gemm::write_pair_order<kRouteThreads>(ExpertTiles{offs}, E, static_cast<u32>(offs[E]) / kMoeTile, p.pair_order,
                                          reinterpret_cast<u32(*)[2]>(&warp_sums[0][0]));
}

}  // namespace tdist::kernels::moe
#endif
