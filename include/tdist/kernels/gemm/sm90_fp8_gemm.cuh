// Persistent, warp-specialised FP8 GEMM for sm_90a with block scales (DeepSeek-V3's recipe): e4m3
// operands, each with fp32 scales per block of 128 along K, fp32 accumulation, bf16 output.
//
// Layouts ("TN", as sm90_gemm.cuh; the scales come as Fp8BlockScales, config.cuh; `rows` of B is N,
// or G N for the grouped schedule):
//   A   e4m3[M][lda]      K contiguous; lda >= K, a multiple of 16 (bytes)
//   B   e4m3[rows][ldb]   K contiguous; the grouped walk's B_g is rows [g N, (g + 1) N)
//   D   bf16[M][ldd]      ldd >= N, a multiple of 8
//   sa  f32: A's scales, one per row and 128-column block of K, sa[r * a_row_stride + kb * a_kb_stride]
//       (row-major [M][KB] is strides (KB, 1), column-major [KB][M] is (1, M)); KB = ceil(K / 128)
//   sb  f32[G][NB][KB]: B's scales, one per 128 x 128 block of each B_g; NB = ceil(N / 128)
// The value of A[r][c] is A[r][c] * sa[r][c / 128], that of B_g[j][c] is B_g[j][c] * sb[g][j / 128][c / 128],
// and D = A x B_g^T over those values. K need not be a multiple of 128: TMA fills the last block
// past K with zeros.
//
// Threads and ring as sm90_gemm_tn (the same TMA producer, tma_producer, and epilogue,
// store_tile_d), BLOCK_K = 128 e4m3 (one 128-byte swizzle row and one scale block per stage), and:
//   scales    warp 1 of the producer warpgroup copies each stage's scales into shared memory, arriving
//             on the stage's full barrier (1 + 32 arrivals): A's of the tile's rows in one bulk copy
//             where they are contiguous (column-major, Fp8BlockScales::a_rows_contiguous), else with
//             a 4-byte cp.async per row (zeros past M), and the tile's B scale (BLOCK_N divides 128,
//             so a tile's columns share one). The per-row copies cost up to a quarter of the time
//             (H200, 8 groups of 1024 rows, N 4096, K 14336: 1278 us, 960 us with no scale copies).
//             Read from global memory by the consumers instead (prefetched a block ahead), they made
//             the kernel 1.2x slower (8 groups of 4096 rows, N 4096, K 7168: 2.31 against 1.92 ms).
//   gathered A (GatherGroupedScheduler, the MoE ops' token rows): the whole producer warpgroup
//             copies A's rows through the index with cp.async (gather_a_producer, sm90_gemm.cuh;
//             128-byte rows of e4m3 as of bf16), and thread i also row i's scales (its token's, from
//             Fp8BlockScales::a_local or ::a as RowGather places the row; zeros for padding rows),
//             thread 0 the B scale: one arrival per thread (1 + 128). Tile hooks (Hooks, as
//             sm90_gemm.cuh's; before_loads only) run here, before the tile's row and scale copies:
//             the fused MoE AllGather's source waits (MoeGatherWaitHooks, overlap.cuh).
//   consumers per K block: wait for the stage, read this thread's two rows' A scales and the B scale,
//             issue BLOCK_K / 32 wgmma m64nBLOCK_Nk32 into a block accumulator, wait for the wgmma
//             (wait_group 0: the scales multiply a finished block), release the stage, and add block
//             x sa[row] x sb into the fp32 tile accumulator.
// The consumer warpgroups of a 128-row tile run independently: ordering their wgmma issues (named
// barriers taking turns, so that one scales while the other's wgmma run) measured no faster.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "tdist/kernels/gemm/sm90_gemm.cuh"

