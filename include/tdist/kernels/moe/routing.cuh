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
#pragma once

#include "tdist/kernels/gemm/grouped_scheduler.cuh"
#include "tdist/kernels/gemm/tile_scheduler.cuh"

namespace tdist::kernels::moe {

using device::u32;
using device::u64;

constexpr u32 kMoeTile = gemm::kGroupedAlignment;  // rows per tile and per padding unit
constexpr u32 kMaxMoeExperts = 1024;               // the routing kernels' shared histograms
constexpr u32 kMaxMoeRanks = 8;
constexpr u32 kRouteSegment = 2048;  // pairs per block of the count and place kernels
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

// The two list keys of a tile (layout above) from its kMoeTile entries of token_of_row. A tile's
// real rows come first (its first row is real) and their rel is non-decreasing, so two binary
// searches replace a scan of the tile.
struct TileKeys {
  int ag, rs;
};
TDIST_HOST_DEVICE TileKeys tile_keys(const int* rows, const RotatedPairs& pairs) {
  const int world = pairs.split.num_ranks;
  int lo = 1, hi = static_cast<int>(kMoeTile);  // real rows: the largest n with rows[n - 1] >= 0
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (rows[mid - 1] >= 0)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int real = lo;
  const int rel_first = pairs.rel(static_cast<u64>(rows[0]));
  const int rel_last = pairs.rel(static_cast<u64>(rows[real - 1]));
  if (rel_first > 0 || rel_last == 0) return {rel_last, rs_step(rel_first, world)};  // every rel > 0, or all 0
  lo = 1, hi = real - 1;  // own rows, then others': the first other row has the earliest step
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (pairs.rel(static_cast<u64>(rows[mid])) > 0)
      hi = mid;
    else
      lo = mid + 1;
  }
  return {rel_last, rs_step(pairs.rel(static_cast<u64>(rows[lo])), world)};
}

struct RouteParams {
  const int* topk_ids;  // int32[M][topk]
  RotatedPairs pairs;
  u32 experts;
  u32 num_segments;    // ceil(M topk / kRouteSegment)
  u32* segment_base;   // u32[E][num_segments]: the count kernel's counts, then (scan) exclusive prefixes
  int* offsets;        // int32[E + 1]
  int* counts;         // int32[E]
  int* token_of_row;   // int32[capacity]
  int* row_of_pair;    // int32[M][topk]
  u32* ag_order;       // u32[world][max_tiles]
  u32* ag_count;       // u32[world]
  u32* rs_order;       // u32[world][max_tiles]
  u32* rs_count;       // u32[world]
  u32 max_tiles;
};

// Rows of the expert-ordered matrix gathered from token rows: out[row] = tokens[token_of_row[row]]
// for the tiles order[0, *count) (order null: tiles 0, 1, ...), zeros for padding rows. Tokens of
// [local_begin, +local_rows) are read from `local` (this rank's rows), the others from `gathered`
// (T[M][k], every rank's rows at their RowChunks place).
struct GatherRowsParams {
  const void* gathered;
  const void* local;
  u64 local_begin, local_rows;
  const int* token_of_row;
  const u32* order;
  const u32* count;
  void* out;  // T[capacity][k]
  u32 k;
};

// out[i][c] = sum_k weight[t][k] d_rows[row_of_pair[t][k]][c] + sum_s extra[s][i][c], in fp32, for the
// tokens t = first_token + i, i < tokens (extra: received partials of the same rows, row stride n).
struct CombineParams {
  const void* d_rows;       // T[capacity][n], expert order
  const int* row_of_pair;   // int32[M][topk]
  const float* weights;     // fp32[M][topk]
  const void* extra[kMaxMoeRanks];
  int num_extra;
  void* out;                // T[tokens][n]
  u64 first_token, tokens;
  u32 topk, n;
};

}  // namespace tdist::kernels::moe

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tdist/kernels/collectives/common.cuh"  // to_f32 / from_f32

