// Tile order of the m-grouped GEMM (MoE experts): plain C++ shared by the host (plain g++, CPU tests),
// nvcc and NVRTC, a Scheduler of sm90_gemm_tn (tile_scheduler.cuh gives the interface).
//
// Layout ("m-grouped contiguous"): G groups share one A and one D; group g owns rows
// [offsets[g], offsets[g + 1]) of both and multiplies them by its own B_g:
//   A        T[M_total][lda]     rows of every group, group after group
//   B        T[G][N][ldb]        B_g = rows [g N, (g + 1) N) of a (G N) x K matrix
//   D        T[M_total][ldd]     D rows [offsets[g], offsets[g + 1]) = A rows (same) x B_g^T
//   offsets  int32 or int64 [G + 1], device memory: offsets[0] == 0, non-decreasing, every offset a
//            multiple of kGroupedAlignment (each group's rows padded up to it; the padding rows are
//            computed like the others), offsets[G] <= M_total. Rows [offsets[G], M_total) are not
//            touched.
// Since kGroupedAlignment is a multiple of every BLOCK_M, a tile never holds rows of two groups, and
// m-tile j (rows [j BLOCK_M, +BLOCK_M)) belongs to the group whose rows contain row j BLOCK_M: the
// m-tiles are those of the rows [0, offsets[G]), and an empty group simply owns none of them.
//
// Walk: the m-tiles [0, tiles_m) with tiles_m = ceil(offsets[G] / BLOCK_M) (clipped to max_tiles_m,
// the launch's bound from M_total), crossed with the n-tiles, in TileScheduler's order (grouped
// raster of group_m m-tiles, rotated to start at first_tile_m), or, with an order table, in the
// order it gives: m_tile_order[p] is the m-tile visited at relative position p (a permutation of
// [0, tiles_m) written by the host or a producer kernel, for instance this rank's tokens first).
// Listed walk (num_lists > 1): the table holds num_lists lists, list j at m_tile_order[j list_stride]
// with m_tile_count[j] entries (at most list_stride); the walk visits every tile of list 0, then of
// list 1, ..., each list in its own grouped raster (no raster group straddles two lists), and tells
// the hooks the list of each tile (TileInfo::list): one launch runs what would be a launch per list,
// and a tile of a later list can wait for its inputs without holding up the tiles before it.
// The group of an m-tile is found by binary search over the offsets (ceil(log2 G) loads, cached;
// the producer's loads run ahead of the consumers, so the search hides behind the ring), never by a
// scan over all groups.
#pragma once

#include "tdist/kernels/gemm/tile_scheduler.cuh"

namespace tdist::kernels::gemm {

// Rows per group are padded to this (a multiple of every BLOCK_M the kernel takes: 64, 128).
constexpr u32 kGroupedAlignment = 128;

struct GroupedScheduler {
  static constexpr u32 kMaxLists = 8;  // lists of a listed walk (one per rank of the MoE ops)

  const void* offsets = nullptr;      // device: G + 1 row offsets (layout above)
  const u32* m_tile_order = nullptr;  // device, optional: u32[tiles_m], the m-tile at each position
                                      // (listed walk: u32[num_lists][list_stride])
  const u32* m_tile_count = nullptr;  // device, optional with an order table: visit its first
                                      // *m_tile_count entries only (a subset of the m-tiles, as an
                                      // overlapped MoE op runs the tiles of one source chunk);
                                      // listed walk: u32[num_lists], the entries of each list
  u32 num_lists = 1;                  // > 1: a listed walk (above; needs m_tile_order, m_tile_count)
  u32 list_stride = 0;                // listed walk: entries between the starts of two lists
  u32 list_end[kMaxLists] = {};       // set by prepare() for a listed walk: list j holds positions
                                      // [list_end[j - 1], list_end[j]) of the walk's m-tiles
  u32 num_groups = 0;                 // G >= 1
  u32 offset_bytes = 4;               // 4 (int32 offsets) or 8 (int64)
  u32 block_m = 128;                  // the kernel's BLOCK_M
  u32 max_tiles_m = 0;                // ceil(M_total / BLOCK_M)
  u32 tiles_n = 1;                    // ceil(N / BLOCK_N)
  u32 group_m = 1;                    // m-tiles per raster group, >= 1
  u32 first_tile_m = 0;               // rotation without an order table (prepare() reduces it mod tiles_m)
  u32 tiles_m = 0;                    // set by prepare(): m-tiles of rows [0, offsets[G])