namespace tdist::kernels::gemm {

// The scale producer (one warp; a stage's scales: f32[BLOCK_M] of A, then B's, in
// fp8_scale_stage_bytes(BLOCK_M) bytes). Walks the tiles and K blocks as tma_producer does.
// kRowsContiguous: Fp8BlockScales::a_rows_contiguous (a template parameter, as one loop holding both
// forms needs more than the producer's 40 registers).
template <int BLOCK_M, int BLOCK_N, int kNumStages, bool kRowsContiguous, typename Scheduler>
TDIST_DEVICE void fp8_scale_producer(const Scheduler& tiles, const TmaPipeline<kNumStages>& pipe,
                                     const Fp8BlockScales& sc, u32 smem_scales, u32 num_k_blocks, u32 m, u32 n) {
  const u32 lane = threadIdx.x % 32;
  PipelineState<kNumStages> st;
  for (u32 t = blockIdx.x; t < tiles.num_tiles(); t += gridDim.x) {
    const TileInfo info = tiles.tile_info(t, BLOCK_M, BLOCK_N, m, n);
    const float* sb = sc.b + (static_cast<u64>(info.group) * sc.n_blocks + info.n0 / kFp8BlockK) * sc.k_blocks;
    // Bulk copies: the tile's rows below M (M % 4 == 0, so a multiple of 16 bytes; rows past M are not
    // copied, as their products are never stored).
    const u32 bulk_bytes = min(static_cast<u32>(BLOCK_M), m - info.m0) * 4;
    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
      pipe.producer_acquire(st);
      const u32 dst = smem_scales + st.stage() * fp8_scale_stage_bytes(BLOCK_M);
      if constexpr (kRowsContiguous) {
        // One bulk copy by lane 0, whose arrival carries its bytes.
        if (lane == 0) {
          ptx::mbar_arrive_expect_tx(pipe.full(st), bulk_bytes);
          ptx::bulk_load_1d(dst, sc.a + kb * sc.a_kb_stride + info.m0, bulk_bytes, pipe.full(st));
        }
      } else {
#pragma unroll
        for (int i = 0; i < BLOCK_M / 32; ++i) {
          const u32 r = lane + 32 * i, row = info.m0 + r;
          const bool inside = row < m;
          ptx::cp_async_4(dst + r * 4, inside ? sc.a + row * sc.a_row_stride + kb * sc.a_kb_stride : sc.a,
                          inside ? 4 : 0);
        }
      }
      if (lane == 31) ptx::cp_async_4(dst + BLOCK_M * 4, sb + kb, 4);
      // The other lanes arrive when their copies have landed.
      if (!kRowsContiguous || lane != 0) ptx::cp_async_mbar_arrive_noinc(pipe.full(st));
    }
  }
  ptx::cp_async_wait_all();  // no copy outlives its thread
}

// The scales of a gathered A's stage, copied by the gathering warpgroup beside its rows (layout of
// fp8_scale_producer's stage): thread i < BLOCK_M row i's, thread 0 also the B scale.
template <int BLOCK_M>
struct Fp8GatheredScaleCopies {
  const Fp8BlockScales& sc;
  const RowGather& gather;
  u32 smem_scales, m;
  const float* row = nullptr;  // this thread's row's scales; null: a padding row, past M or BLOCK_M
  const float* b = nullptr;    // thread 0: the tile's B scales

  TDIST_DEVICE void begin_tile(const TileInfo& info, u32 tid) {
    const u32 r = info.m0 + tid;
    const int t = tid < BLOCK_M && r < m ? gather.token_of_row[r] : -1;
    const u64 local = static_cast<u64>(t) - gather.local_begin;  // t >= 0 below
    row = t < 0                       ? nullptr
          : local < gather.local_rows ? sc.a_local + local * sc.a_row_stride
                                      : sc.a + static_cast<u64>(t) * sc.a_row_stride;
    if (tid == 0) b = sc.b + (static_cast<u64>(info.group) * sc.n_blocks + info.n0 / kFp8BlockK) * sc.k_blocks;
  }
  TDIST_DEVICE void copy(u32 kb, u32 stage, u32 tid) {
    const u32 dst = smem_scales + stage * fp8_scale_stage_bytes(BLOCK_M);
    if (tid < BLOCK_M) ptx::cp_async_4(dst + tid * 4, row != nullptr ? row + kb * sc.a_kb_stride : sc.b, row ? 4 : 0);
    if (tid == 0) ptx::cp_async_4(dst + BLOCK_M * 4, b + kb, 4);
  }
};

