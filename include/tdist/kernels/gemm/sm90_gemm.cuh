// Persistent, warp-specialised GEMM for sm_90a: D = A x B^T over bf16 or fp16 inputs, fp32
// accumulation, output in the input type.
//
// Layouts ("TN", cuBLAS's default for LLM layers: D = A * W^T with W stored N x K):
//   A  T[M][lda]   row-major, M x K, K contiguous (lda >= K)
//   B  T[N][ldb]   row-major, N x K, K contiguous (ldb >= K); D uses B's rows as columns
//   D  T[M][ldd]   row-major, M x N (ldd >= N)
// K is a multiple of 8 and lda, ldb, ldd are multiples of 8 elements (16 bytes: TMA's stride rule);
// M, N, K need not be tile multiples: TMA fills out-of-range A/B elements with zeros, and the TMA
// stores of D write only rows < M and columns < N (the padding of ldd > N stays untouched).
//
// Tile order: the Scheduler template parameter (interface in tile_scheduler.cuh): TileScheduler
// (grouped raster, rank rotation) for the plain GEMM, GroupedScheduler (grouped_scheduler.cuh) for
// the m-grouped GEMM, where B is (G N) x K and a tile of group g loads B rows from g N (TileInfo's
// b_row). Hooks precedes Scheduler in the template list so that names without a scheduler keep
// naming the TileScheduler instances.
//
// Threads: warpgroup 0 is the producer, warpgroups 1 .. BLOCK_M / 64 are consumers; consumer w owns
// rows [64 (w - 1), +64) of each tile.
//   producer  one thread walks the CTA's tiles (Scheduler) and K blocks, waits for the stage to
//             be empty, arms its `full` mbarrier with the stage's byte count and issues two TMA
//             loads (A box BLOCK_K x BLOCK_M, B box BLOCK_K x BLOCK_N; 128-byte swizzle).
//   consumers wait for `full`, issue BLOCK_K / 16 wgmma m64nBLOCK_Nk16 per stage with fp32
//             accumulators in registers and commit them as one group; one group stays in flight:
//             after issuing block kb they wait until only kb's group is pending (wait_group 1) and
//             release block kb - 1's stage (one arrive per consumer warp on `empty`); the last
//             block's stage is released after the tile's final wait_group 0.
//   epilogue  per consumer warpgroup, EPI_N columns at a time (config.cuh): fp32 -> T, stmatrix into
//             a swizzled shared chunk buffer, proxy fence, warpgroup barrier, and one thread issues
//             a TMA store of the 64 x EPI_N box and commits it as a bulk group. Buffers rotate
//             (gemm_epi_buffers); before reusing one, the issuing thread waits until the store that
//             last read it has finished reading (wait_group.read). The stores complete while the
//             next tile's mainloop runs. With tile hooks (not NoTileHooks; HooksNeedStoredTile), the
//             issuing threads wait for their stores to complete (wait_group 0) before a barrier of
//             all consumers and the hooks' after_store (before_loads runs on the producer before a
//             tile's first load; tile_scheduler.cuh).
// Clusters (kClusterM = 2): two CTAs with neighbouring m-tiles share each B tile by TMA multicast
// (tma_producer_pair), halving B's traffic from L2, which is what bounds the GEMM when B's rows are not
// 32-byte aligned (docs/gemm.md). Their rings then run in step: a stage is empty once the consumers
// of both CTAs released it, and each producer waits for its stages' last releases before exiting.
// The ring is a TmaPipeline (pipeline.cuh). Producer and consumers walk the same tile list, each
// advancing its own PipelineState once per K block, so the ring's stage/phase sequence matches on
// both sides across tiles; the producer runs ahead into the next tile while the consumers store the
// previous one.
// With two or more consumer warpgroups, setmaxnreg moves registers from the producer (40) to the
// consumers (232 for two); the launch allocation (launch bounds of kThreads, 1 CTA per SM) must
// equal 128 x 40 + consumers x 232 or less, which the host checks from ptxas's report.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tdist/device/profile.cuh"
#include "tdist/kernels/gemm/config.cuh"
#include "tdist/kernels/gemm/grouped_scheduler.cuh"
#include "tdist/kernels/gemm/pipeline.cuh"
#include "tdist/kernels/gemm/sm90_ptx.cuh"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/kernels/gemm/wgmma_ops.cuh"