  // Offset `g` (<= num_groups), negative values read as 0.
  TDIST_HOST_DEVICE u64 offset(u32 g) const {
    const long long v = offset_bytes == 8 ? static_cast<const long long*>(offsets)[g]
                                          : static_cast<long long>(static_cast<const int*>(offsets)[g]);
    return v < 0 ? 0 : static_cast<u64>(v);
  }

  TDIST_HOST_DEVICE bool listed() const { return num_lists > 1; }

  // Reads offsets[G] (or the list counts) once: the m-tiles of the walk.
  TDIST_HOST_DEVICE GroupedScheduler prepare() const {
    GroupedScheduler s = *this;
    u64 tm = 0;
    if (listed()) {
      // Each count clipped to its list's room, the total to the launch's bound (later lists lose
      // their tail first).
      // (Loops over kMaxLists with constant indices here and below: list_end stays in registers,
      // where an index known only at run time would put it in local memory.)
      TDIST_UNROLL
      for (u32 j = 0; j < kMaxLists; ++j) {
        const u64 c = j < num_lists ? m_tile_count[j] : 0;
        tm += c < list_stride ? c : list_stride;
        s.list_end[j] = static_cast<u32>(tm < max_tiles_m ? tm : max_tiles_m);
      }
    } else {
      tm = m_tile_order != nullptr && m_tile_count != nullptr ? *m_tile_count
                                                              : (offset(num_groups) + block_m - 1) / block_m;
    }
    s.tiles_m = tm < max_tiles_m ? static_cast<u32>(tm) : max_tiles_m;
    if (s.tiles_m > 0) s.first_tile_m = first_tile_m % s.tiles_m;
    return s;
  }

  TDIST_HOST_DEVICE u32 num_tiles() const { return tiles_m * tiles_n; }

