// Tile order of the persistent GEMM, and the AllGather-GEMM chunk-to-flag mapping. Plain C++ shared
// by the host (plain g++, CPU tests), nvcc and NVRTC: no standard header, no device intrinsic.
//
// Output tiles are BLOCK_M x BLOCK_N; tile (tile_m, tile_n) covers rows [tile_m * BLOCK_M, +BLOCK_M)
// and columns [tile_n * BLOCK_N, +BLOCK_N) of D, clipped to M x N. A persistent CTA b walks the
// linear indices b, b + gridDim.x, b + 2 * gridDim.x, ... < num_tiles(), and tile(i) maps a linear
// index to a tile:
//
//   1. grouped raster (L2 reuse): the linear order visits `group_m` consecutive m-tiles for one
//      n-tile, then the same m-tiles for the next n-tile, ...; once every n-tile of a group is done,
//      the next group of m-tiles follows (the last group may be shorter). group_m = 1 is plain
//      row-by-row raster (all n-tiles of an m-tile in turn); group_m >= tiles_m is column order.
//   2. rank rotation (AllGather-GEMM): the m-tile numbers of step 1 are relative; the real m-tile is
//      (first_tile_m + relative) % tiles_m, so the walk starts at the m-tile holding this rank's
//      first row (its local chunk, which needs no wait) and wraps around through the others.
//
// Both are bijections of [0, num_tiles), so every tile is visited exactly once whatever the grid.
//
// The scheduler is a template parameter of the kernel (sm90_gemm_tn's Scheduler). A scheduler type is
// a trivially copyable struct passed by value with:
//   prepare()                  on each thread once, before its walk: a copy with whatever the walk
//                              needs from device memory read (grouped_scheduler.cuh reads the group
//                              offsets); TileScheduler returns itself.
//   num_tiles()                on a prepared scheduler: the tiles of the walk.
//   tile_info(i, BLOCK_M, BLOCK_N, M, N)
//                              the TileInfo of linear index i < num_tiles(): the output tile, and
//                              b_row, the first row of B the tile multiplies by (n0, or a group's
//                              rows of B in the grouped GEMM).
// The kernel's CTA b walks linear indices b, b + gridDim.x, ... on the producer and every consumer.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::kernels::gemm {

using tdist::device::u32;
using tdist::device::u64;

struct TileCoord {
  u32 tile_m;  // m-tile: rows [tile_m * BLOCK_M, +BLOCK_M)
  u32 tile_n;  // n-tile: columns [tile_n * BLOCK_N, +BLOCK_N)
};

// What the kernel hands the hooks for each tile.
struct TileInfo {
  TileCoord coord;
  u32 m0, n0;      // first row and column of the tile
  u32 rows, cols;  // rows and columns inside M x N (the tile clipped)
  u32 linear;      // linear index in the schedule
  u32 group;       // the group of the grouped GEMM whose rows the tile holds (0 for the plain GEMM)
  u32 b_row;       // first row of B the tile loads: n0 + group * N
  u32 list;        // the tile list of a listed grouped walk holding the tile (0 elsewhere)
};

struct TileScheduler {
  u32 tiles_m = 1;       // ceil(M / BLOCK_M)
  u32 tiles_n = 1;       // ceil(N / BLOCK_N)
  u32 group_m = 1;       // m-tiles per raster group, >= 1
  u32 first_tile_m = 0;  // rotation: the m-tile visited first, < tiles_m

  TDIST_HOST_DEVICE u32 num_tiles() const { return tiles_m * tiles_n; }

  // The tile of linear index `i` (< num_tiles()).
  TDIST_HOST_DEVICE TileCoord tile(u32 i) const {
    const u32 per_group = group_m * tiles_n;
    const u32 group = i / per_group, in_group = i % per_group;
    const u32 first_m = group * group_m;
    const u32 rows = tiles_m - first_m < group_m ? tiles_m - first_m : group_m;  // this group's m-tiles
    const u32 rel_m = first_m + in_group % rows;
    TileCoord c;
    c.tile_m = (rel_m + first_tile_m) % tiles_m;
    c.tile_n = in_group / rows;
    return c;
  }

  TDIST_HOST_DEVICE TileScheduler prepare() const { return *this; }

  // The TileInfo of linear tile `t` of an M x N output (a member, as every scheduler has).
  TDIST_HOST_DEVICE TileInfo tile_info(u32 t, u32 block_m, u32 block_n, u32 m, u32 n) const {
    TileInfo info;
    info.coord = tile(t);
    info.m0 = info.coord.tile_m * block_m;
    info.n0 = info.coord.tile_n * block_n;
    info.rows = m - info.m0 < block_m ? m - info.m0 : block_m;
    info.cols = n - info.n0 < block_n ? n - info.n0 : block_n;
    info.linear = t;
    info.group = 0;
    info.b_row = info.n0;
    info.list = 0;
    return info;
  }