namespace tdist::kernels::gemm {

template <typename T>
TDIST_DEVICE unsigned pack2(float lo, float hi);
template <>
TDIST_DEVICE unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
template <>
TDIST_DEVICE unsigned pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
// Whether after_store needs the tile's D stores complete in global memory before it runs (the
// issuing threads then wait for their TMA stores, and all consumers meet at a barrier, every tile).
// True for every hook type, except NoTileHooks and hook types that declare
//   static constexpr bool kNeedsStoredTile = false;
// (e.g. hooks that only wait in before_loads): their after_store runs right after the thread's part
// of the epilogue, with no guarantee about D, and the tile's stores complete while the next tile runs.
template <typename Hooks, typename = void>
struct HooksNeedStoredTile {
  static constexpr bool value = true;
};
template <typename Hooks>
struct HooksNeedStoredTile<Hooks, decltype(void(Hooks::kNeedsStoredTile))> {
  static constexpr bool value = Hooks::kNeedsStoredTile;
};
template <>
struct HooksNeedStoredTile<NoTileHooks, void> {
  static constexpr bool value = false;
};

// Intra-kernel profiler (device/profile.cuh): hook types that declare
//   static constexpr tdist::device::ProfileKernel kProfileKernel = ...;
// get each tile recorded as a span on two tracks of the block: track 0 by the producer thread (from
// before before_loads, whose waits the hooks record inside it, to the tile's last load issued) and
// track 1 by the first consumer thread (from its first wait for a stage to the end of the epilogue
// and after_store). Payload: the tile's index in the schedule. Nothing without TDIST_KERNEL_PROFILE.
template <typename Hooks, typename = void>
struct HooksProfile {
  static constexpr bool kEnabled = false;
  static constexpr tdist::device::ProfileKernel kKernel = tdist::device::ProfileKernel::kUser0;
};
template <typename Hooks>
struct HooksProfile<Hooks, decltype(void(Hooks::kProfileKernel))> {
  static constexpr bool kEnabled = tdist::device::kKernelProfileCompiled;
  static constexpr tdist::device::ProfileKernel kKernel = Hooks::kProfileKernel;
};

// Schedulers that declare `static constexpr bool kGathersA = true;` (GatherGroupedScheduler) have A's
// rows gathered through their RowGather `gather` by the whole producer warpgroup with cp.async.
template <typename Scheduler, typename = void>
struct SchedulerGathersA {
  static constexpr bool value = false;
};
template <typename Scheduler>
struct SchedulerGathersA<Scheduler, decltype(void(Scheduler::kGathersA))> {
  static constexpr bool value = Scheduler::kGathersA;
};

// Register split of the warp-specialised kernel (see the top of this file).
template <int kNumMathWarpgroups>
struct RegisterSplit {
  static constexpr bool kEnabled = kNumMathWarpgroups >= 2;
  static constexpr int kProducer = 40;
  static constexpr int kConsumer = kNumMathWarpgroups == 2 ? 232 : 160;
};

// The walk of a cluster of kClusterM CTAs along M: cluster c takes the tile groups c, c + clusters,
// ... of kClusterM consecutive linear tiles, and its CTA of rank r the tile kClusterM q + r of group
// q (none when that is past the last tile: the CTA then only keeps the ring in step). The schedulers'
// grouped raster makes consecutive linear tiles neighbours along M with the same n-tile, so that the
// CTAs of a cluster mostly multiply the same B tile.
template <int kClusterM>
struct ClusterWalk {
  u32 first, step, count;  // this cluster's first tile group, the clusters, the tile groups
  TDIST_DEVICE static ClusterWalk make(u32 num_tiles) {
    return {blockIdx.x / kClusterM, gridDim.x / kClusterM, (num_tiles + kClusterM - 1) / kClusterM};
  }
};

// What a producer of a 2-CTA cluster loads for tile group q: its CTA's tile (`mine`: one exists), and
// whether the peer's tile multiplies the same B rows (`shared_b`: each CTA then multicasts half of B).
struct PairTile {
  u32 t;
  bool mine, shared_b;
  TileInfo info;
};
template <int BLOCK_M, int BLOCK_N, typename Scheduler>
TDIST_DEVICE PairTile pair_tile(const Scheduler& tiles, u32 q, u32 rank, u32 num_tiles, u32 m, u32 n) {
  PairTile p{2 * q + rank, false, false, TileInfo{}};
  const u32 t_peer = 2 * q + (rank ^ 1);
  p.mine = p.t < num_tiles;
  TileInfo peer{};
  if (p.mine) p.info = tiles.tile_info(p.t, BLOCK_M, BLOCK_N, m, n);
  if (t_peer < num_tiles) peer = tiles.tile_info(t_peer, BLOCK_M, BLOCK_N, m, n);
  p.shared_b = p.mine && t_peer < num_tiles && p.info.b_row == peer.b_row;
  return p;
}

// The producer of a gathering scheduler, run by the whole producer warpgroup (128 threads). Per K
// block: thread 0 arms the stage with B's bytes and issues B's TMA load; every thread copies its
// share of A's BLOCK_M x 128-byte block with cp.async (16 bytes each: thread i takes 16-byte column
// i % 8 of rows i / 8 + 16 j) into the 128-byte swizzled layout TMA would write (16-byte unit c of
// row r at r * 128 + ((c ^ r % 8) * 16), the tile base 1024-byte aligned), zeros for padding rows and
// for K past its end, then one cp.async arrive per thread on the stage's full barrier (count 129).
// Hooks run on thread 0 before a tile's loads; the warpgroup meets after them (named barrier
// kGatherBarrier) so that no thread loads before what they waited for. In a 2-CTA cluster B comes
// as in tma_producer_pair (below).
// `extra` adds a kernel's own copies to each stage, in the same arrival (the FP8 kernel's scales):
//   begin_tile(info, thread)   once per tile, after the hooks
//   copy(kb, stage, thread)    per K block, after the thread's A copies, before its arrival
constexpr u32 kGatherBarrier = 15;  // consumers use 1 .. 1 + BLOCK_M / 64
struct NoStageCopies {
  TDIST_DEVICE void begin_tile(const TileInfo&, u32) {}
  TDIST_DEVICE void copy(u32, u32, u32) {}
};
template <typename Hooks>
struct IsNoTileHooks {
  static constexpr bool value = false;
};
template <>
struct IsNoTileHooks<NoTileHooks> {
  static constexpr bool value = true;
};
template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, int kNumStages, int kClusterM, typename Scheduler,
          typename Hooks, typename StageCopies = NoStageCopies>
TDIST_DEVICE void gather_a_producer(const Scheduler& tiles, Hooks& hooks,
                                    const TmaPipeline<kNumStages, kClusterM>& pipe, const CUtensorMap& tmap_b,
                                    u32 smem_a, u32 smem_b, u32 tile_b_bytes, u32 num_k_blocks, u32 m, u32 n, u32 k,
                                    StageCopies extra = {}) {
  constexpr u32 kUnits = BLOCK_K * sizeof(T) / 16;                      // 16-byte units per row: 8
  constexpr u32 kRowStep = kWarpgroupThreads / kUnits;                  // 16
  constexpr int kRowsPerThread = BLOCK_M / static_cast<int>(kRowStep);  // 8 (BLOCK_M 128) or 4
  constexpr u32 kTileABytes = BLOCK_M * BLOCK_K * sizeof(T);
  static_assert(kUnits == 8 && BLOCK_M % kRowStep == 0, "128-byte rows, 16 rows per pass of the warpgroup");
  const u32 tid = threadIdx.x;  // 0 .. 127
  const u32 unit = tid % kUnits, row_first = tid / kUnits;
  const RowGather& g = tiles.gather;
  const u32 num_tiles = tiles.num_tiles();
  const u32 rank = kClusterM == 1 ? 0 : ptx::cluster_ctarank();
  const ClusterWalk<kClusterM> walk = ClusterWalk<kClusterM>::make(num_tiles);
  PipelineState<kNumStages> st;
  for (u32 q = walk.first; q < walk.count; q += walk.step) {
    // In a cluster as tma_producer_pair: B shared by multicast when both tiles multiply the same rows,
    // and a CTA without a tile arms its stages with no bytes (its threads still arrive).
    bool mine = true, shared_b = false;
    TileInfo info{};
    if constexpr (kClusterM == 1) {
      info = tiles.tile_info(q, BLOCK_M, BLOCK_N, m, n);
    } else {
      const PairTile p = pair_tile<BLOCK_M, BLOCK_N>(tiles, q, rank, num_tiles, m, n);
      mine = p.mine, shared_b = p.shared_b, info = p.info;
    }
    if constexpr (!IsNoTileHooks<Hooks>::value) {
      if (mine) {
        if (tid == 0) hooks.before_loads(info);
        ptx::named_barrier(kGatherBarrier, kWarpgroupThreads);
      }
    }
    if (mine) extra.begin_tile(info, tid);
    // This thread's rows: their source addresses at this unit, null for padding rows.
    const char* src[kRowsPerThread];
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const u32 row = info.m0 + row_first + j * kRowStep;
      const int token = mine && row < m ? g.token_of_row[row] : -1;
      src[j] = token >= 0 ? g.row(static_cast<u64>(token)) + unit * 16 : nullptr;
    }
    const int b_row = static_cast<int>(info.b_row);
    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
      const u32 s = st.stage();
      pipe.producer_acquire(st);
      const u32 full = pipe.full(st);
      if (tid == 0) {
        const int k0 = static_cast<int>(kb * BLOCK_K);
        const u32 b_dst = smem_b + s * tile_b_bytes;
        if constexpr (kClusterM == 1) {
          ptx::mbar_arrive_expect_tx(full, tile_b_bytes);
          ptx::tma_load_2d(b_dst, &tmap_b, full, k0, b_row);
        } else {
          ptx::mbar_arrive_expect_tx(full, mine ? tile_b_bytes : 0);
          const u32 half_bytes = tile_b_bytes / 2;
          if (shared_b) {
            ptx::tma_load_2d_multicast(b_dst + rank * half_bytes, &tmap_b, full, k0, b_row + rank * (BLOCK_N / 2), 0x3);
          } else if (mine) {
            ptx::tma_load_2d(b_dst, &tmap_b, full, k0, b_row);
            ptx::tma_load_2d(b_dst + half_bytes, &tmap_b, full, k0, b_row + BLOCK_N / 2);
          }
        }
      }
      if (mine) {
        const bool k_inside = kb * BLOCK_K + unit * (16 / sizeof(T)) < k;
        const u32 k_bytes = kb * BLOCK_K * sizeof(T);
        const u32 stage_a = smem_a + s * kTileABytes;
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
          const u32 r = row_first + j * kRowStep;
          const u32 dst = stage_a + r * (BLOCK_K * sizeof(T)) + ((unit ^ (r % 8)) * 16);
          const bool load = src[j] != nullptr && k_inside;
          ptx::cp_async_16(dst, load ? src[j] + k_bytes : static_cast<const void*>(g.token_of_row), load ? 16 : 0);
        }
        extra.copy(kb, s, tid);
      }
      ptx::cp_async_mbar_arrive_noinc(full);
    }
  }
  if constexpr (kClusterM > 1) pipe.producer_tail(st);
  ptx::cp_async_wait_all();  // no copy outlives its thread
}