  // The group owning `row` (< offsets[G]): the largest g < G with offsets[g] <= row, i.e. the one
  // non-empty group with offsets[g] <= row < offsets[g + 1] (empty groups before it share its start).
  TDIST_HOST_DEVICE u32 group_of_row(u64 row) const {
    u32 lo = 0, hi = num_groups - 1;
    while (lo < hi) {
      const u32 mid = (lo + hi + 1) / 2;
      if (offset(mid) <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  // The list holding linear index `i` of a prepared listed walk: the lists ending at or before it
  // (list j's tiles end at list_end[j] x tiles_n), the last list at most.
  TDIST_HOST_DEVICE u32 list_of(u32 i) const {
    u32 j = 0;
    TDIST_UNROLL
    for (u32 l = 0; l + 1 < kMaxLists; ++l) j += l + 1 < num_lists && i >= list_end[l] * tiles_n ? 1 : 0;
    return j;
  }
  // list_end[j] (0 for j = -1, i.e. `j` == ~0u), read without a run-time index.
  TDIST_HOST_DEVICE u32 list_end_at(u32 j) const {
    u32 v = 0;
    TDIST_UNROLL
    for (u32 l = 0; l < kMaxLists; ++l) v = l == j ? list_end[l] : v;
    return v;
  }

  // Tile of linear index `i` (< num_tiles() of a prepared scheduler), in list `list` (list_of(i);
  // 0 for a walk without lists).
  TDIST_HOST_DEVICE TileCoord tile(u32 i, u32 list) const {
    const bool lists = listed();
    const u32 first = lists ? list_end_at(list - 1) : 0;  // the list's first position (0 for list 0)
    TileScheduler raster;
    raster.tiles_m = lists ? list_end_at(list) - first : tiles_m;
    raster.tiles_n = tiles_n;
    raster.group_m = group_m;
    raster.first_tile_m = m_tile_order != nullptr ? 0 : first_tile_m;
    TileCoord c = raster.tile(i - first * tiles_n);
    if (m_tile_order != nullptr) c.tile_m = m_tile_order[list * list_stride + c.tile_m];
    return c;
  }
  TDIST_HOST_DEVICE TileCoord tile(u32 i) const { return tile(i, listed() ? list_of(i) : 0); }

  TDIST_HOST_DEVICE TileInfo tile_info(u32 t, u32 bm, u32 bn, u32 m, u32 n) const {
    TileInfo info;
    info.list = listed() ? list_of(t) : 0;
    info.coord = tile(t, info.list);
    info.m0 = info.coord.tile_m * bm;
    info.n0 = info.coord.tile_n * bn;
    info.rows = m - info.m0 < bm ? m - info.m0 : bm;
    info.cols = n - info.n0 < bn ? n - info.n0 : bn;
    info.linear = t;
    info.group = group_of_row(info.m0);
    info.b_row = info.group * n + info.n0;
    return info;
  }

  // A schedule of `num_groups` groups over M_total rows (a launch bound) and N columns. `group_m` 0 is
  // taken as 1.
  TDIST_HOST_DEVICE static GroupedScheduler make(const void* offsets, u32 offset_bytes, u32 num_groups, u64 m_total,
                                                 u64 n, u32 block_m, u32 block_n, u32 group_m = 8, u32 first_tile_m = 0,
                                                 const u32* m_tile_order = nullptr, const u32* m_tile_count = nullptr,
                                                 u32 num_lists = 1, u32 list_stride = 0) {
    GroupedScheduler s;
    s.offsets = offsets;
    s.m_tile_order = m_tile_order;
    s.m_tile_count = m_tile_count;
    s.num_lists = num_lists == 0 ? 1 : num_lists < kMaxLists ? num_lists : kMaxLists;  // the host checks the bound
    s.list_stride = list_stride;
    s.num_groups = num_groups;
    s.offset_bytes = offset_bytes;
    s.block_m = block_m;
    s.max_tiles_m = static_cast<u32>((m_total + block_m - 1) / block_m);
    s.tiles_n = static_cast<u32>((n + block_n - 1) / block_n);
    if (s.tiles_n == 0) s.tiles_n = 1;
    s.group_m = group_m == 0 ? 1 : group_m;
    s.first_tile_m = first_tile_m;
    return s;
  }
};

// A rows of the m-grouped GEMM read through an index instead of from a materialised matrix (the MoE
// ops' expert-ordered tokens, without the copy): row r of A is token token_of_row[r]'s row; -1 marks
// a padding row, read as zeros. The tokens live in two places:
//   local     T[local_rows][ld]   tokens [local_begin, local_begin + local_rows) (this rank's own)
//   gathered  T[tokens][ld]       every other token t at row t (the rows of local's range unread)
// Token rows are 16-byte aligned: ld_bytes a multiple of 16, both bases 16-byte aligned.
struct RowGather {
  const int* token_of_row = nullptr;  // device, int32[M_total]
  const void* local = nullptr;        // may be null when local_rows == 0
  const void* gathered = nullptr;
  u64 local_begin = 0, local_rows = 0;
  u64 ld_bytes = 0;  // bytes between consecutive token rows of both places (>= K elements)

  // The row of token `t` (>= 0).
  TDIST_HOST_DEVICE const char* row(u64 t) const {
    return t - local_begin < local_rows ? static_cast<const char*>(local) + (t - local_begin) * ld_bytes
                                        : static_cast<const char*>(gathered) + t * ld_bytes;
  }
};

// The m-grouped walk (GroupedScheduler) whose A rows are gathered (RowGather): sm90_gemm_tn's
// producer warpgroup then loads A with cp.async through the index (kGathersA) and B with TMA.
struct GatherGroupedScheduler {
  static constexpr bool kGathersA = true;
  GroupedScheduler walk;
  RowGather gather;

  TDIST_HOST_DEVICE GatherGroupedScheduler prepare() const {
    GatherGroupedScheduler s = *this;
    s.walk = walk.prepare();
    return s;
  }
  TDIST_HOST_DEVICE u32 num_tiles() const { return walk.num_tiles(); }
  TDIST_HOST_DEVICE TileInfo tile_info(u32 t, u32 bm, u32 bn, u32 m, u32 n) const {
    return walk.tile_info(t, bm, bn, m, n);
  }
};

}  // namespace tdist::kernels::gemm