template <int BLOCK_M, int BLOCK_N, int kNumStages, typename Scheduler = TileScheduler, typename Hooks = NoTileHooks>
__global__ void __launch_bounds__(gemm_threads(BLOCK_M), 1)
    sm90_fp8_gemm_tn(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                     const __grid_constant__ CUtensorMap tmap_d, __nv_bfloat16* d, u64 ldd, u32 m, u32 n, u32 k,
                     Fp8BlockScales scales, Scheduler sched, Hooks hooks) {
  using Out = __nv_bfloat16;
  constexpr int BLOCK_K = kFp8BlockK;
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "BLOCK_M: 64 or 128 (one consumer warpgroup per 64 rows)");
  static_assert(BLOCK_N % 16 == 0 && kFp8BlockK % BLOCK_N == 0, "BLOCK_N: a multiple of 16 dividing 128 (one B scale)");
  static_assert(kNumStages >= 2, "at least two stages");
  constexpr bool kGatherA = SchedulerGathersA<Scheduler>::value;
  // Hooks run before a tile's loads only (the MoE AllGather's source waits), where one warpgroup
  // copies both the rows and their scales after them; nothing is published after the stores.
  static_assert(IsNoTileHooks<Hooks>::value || (kGatherA && !HooksNeedStoredTile<Hooks>::value),
                "FP8 tile hooks: before_loads with a gathered A only");
  static_assert(gemm_smem_bytes_mixed(BLOCK_M, BLOCK_N, BLOCK_K, kNumStages, 1, sizeof(Out),
                                      fp8_scale_stage_bytes(BLOCK_M)) <= kMaxSmemBytes,
                "stages do not fit in shared memory");

  constexpr int kNumMathWarpgroups = static_cast<int>(gemm_math_warpgroups(BLOCK_M));
  constexpr u32 kNumMathWarps = kNumMathWarpgroups * kWarpgroupThreads / 32;
  constexpr u32 kTileABytes = BLOCK_M * BLOCK_K;
  constexpr u32 kTileBBytes = BLOCK_N * BLOCK_K;
  constexpr int kAccum = BLOCK_N / 2;
  constexpr u32 kEpiChunkBytes = gemm_epi_chunk_bytes(BLOCK_N, sizeof(Out));
  constexpr u32 kScaleBytes = fp8_scale_stage_bytes(BLOCK_M);
  constexpr u32 kEpiBuffers =
      gemm_epi_buffers_mixed(BLOCK_M, BLOCK_N, BLOCK_K, kNumStages, 1, sizeof(Out), kScaleBytes);
  using Regs = RegisterSplit<kNumMathWarpgroups>;
  using Mma = Wgmma<__nv_fp8_e4m3, BLOCK_N>;

  // Shared memory as sm90_gemm_tn's (config.cuh), with 1-byte operands and 2-byte D chunks, and the
  // scales' ring f32[kNumStages][BLOCK_M + 4] after the D chunks.
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (ptx::smem_addr(smem_raw) + kSmemAlign - 1) & ~(kSmemAlign - 1);
  const u32 smem_a = base;
  const u32 smem_b = base + kNumStages * kTileABytes;
  const u32 smem_d = smem_b + kNumStages * kTileBBytes;
  const u32 smem_scales = smem_d + kNumMathWarpgroups * kEpiBuffers * kEpiChunkBytes;
  const u32 full_bar = smem_scales + kNumStages * kScaleBytes;
  const TmaPipeline<kNumStages> pipe{full_bar, full_bar + kNumStages * 8};

  const u32 warpgroup = threadIdx.x / kWarpgroupThreads;
  const u32 lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b);
    ptx::prefetch_tensor_map(&tmap_d);
    // One release per consumer warp; arrivals: the TMA thread and the scale warp's lanes, or the
    // gathering warpgroup's threads.
    pipe.init(kNumMathWarps, kGatherA ? 1 + kWarpgroupThreads : 1 + 32);
    ptx::fence_mbar_init();
  }
  __syncthreads();

  const Scheduler tiles = sched.prepare();
  const u32 num_k_blocks = (k + BLOCK_K - 1) / BLOCK_K;

  if (warpgroup == 0) {
    if constexpr (Regs::kEnabled) ptx::setmaxnreg_dec<Regs::kProducer>();
    if constexpr (kGatherA) {
      gather_a_producer<__nv_fp8_e4m3, BLOCK_M, BLOCK_N, BLOCK_K, kNumStages>(
          tiles, hooks, pipe, tmap_b, smem_a, smem_b, kTileBBytes, num_k_blocks, m, n, k,
          Fp8GatheredScaleCopies<BLOCK_M>{scales, tiles.gather, smem_scales, m});
    } else if (threadIdx.x == 0) {
      tma_producer<BLOCK_M, BLOCK_N, BLOCK_K, kNumStages>(tiles, hooks, pipe, tmap_a, tmap_b, smem_a, smem_b,
                                                          kTileABytes, kTileBBytes, num_k_blocks, m, n);
    } else if (threadIdx.x / 32 == 1) {
      if (scales.a_rows_contiguous)
        fp8_scale_producer<BLOCK_M, BLOCK_N, kNumStages, true>(tiles, pipe, scales, smem_scales, num_k_blocks, m, n);
      else
        fp8_scale_producer<BLOCK_M, BLOCK_N, kNumStages, false>(tiles, pipe, scales, smem_scales, num_k_blocks, m, n);
    }
    return;
  }

  if constexpr (Regs::kEnabled) ptx::setmaxnreg_inc<Regs::kConsumer>();
  const u32 math_wg = warpgroup - 1;
  const u32 warp_in_wg = (threadIdx.x / 32) % 4;
  const bool store_issuer = threadIdx.x % kWarpgroupThreads == 0;
  const u32 my_chunks = smem_d + math_wg * kEpiBuffers * kEpiChunkBytes;
  // This thread's accumulator rows in a tile (the layout at store_tile_d): r and r + 8.
  const u32 row_in_tile = math_wg * kWgmmaM + warp_in_wg * 16 + lane / 4;
  float acc[kAccum], block[kAccum];

  PipelineState<kNumStages> st;
  u32 epi_iter = 0;
  for (u32 t = blockIdx.x; t < tiles.num_tiles(); t += gridDim.x) {
    const TileInfo info = tiles.tile_info(t, BLOCK_M, BLOCK_N, m, n);
#pragma unroll
    for (int i = 0; i < kAccum; ++i) acc[i] = 0.f;
    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++st) {
      const u32 s = st.stage();
      pipe.consumer_wait(st);
      // Gathered A was written by cp.async (generic proxy); wgmma reads through the async proxy.
      if constexpr (kGatherA) ptx::fence_proxy_async_shared();
      // This thread's rows' A scales and the B scale, read before the wgmma are issued: read after
      // them (while they ran) the kernel was 5-10 % slower on large problems (H200, MoE shapes).
      const u32 stage_scales = smem_scales + s * kScaleBytes;
      const float b_scale = ptx::ld_shared_f32(stage_scales + BLOCK_M * 4);
      const float scale0 = ptx::ld_shared_f32(stage_scales + row_in_tile * 4) * b_scale;
      const float scale1 = ptx::ld_shared_f32(stage_scales + (row_in_tile + 8) * 4) * b_scale;
      const u32 a_tile = smem_a + s * kTileABytes + math_wg * (kWgmmaM * BLOCK_K);
      const u32 b_tile = smem_b + s * kTileBBytes;
#pragma unroll
      for (int i = 0; i < kAccum; ++i) ptx::fence_operand(block[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K / Mma::kK; ++kk) {
        const u64 desc_a = ptx::smem_desc_k_major_sw128(a_tile + kk * Mma::kK);
        const u64 desc_b = ptx::smem_desc_k_major_sw128(b_tile + kk * Mma::kK);
        Mma::mma(desc_a, desc_b, block, kk > 0);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kAccum; ++i) ptx::fence_operand(block[i]);
      pipe.consumer_release(st, lane);  // the block's wgmma have read the stage
#pragma unroll
      for (int j = 0; j < kAccum / 4; ++j) {
        acc[4 * j + 0] += scale0 * block[4 * j + 0];
        acc[4 * j + 1] += scale0 * block[4 * j + 1];
        acc[4 * j + 2] += scale1 * block[4 * j + 2];
        acc[4 * j + 3] += scale1 * block[4 * j + 3];
      }
    }
    store_tile_d<Out, BLOCK_N, kEpiBuffers>(acc, info, math_wg, my_chunks, epi_iter, tmap_d, d, ldd, m, n);
  }
  // The shared memory must outlive the stores' reads; the writes finish before the kernel does.
  if (store_issuer) ptx::bulk_wait_group<0>();
}

}  // namespace tdist::kernels::gemm