// The epilogue of one tile, by one consumer warpgroup (`math_wg`, rows [64 math_wg, +64) of the
// tile; see the top of this file): its fp32 accumulators -> T, EPI_N columns at a time through its
// rotating shared chunk buffers (`chunks`; `epi_iter` counts the warpgroup's chunks), TMA stores,
// and plain stores for the last N % 8 columns. Shared by the bf16 and the FP8 kernels.
//
// wgmma m64nNk16 (and m64nNk32) accumulator layout: thread (warp w, lane l) holds, for each 8-column
// group j, acc[4j], acc[4j+1] at row 16w + l/4, columns 8j + 2(l%4) + {0, 1}, and acc[4j+2],
// acc[4j+3] at row 16w + l/4 + 8, same columns: an 8x8 matrix (j, h) per register pair, as
// stmatrix takes it. One stmatrix.x4 stores the 16 x 16 block of column groups jj, jj + 1:
// matrix i = (group jj + i / 2, row half i % 2), and lane l gives the address of row l % 8 of
// matrix l / 8.
template <typename T, int BLOCK_N, u32 kEpiBuffers>
TDIST_DEVICE void store_tile_d(const float (&acc)[BLOCK_N / 2], const TileInfo& info, u32 math_wg, u32 chunks,
                               u32& epi_iter, const CUtensorMap& tmap_d, T* d, u64 ldd, u32 m, u32 n) {
  // Chunks (config.cuh): 64 rows x kEpiN columns, rows of kEpiRowBytes swizzled in 16-byte units with
  // the 128-byte row index (TMA's SWIZZLE_<kEpiRowBytes>B pattern).
  constexpr int kEpiN = static_cast<int>(gemm_epi_cols(BLOCK_N));
  constexpr u32 kEpiRowBytes = kEpiN * sizeof(T);
  constexpr u32 kEpiSwizzleMask = kEpiRowBytes / 16 - 1;
  constexpr u32 kEpiChunkBytes = gemm_epi_chunk_bytes(BLOCK_N, sizeof(T));
  constexpr int kEpiChunks = BLOCK_N / kEpiN;
  static_assert(kEpiBuffers == 1 || kEpiBuffers == 2, "one or two epilogue chunk buffers");
  const u32 lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x / 32) % 4;
  const bool store_issuer = threadIdx.x % kWarpgroupThreads == 0;  // issues this warpgroup's D stores
  const u32 wg_barrier = 2 + math_wg;                              // named barrier of the warpgroup
  const u32 n_tma = n & ~7u;  // columns the D tensor map covers (whole 16-byte units)
  const u32 st_row = warp_in_wg * 16 + ((lane / 8) % 2) * 8 + lane % 8;  // row in the warpgroup's 64
  const u32 st_group = lane / 16;                                        // + jj: 16-byte unit in the row
  const u32 d_row = info.m0 + math_wg * kWgmmaM;