  // A schedule for an M x N output; `group_m` 0 is taken as 1, `first_tile_m` is reduced mod tiles_m.
  TDIST_HOST_DEVICE static TileScheduler make(u64 m, u64 n, u32 block_m, u32 block_n, u32 group_m = 8,
                                              u32 first_tile_m = 0) {
    TileScheduler s;
    s.tiles_m = static_cast<u32>((m + block_m - 1) / block_m);
    s.tiles_n = static_cast<u32>((n + block_n - 1) / block_n);
    if (s.tiles_m == 0) s.tiles_m = 1;
    if (s.tiles_n == 0) s.tiles_n = 1;
    s.group_m = group_m == 0 ? 1 : group_m;
    s.first_tile_m = first_tile_m % s.tiles_m;
    return s;
  }
};

// Tile hooks: how the fused ops plug into the persistent GEMM. A trivially copyable struct passed to
// the kernel by value, with two members:
//   before_loads(info)  on the producer thread, before the first load of the tile's A and B. May
//                       wait (acquire) for the rows the tile reads (AllGather-GEMM); the kernel
//                       orders the wait before its TMA loads (proxy fence).
//   after_store(info, consumer_thread, num_consumer_threads)
//                       on every consumer thread once every consumer thread's stores of the tile are
//                       done (a barrier among them precedes it). A hook that raises a flag for
//                       another CTA or GPU fences (release) before its signal.
// NoTileHooks, the plain GEMM's, does nothing.
struct NoTileHooks {
  template <typename Info>
  TDIST_HOST_DEVICE void before_loads(const Info&) const {}
  template <typename Info>
  TDIST_HOST_DEVICE void after_store(const Info&, u32, u32) const {}
};

// The TileInfo of linear tile `t` of an M x N output.
TDIST_HOST_DEVICE TileInfo tile_info(const TileScheduler& sched, u32 t, u32 block_m, u32 block_n, u32 m, u32 n) {
  return sched.tile_info(t, block_m, block_n, m, n);
}

// Rows of A split over `num_ranks` chunks, as AllGather-GEMM splits them: chunk r holds rows
// [begin(r), begin(r) + rows(r)); the first M % num_ranks chunks hold one row more than the others.
// With M < num_ranks the last chunks are empty. Empty chunks only come last, never between others.
struct RowChunks {
  u64 m;
  int num_ranks;

  TDIST_HOST_DEVICE u64 rows(int r) const { return m / num_ranks + (static_cast<u64>(r) < m % num_ranks ? 1 : 0); }
  TDIST_HOST_DEVICE u64 begin(int r) const {
    const u64 extra = m % num_ranks, ru = static_cast<u64>(r);
    return ru * (m / num_ranks) + (ru < extra ? ru : extra);
  }
  // The chunk that holds `row` (< m).
  TDIST_HOST_DEVICE int chunk_of(u64 row) const {
    const u64 base = m / num_ranks, extra = m % num_ranks, long_rows = extra * (base + 1);
    return static_cast<int>(row < long_rows ? row / (base + 1) : extra + (row - long_rows) / base);
  }
};

// The chunk flags a tile must wait for: chunks [first, first + count).
struct ChunkRange {
  int first;
  int count;
};

// AllGather-GEMM: the chunks holding rows [m0, min(m0 + block_m, m)) of the gathered A (m0 < m).
// A tile may straddle chunk boundaries (chunks need not be multiples of BLOCK_M) or hold several
// small chunks; it waits for every one of them.
TDIST_HOST_DEVICE ChunkRange tile_chunks(const RowChunks& split, u64 m0, u32 block_m) {
  const u64 end = m0 + block_m < split.m ? m0 + block_m : split.m;
  const int first = split.chunk_of(m0), last = split.chunk_of(end - 1);
  return ChunkRange{first, last - first + 1};
}

// The m-tile holding rank `rank`'s first row: where AllGather-GEMM's rotated walk starts. A rank with
// an empty chunk starts at the tile after the rows (mod tiles_m).
TDIST_HOST_DEVICE u32 rank_first_tile_m(const RowChunks& split, int rank, u32 block_m) {
  const u64 tiles_m = (split.m + block_m - 1) / block_m;
  return tiles_m == 0 ? 0 : static_cast<u32>((split.begin(rank) / block_m) % tiles_m);
}

}  // namespace tdist::kernels::gemm