namespace tdist::kernels::moe {

__device__ __forceinline__ int route_expert(const RouteParams& p, u64 q, u64* token_out, u32* slot_out) {
  const u64 t = p.pairs.token(q);
  const u32 k = p.pairs.slot(q);
  const int e = p.topk_ids[t * p.pairs.topk + k];
  if (e < 0 || static_cast<u32>(e) >= p.experts) {  // no host check without a synchronisation: fail loudly
    printf("tdist moe routing: topk_ids[%llu][%u] = %d is outside [0, %u) (the number of experts)\n",
           static_cast<unsigned long long>(t), k, e, p.experts);
    __trap();
  }
  *token_out = t;
  *slot_out = k;
  return e;
}

// Per segment: pairs of each expert (grid: num_segments blocks of kRouteThreads).
__global__ void __launch_bounds__(kRouteThreads) moe_route_count(RouteParams p) {
  __shared__ u32 hist[kMaxMoeExperts];
  for (u32 e = threadIdx.x; e < p.experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const u64 pairs = p.pairs.split.m * p.pairs.topk;
  const u64 begin = static_cast<u64>(blockIdx.x) * kRouteSegment;
  const u64 end = begin + kRouteSegment < pairs ? begin + kRouteSegment : pairs;
  for (u64 q = begin + threadIdx.x; q < end; q += blockDim.x) {
    u64 t;
    u32 k;
    atomicAdd(&hist[route_expert(p, q, &t, &k)], 1u);
  }
  __syncthreads();
  for (u32 e = threadIdx.x; e < p.experts; e += blockDim.x) p.segment_base[e * p.num_segments + blockIdx.x] = hist[e];
}

// One block: per-expert exclusive prefixes over segments, counts, padded offsets, padding rows.
__global__ void __launch_bounds__(1024) moe_route_scan(RouteParams p) {
  __shared__ int offs[kMaxMoeExperts + 1];
  for (u32 e = threadIdx.x; e < p.experts; e += blockDim.x) {
    u32 run = 0;
    u32* base = p.segment_base + static_cast<u64>(e) * p.num_segments;
    for (u32 s = 0; s < p.num_segments; ++s) {
      const u32 c = base[s];
      base[s] = run;
      run += c;
    }
    p.counts[e] = static_cast<int>(run);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int o = 0;
    for (u32 e = 0; e < p.experts; ++e) {
      offs[e] = o;
      p.offsets[e] = o;
      o += (p.counts[e] + static_cast<int>(kMoeTile) - 1) / static_cast<int>(kMoeTile) * static_cast<int>(kMoeTile);
    }
    offs[p.experts] = o;
    p.offsets[p.experts] = o;
  }
  __syncthreads();
  for (u32 e = 0; e < p.experts; ++e) {
    const int pad_begin = offs[e] + p.counts[e];
    for (int r = pad_begin + static_cast<int>(threadIdx.x); r < offs[e + 1]; r += blockDim.x) p.token_of_row[r] = -1;
  }
}

// Per segment: each pair's row, stable in the rotated order (the same rows on every run).
__global__ void __launch_bounds__(kRouteThreads) moe_route_place(RouteParams p) {
  constexpr u32 kWarps = kRouteThreads / 32;
  __shared__ u32 running[kMaxMoeExperts];
  __shared__ u32 warp_count[kWarps][kMaxMoeExperts];
  for (u32 e = threadIdx.x; e < p.experts; e += blockDim.x) {
    running[e] = static_cast<u32>(p.offsets[e]) + p.segment_base[e * p.num_segments + blockIdx.x];
    for (u32 w = 0; w < kWarps; ++w) warp_count[w][e] = 0;
  }
  __syncthreads();
  const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const u64 pairs = p.pairs.split.m * p.pairs.topk;
  const u64 begin = static_cast<u64>(blockIdx.x) * kRouteSegment;
  const u64 end = begin + kRouteSegment < pairs ? begin + kRouteSegment : pairs;
  for (u64 step = begin; step < end; step += blockDim.x) {
    const u64 q = step + threadIdx.x;
    const bool valid = q < end;
    u64 t = 0;
    u32 k = 0;
    const u32 e = valid ? static_cast<u32>(route_expert(p, q, &t, &k)) : 0xffffffffu;
    const u32 same = __match_any_sync(0xffffffffu, e);
    const bool leader = (same & ((1u << lane) - 1)) == 0;
    if (valid && leader) warp_count[warp][e] = __popc(same);
    __syncthreads();
    if (valid) {
      u32 row = running[e] + __popc(same & ((1u << lane) - 1));
      for (u32 w = 0; w < warp; ++w) row += warp_count[w][e];
      p.token_of_row[row] = static_cast<int>(t);
      p.row_of_pair[t * p.pairs.topk + k] = static_cast<int>(row);
    }
    __syncthreads();
    if (valid && leader) {
      atomicAdd(&running[e], static_cast<u32>(__popc(same)));
      warp_count[warp][e] = 0;
    }
    __syncthreads();
  }
}

// Appends the threads' tiles with `key` to their lists, in thread order (one block; `valid` false
// appends nothing). run[j]: the list's length so far, in shared memory.
__device__ __forceinline__ void append_stable(bool valid, int key, u32 tile, int world, u32* run,
                                              u32 (*warp_total)[32], u32* lists, u32 max_tiles) {
  const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  u32 mine = 0;
  for (int j = 0; j < world; ++j) {
    const u32 b = __ballot_sync(0xffffffffu, valid && key == j);
    if (lane == 0) warp_total[j][warp] = __popc(b);
    if (valid && key == j) mine = b;
  }
  __syncthreads();
  if (valid) {
    u32 pos = run[key] + __popc(mine & ((1u << lane) - 1));
    for (u32 w = 0; w < warp; ++w) pos += warp_total[key][w];
    lists[static_cast<u64>(key) * max_tiles + pos] = tile;
  }
  __syncthreads();
  if (threadIdx.x < static_cast<u32>(world)) {
    u32 add = 0;
    for (u32 w = 0; w < blockDim.x / 32; ++w) add += warp_total[threadIdx.x][w];
    run[threadIdx.x] += add;
  }
  __syncthreads();
}

// One block of 1024 threads: both tile orders.
__global__ void __launch_bounds__(1024) moe_route_tiles(RouteParams p) {
  __shared__ u32 ag_run[kMaxMoeRanks], rs_run[kMaxMoeRanks];
  __shared__ u32 warp_total[kMaxMoeRanks][32];
  const int world = p.pairs.split.num_ranks;
  if (threadIdx.x < kMaxMoeRanks) ag_run[threadIdx.x] = rs_run[threadIdx.x] = 0;
  __syncthreads();
  const u32 tiles = static_cast<u32>(p.offsets[p.experts]) / kMoeTile;
  for (u32 first = 0; first < tiles; first += blockDim.x) {
    const u32 tile = first + threadIdx.x;
    const bool valid = tile < tiles;
    int ag_key = 0, rs_key = world - 1;
    if (valid) {
      const TileKeys keys = tile_keys(p.token_of_row + static_cast<u64>(tile) * kMoeTile, p.pairs);
      ag_key = keys.ag;
      rs_key = keys.rs;
    }
    append_stable(valid, ag_key, tile, world, ag_run, warp_total, p.ag_order, p.max_tiles);
    append_stable(valid, rs_key, tile, world, rs_run, warp_total, p.rs_order, p.max_tiles);
  }
  if (threadIdx.x < static_cast<u32>(world)) {
    p.ag_count[threadIdx.x] = ag_run[threadIdx.x];
    p.rs_count[threadIdx.x] = rs_run[threadIdx.x];
  }
}

// Grid-stride over the listed tiles' rows, one row per block iteration, 16-byte vectors.
template <typename T>
__global__ void __launch_bounds__(128) moe_gather_rows(GatherRowsParams p) {
  const u32 tiles = *p.count;
  const u64 rows = static_cast<u64>(tiles) * kMoeTile;
  const u32 vectors = p.k / 8;
  for (u64 x = blockIdx.x; x < rows; x += gridDim.x) {
    const u32 tile = p.order != nullptr ? p.order[x / kMoeTile] : static_cast<u32>(x / kMoeTile);
    const u64 row = static_cast<u64>(tile) * kMoeTile + x % kMoeTile;
    const int t = p.token_of_row[row];
    uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row * p.k);
    if (t < 0) {
      for (u32 v = threadIdx.x; v < vectors; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const u64 tu = static_cast<u64>(t);
    const T* src = tu - p.local_begin < p.local_rows ? static_cast<const T*>(p.local) + (tu - p.local_begin) * p.k
                                                     : static_cast<const T*>(p.gathered) + tu * p.k;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (u32 v = threadIdx.x; v < vectors; v += blockDim.x) dst[v] = s[v];
  }
}

template <typename T>
__global__ void __launch_bounds__(256) moe_combine(CombineParams p) {
  const u32 vectors_per_row = p.n / 8;
  const u64 total = p.tokens * vectors_per_row;
  for (u64 v = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<u64>(gridDim.x) * blockDim.x) {
    const u64 i = v / vectors_per_row, col = (v % vectors_per_row) * 8;
    const u64 t = p.first_token + i;
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    for (u32 k = 0; k < p.topk; ++k) {
      const float w = p.weights[t * p.topk + k];
      const u64 row = static_cast<u64>(p.row_of_pair[t * p.topk + k]);
      const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.d_rows) + row * p.n + col);
      const T* xe = reinterpret_cast<const T*>(&x);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += w * coll::to_f32(xe[j]);
    }
    for (int s = 0; s < p.num_extra; ++s) {
      const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.extra[s]) + i * p.n + col);
      const T* xe = reinterpret_cast<const T*>(&x);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += coll::to_f32(xe[j]);
    }
    uint4 y;
    T* ye = reinterpret_cast<T*>(&y);
#pragma unroll
    for (int j = 0; j < 8; ++j) ye[j] = coll::from_f32<T>(acc[j]);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + i * p.n + col) = y;
  }
}

}  // namespace tdist::kernels::moe
#endif