#pragma unroll
  for (int c = 0; c < kEpiChunks; ++c, ++epi_iter) {
    const u32 buf = chunks + (epi_iter % kEpiBuffers) * kEpiChunkBytes;
    // The store that last read this buffer (kEpiBuffers chunks ago) has finished reading it.
    if (store_issuer) ptx::bulk_wait_group_read<kEpiBuffers - 1>();
    ptx::named_barrier(wg_barrier, kWarpgroupThreads);
#pragma unroll
    for (int jj = 0; jj < kEpiN / 8; jj += 2) {
      const int j = c * (kEpiN / 8) + jj;  // 8-column group of the tile
      const u32 off = st_row * kEpiRowBytes + (st_group + jj) * 16;
      const u32 swizzled = off ^ (((off >> 7) & kEpiSwizzleMask) << 4);
      ptx::stmatrix_x4(buf + swizzled, pack2<T>(acc[4 * j], acc[4 * j + 1]), pack2<T>(acc[4 * j + 2], acc[4 * j + 3]),
                       pack2<T>(acc[4 * j + 4], acc[4 * j + 5]), pack2<T>(acc[4 * j + 6], acc[4 * j + 7]));
    }
    ptx::fence_proxy_async_shared();  // this thread's stmatrix before the TMA store's reads
    ptx::named_barrier(wg_barrier, kWarpgroupThreads);
    const u32 col0 = info.n0 + c * kEpiN;
    if (store_issuer) {
      // tmap_d ends at n_tma (N rounded down to 16 bytes): TMA stores clip whole 16-byte units, so
      // a box reaching past an unaligned N would write up to 7 columns of the padding. Rows >= M
      // and boxes past n_tma are clipped; a chunk wholly past it commits an empty group.
      if (col0 < n_tma) ptx::tma_store_2d(&tmap_d, buf, static_cast<int>(col0), static_cast<int>(d_row));
      ptx::bulk_commit_group();
    }
    if (col0 + kEpiN > n_tma && col0 < n) {
      // Columns [max(col0, n_tma), n) of this chunk (at most 7 per row): plain stores from the
      // staged chunk, by the warpgroup's threads.
      const u32 first = col0 > n_tma ? col0 : n_tma, last = col0 + kEpiN < n ? col0 + kEpiN : n;
      const u32 width = last - first;
      for (u32 e = threadIdx.x % kWarpgroupThreads; e < kWgmmaM * width; e += kWarpgroupThreads) {
        const u32 r = e / width, col = first + e % width;
        if (d_row + r >= m) continue;
        const u32 off = r * kEpiRowBytes + (col - col0) * static_cast<u32>(sizeof(T));
        const unsigned short v = ptx::ld_shared_u16(buf + (off ^ (((off >> 7) & kEpiSwizzleMask) << 4)));
        *reinterpret_cast<unsigned short*>(d + static_cast<u64>(d_row + r) * ldd + col) = v;
      }
    }
  }
}

// A tile's start on the TMA producer thread: its profile span opens, the hooks' before_loads runs, and
// what it waited for is made visible to the TMA loads.
template <typename Hooks>
TDIST_DEVICE void producer_tile_begin(Hooks& hooks, const TileInfo& info, u32 t) {
  using Profile = HooksProfile<Hooks>;
  if constexpr (Profile::kEnabled)
    tdist::device::profile_record(Profile::kKernel, 0, tdist::device::ProfileEvent::kTileBegin, t);
  hooks.before_loads(info);
  ptx::fence_proxy_async_global();
}

// The TMA producer (one thread): per tile, before_loads of the hooks, then per K block a wait for the
// stage to be empty, its full barrier armed with the stage's bytes, and the TMA loads of A (box
// BLOCK_K x BLOCK_M at (k0, m0)) and B (BLOCK_K x BLOCK_N at (k0, b_row)). Shared by the bf16 and the
// FP8 kernels (BLOCK_K in elements of the operands' type).
template <int BLOCK_M, int BLOCK_N, int BLOCK_K, int kNumStages, typename Scheduler, typename Hooks>
TDIST_DEVICE void tma_producer(const Scheduler& tiles, Hooks& hooks, const TmaPipeline<kNumStages>& pipe,
                               const CUtensorMap& tmap_a, const CUtensorMap& tmap_b, u32 smem_a, u32 smem_b,
                               u32 tile_a_bytes, u32 tile_b_bytes, u32 num_k_blocks, u32 m, u32 n) {
  using Profile = HooksProfile<Hooks>;
  PipelineState<kNumStages> st;  // running count of K blocks
  for (u32 t = blockIdx.x; t < tiles.num_tiles(); t += gridDim.x) {
    const TileInfo info = tiles.tile_info(t, BLOCK_M, BLOCK_N, m, n);
    producer_tile_begin(hooks, info, t);
    const int m0 = static_cast<int>(info.m0), b_row = static_cast<int>(info.b_row);
    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
      const u32 s = st.stage();
      pipe.producer_acquire(st);  // the first pass finds every stage empty
      const u32 full = pipe.producer_commit(st, tile_a_bytes + tile_b_bytes);
      const int k0 = static_cast<int>(kb * BLOCK_K);
      ptx::tma_load_2d(smem_a + s * tile_a_bytes, &tmap_a, full, k0, m0);
      ptx::tma_load_2d(smem_b + s * tile_b_bytes, &tmap_b, full, k0, b_row);
    }
    if constexpr (Profile::kEnabled)
      tdist::device::profile_record(Profile::kKernel, 0, tdist::device::ProfileEvent::kTileEnd, t);
  }
}

// The TMA producer of a 2-CTA cluster (one thread per CTA). When both CTAs' tiles multiply the same
// B rows (same b_row), each CTA loads half of the B tile (BLOCK_N / 2 rows: the tensor map's box) and
// multicasts it into both CTAs' stage, so B crosses from L2 once for two tiles; A is each CTA's own.
// Otherwise (tiles of two groups or two n-tiles, or no tile for one CTA) each CTA loads its own B in
// two halves. A CTA without a tile arms its stages with no bytes, so that its consumers release them
// in step with the peer's.
template <int BLOCK_M, int BLOCK_N, int BLOCK_K, int kNumStages, typename Scheduler, typename Hooks>
TDIST_DEVICE void tma_producer_pair(const Scheduler& tiles, Hooks& hooks, const TmaPipeline<kNumStages, 2>& pipe,
                                    const CUtensorMap& tmap_a, const CUtensorMap& tmap_b, u32 smem_a, u32 smem_b,
                                    u32 tile_a_bytes, u32 tile_b_bytes, u32 num_k_blocks, u32 m, u32 n) {
  using Profile = HooksProfile<Hooks>;
  constexpr int kHalfRows = BLOCK_N / 2;
  const u32 half_bytes = tile_b_bytes / 2;
  const u32 rank = ptx::cluster_ctarank();
  const u32 num_tiles = tiles.num_tiles();
  const ClusterWalk<2> walk = ClusterWalk<2>::make(num_tiles);
  PipelineState<kNumStages> st;
  for (u32 q = walk.first; q < walk.count; q += walk.step) {
    const PairTile p = pair_tile<BLOCK_M, BLOCK_N>(tiles, q, rank, num_tiles, m, n);
    if (p.mine) producer_tile_begin(hooks, p.info, p.t);
    const int m0 = static_cast<int>(p.info.m0), b_row = static_cast<int>(p.info.b_row);
    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
      const u32 s = st.stage();
      pipe.producer_acquire(st);  // both CTAs' consumers have released the stage
      const u32 full = pipe.producer_commit(st, p.mine ? tile_a_bytes + tile_b_bytes : 0);
      if (!p.mine) continue;
      const int k0 = static_cast<int>(kb * BLOCK_K);
      const u32 b_dst = smem_b + s * tile_b_bytes;
      ptx::tma_load_2d(smem_a + s * tile_a_bytes, &tmap_a, full, k0, m0);
      if (p.shared_b) {
        ptx::tma_load_2d_multicast(b_dst + rank * half_bytes, &tmap_b, full, k0, b_row + rank * kHalfRows, 0x3);
      } else {
        ptx::tma_load_2d(b_dst, &tmap_b, full, k0, b_row);
        ptx::tma_load_2d(b_dst + half_bytes, &tmap_b, full, k0, b_row + kHalfRows);
      }
    }
    if constexpr (Profile::kEnabled)
      if (p.mine) tdist::device::profile_record(Profile::kKernel, 0, tdist::device::ProfileEvent::kTileEnd, p.t);
  }
  pipe.producer_tail(st);
}

template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, int kNumStages, int kClusterM,
          typename Hooks = NoTileHooks, typename Scheduler = TileScheduler>
__global__ void __launch_bounds__(gemm_threads(BLOCK_M), 1)
    sm90_gemm_tn(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                 const __grid_constant__ CUtensorMap tmap_d, T* d, u64 ldd, u32 m, u32 n, u32 k, Scheduler sched,
                 Hooks hooks) {
  static_assert(sizeof(T) == 2, "bf16 or fp16 inputs");
  static_assert(BLOCK_K * sizeof(T) == 128, "BLOCK_K spans one 128-byte swizzle row (64 elements)");
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "BLOCK_M: 64 or 128 (one consumer warpgroup per 64 rows)");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256, "BLOCK_N: a multiple of 16 up to 256");
  static_assert(kNumStages >= 2, "at least two stages");
  static_assert(kClusterM == 1 || kClusterM == 2, "clusters of 1 or 2 CTAs along M");
  static_assert(kClusterM == 1 || (BLOCK_N / 2) % 8 == 0, "each CTA's half of B is whole 8-row swizzle atoms");
  static_assert(gemm_smem_bytes(BLOCK_M, BLOCK_N, BLOCK_K, kNumStages, sizeof(T)) <= kMaxSmemBytes,
                "stages do not fit in shared memory");

  constexpr int kNumMathWarpgroups = static_cast<int>(gemm_math_warpgroups(BLOCK_M));
  constexpr u32 kNumMathThreads = kNumMathWarpgroups * kWarpgroupThreads;
  constexpr u32 kNumMathWarps = kNumMathThreads / 32;
  constexpr u32 kTileABytes = BLOCK_M * BLOCK_K * sizeof(T);
  constexpr u32 kTileBBytes = BLOCK_N * BLOCK_K * sizeof(T);
  constexpr int kAccum = BLOCK_N / 2;
  constexpr u32 kEpiChunkBytes = gemm_epi_chunk_bytes(BLOCK_N, sizeof(T));
  constexpr u32 kEpiBuffers = gemm_epi_buffers(BLOCK_M, BLOCK_N, BLOCK_K, kNumStages, sizeof(T));
  constexpr bool kStoredTileBeforeHook = HooksNeedStoredTile<Hooks>::value;
  constexpr bool kGatherA = SchedulerGathersA<Scheduler>::value;
  using Regs = RegisterSplit<kNumMathWarpgroups>;
  using Mma = Wgmma<T, BLOCK_N>;
  using Profile = HooksProfile<Hooks>;

  extern __shared__ unsigned char smem_raw[];
  const u32 base = (ptx::smem_addr(smem_raw) + kSmemAlign - 1) & ~(kSmemAlign - 1);
  const u32 smem_a = base;                               // + stage * kTileABytes
  const u32 smem_b = base + kNumStages * kTileABytes;    // + stage * kTileBBytes
  const u32 smem_d = smem_b + kNumStages * kTileBBytes;  // + (wg * kEpiBuffers + buf) * kEpiChunkBytes
  const u32 full_bar = smem_d + kNumMathWarpgroups * kEpiBuffers * kEpiChunkBytes;  // + stage * 8
  const u32 empty_bar = full_bar + kNumStages * 8;                                  // + stage * 8
  using Pipeline = TmaPipeline<kNumStages, kClusterM>;
  using PipeState = PipelineState<kNumStages>;
  const Pipeline pipe{full_bar, empty_bar};

  const u32 warpgroup = threadIdx.x / kWarpgroupThreads;
  const u32 lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b);
    ptx::prefetch_tensor_map(&tmap_d);
    pipe.init(kNumMathWarps, kGatherA ? 1 + kWarpgroupThreads : 1);  // one release per consumer warp
    ptx::fence_mbar_init();
  }
  if constexpr (kClusterM > 1)
    ptx::cluster_sync();  // the peers' barriers are initialised before any multicast or remote arrive
  else
    __syncthreads();

  const Scheduler tiles = sched.prepare();  // what the walk reads from device memory, read once
  const u32 num_tiles = tiles.num_tiles();
  const u32 num_k_blocks = (k + BLOCK_K - 1) / BLOCK_K;

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    if constexpr (Regs::kEnabled) ptx::setmaxnreg_dec<Regs::kProducer>();
    if constexpr (kGatherA) {
      gather_a_producer<T, BLOCK_M, BLOCK_N, BLOCK_K, kNumStages>(tiles, hooks, pipe, tmap_b, smem_a, smem_b,
                                                                  kTileBBytes, num_k_blocks, m, n, k);
    } else if constexpr (kClusterM == 2) {
      if (threadIdx.x == 0)
        tma_producer_pair<BLOCK_M, BLOCK_N, BLOCK_K, kNumStages>(tiles, hooks, pipe, tmap_a, tmap_b, smem_a, smem_b,
                                                                 kTileABytes, kTileBBytes, num_k_blocks, m, n);
    } else if (threadIdx.x == 0) {
      tma_producer<BLOCK_M, BLOCK_N, BLOCK_K, kNumStages>(tiles, hooks, pipe, tmap_a, tmap_b, smem_a, smem_b,
                                                          kTileABytes, kTileBBytes, num_k_blocks, m, n);
    }
    return;
  }

  // ---------------- consumers ----------------
  if constexpr (Regs::kEnabled) ptx::setmaxnreg_inc<Regs::kConsumer>();
  const u32 math_wg = warpgroup - 1;                               // rows [64 * math_wg, +64) of the tile
  const u32 math_thread = threadIdx.x - kWarpgroupThreads;         // 0 .. kNumMathThreads
  const bool store_issuer = threadIdx.x % kWarpgroupThreads == 0;  // issues this warpgroup's D stores
  const u32 my_chunks = smem_d + math_wg * kEpiBuffers * kEpiChunkBytes;
  float acc[kAccum];

  PipeState st;      // running count of K blocks, as the producer's
  u32 epi_iter = 0;  // running count of this warpgroup's D chunks: buffer = epi_iter % kEpiBuffers
  const ClusterWalk<kClusterM> walk = ClusterWalk<kClusterM>::make(num_tiles);
  const u32 cluster_rank = kClusterM == 1 ? 0 : ptx::cluster_ctarank();
  for (u32 q = walk.first; q < walk.count; q += walk.step) {
    const u32 t = q * kClusterM + cluster_rank;
    if constexpr (kClusterM > 1) {
      if (t >= num_tiles) {  // no tile for this CTA: release the stages the peer's loads pass through
        for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
          pipe.consumer_wait(st);
          pipe.consumer_release(st, lane);
        }
        continue;
      }
    }
    const TileInfo info = tiles.tile_info(t, BLOCK_M, BLOCK_N, m, n);
    if constexpr (Profile::kEnabled)
      if (math_thread == 0)
        tdist::device::profile_record(Profile::kKernel, 1, tdist::device::ProfileEvent::kTileBegin, t);

    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
      const u32 s = st.stage();
      pipe.consumer_wait(st);
      // Gathered A was written by cp.async (generic proxy); wgmma reads through the async proxy.
      if constexpr (kGatherA) ptx::fence_proxy_async_shared();
      const u32 a_tile = smem_a + s * kTileABytes + math_wg * (kWgmmaM * BLOCK_K * sizeof(T));
      const u32 b_tile = smem_b + s * kTileBBytes;
#pragma unroll
      for (int i = 0; i < kAccum; ++i) ptx::fence_operand(acc[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
        const u64 desc_a = ptx::smem_desc_k_major_sw128(a_tile + kk * 16 * sizeof(T));
        const u64 desc_b = ptx::smem_desc_k_major_sw128(b_tile + kk * 16 * sizeof(T));
        Mma::mma(desc_a, desc_b, acc, kb > 0 || kk > 0);
      }
      ptx::wgmma_commit();
      // Block kb's group may still run; block kb - 1's has finished reading its stage.
      ptx::wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < kAccum; ++i) ptx::fence_operand(acc[i]);
      if (kb > 0) pipe.consumer_release(st.previous(), lane);
    }
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kAccum; ++i) ptx::fence_operand(acc[i]);
    // The tile's last block (st.previous(): the loop has counted it) is done with its stage.
    pipe.consumer_release(st.previous(), lane);

    store_tile_d<T, BLOCK_N, kEpiBuffers>(acc, info, math_wg, my_chunks, epi_iter, tmap_d, d, ldd, m, n);
    if constexpr (kStoredTileBeforeHook) {
      // after_store needs the tile in global memory: wait for the writes themselves, and order them
      // (async proxy) before this thread's later generic accesses; the barrier passes it on.
      if (store_issuer) {
        ptx::bulk_wait_group<0>();
        ptx::fence_proxy_async_global();
      }
      ptx::named_barrier(1, kNumMathThreads);
      hooks.after_store(info, math_thread, kNumMathThreads);
    } else {
      hooks.after_store(info, math_thread, kNumMathThreads);  // NoTileHooks: nothing
    }
    if constexpr (Profile::kEnabled)
      if (math_thread == 0)
        tdist::device::profile_record(Profile::kKernel, 1, tdist::device::ProfileEvent::kTileEnd, t);
  }
  // The shared memory must outlive the stores' reads; the writes finish before the kernel does.
  if (store_issuer) ptx::bulk_wait_group<0>();
}

}  // namespace tdist::kernels::gemm
