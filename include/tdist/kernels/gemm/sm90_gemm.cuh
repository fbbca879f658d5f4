// Persistent, warp-specialised GEMM for sm_90a: D = A x B^T over bf16 or fp16 inputs, fp32
// accumulation, output in the input type.
//
// Layouts ("TN", cuBLAS's default for LLM layers: D = A * W^T with W stored N x K):
//   A  T[M][lda]   row-major, M x K, K contiguous (lda >= K)
//   B  T[N][ldb]   row-major, N x K, K contiguous (ldb >= K); D uses B's rows as columns
//   D  T[M][ldd]   row-major, M x N (ldd >= N)
// K is a multiple of 8 and lda, ldb, ldd are multiples of 8 elements (16 bytes: TMA's stride rule);
// M, N, K need not be tile multiples: TMA fills out-of-range A/B elements with zeros, and the
// epilogue stores only rows < M and columns < N.
//
// Threads: warpgroup 0 is the producer, warpgroups 1 .. BLOCK_M / 64 are consumers; consumer w owns
// rows [64 (w - 1), +64) of each tile.
//   producer  one thread walks the CTA's tiles (TileScheduler) and K blocks, waits for the stage to
//             be empty, arms its `full` mbarrier with the stage's byte count and issues two TMA
//             loads (A box BLOCK_K x BLOCK_M, B box BLOCK_K x BLOCK_N; 128-byte swizzle).
//   consumers wait for `full`, issue BLOCK_K / 16 wgmma m64nBLOCK_Nk16 per stage with fp32
//             accumulators in registers, wait for them, and release the stage (one arrive per
//             consumer warp on `empty`). After the last K block of a tile: the epilogue converts and
//             stores D from registers with bounds checks, meets the other consumers at a named
//             barrier, and calls the tile hooks' after_store (before_loads runs on the
//             producer before a tile's first load; tile_scheduler.cuh).
// Producer and consumers walk the same tile list, so the ring's stage/phase sequence (a running
// count of K blocks) matches on both sides across tiles; the producer runs ahead into the next
// tile while the consumers store the previous one.
// With two or more consumer warpgroups, setmaxnreg moves registers from the producer (40) to the
// consumers (232 for two); the launch allocation (launch bounds of kThreads, 1 CTA per SM) must
// equal 128 x 40 + consumers x 232 or less, which the host checks from ptxas's report.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tdist/kernels/gemm/config.cuh"
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
template <typename T>
TDIST_DEVICE T from_float(float x);
template <>
TDIST_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
TDIST_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }

// Register split of the warp-specialised kernel (see the top of this file).
template <int kNumMathWarpgroups>
struct RegisterSplit {
  static constexpr bool kEnabled = kNumMathWarpgroups >= 2;
  static constexpr int kProducer = 40;
  static constexpr int kConsumer = kNumMathWarpgroups == 2 ? 232 : 160;
};

template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, int kNumStages, int kClusterM,
          typename Hooks = NoTileHooks>
__global__ void __launch_bounds__(gemm_threads(BLOCK_M), 1)
    sm90_gemm_tn(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b, T* d,
                 u32 m, u32 n, u32 k, u64 ldd, TileScheduler sched, Hooks hooks) {
  static_assert(sizeof(T) == 2, "bf16 or fp16 inputs");
  static_assert(BLOCK_K * sizeof(T) == 128, "BLOCK_K spans one 128-byte swizzle row (64 elements)");
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "BLOCK_M: 64 or 128 (one consumer warpgroup per 64 rows)");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256, "BLOCK_N: a multiple of 16 up to 256");
  static_assert(kNumStages >= 2, "at least two stages");
  static_assert(kClusterM == 1, "clusters (TMA multicast of B) are not implemented yet");
  static_assert(gemm_smem_bytes(BLOCK_M, BLOCK_N, BLOCK_K, kNumStages, sizeof(T)) <= kMaxSmemBytes,
                "stages do not fit in shared memory");

  constexpr int kNumMathWarpgroups = static_cast<int>(gemm_math_warpgroups(BLOCK_M));
  constexpr u32 kNumMathThreads = kNumMathWarpgroups * kWarpgroupThreads;
  constexpr u32 kNumMathWarps = kNumMathThreads / 32;
  constexpr u32 kTileABytes = BLOCK_M * BLOCK_K * sizeof(T);
  constexpr u32 kTileBBytes = BLOCK_N * BLOCK_K * sizeof(T);
  constexpr u32 kStageBytes = kTileABytes + kTileBBytes;
  constexpr int kAccum = BLOCK_N / 2;
  using Regs = RegisterSplit<kNumMathWarpgroups>;
  using Mma = Wgmma<T, BLOCK_N>;

  extern __shared__ unsigned char smem_raw[];
  const u32 base = (ptx::smem_addr(smem_raw) + kSmemAlign - 1) & ~(kSmemAlign - 1);
  const u32 smem_a = base;                                    // + stage * kTileABytes
  const u32 smem_b = base + kNumStages * kTileABytes;         // + stage * kTileBBytes
  const u32 full_bar = smem_b + kNumStages * kTileBBytes;     // + stage * 8
  const u32 empty_bar = full_bar + kNumStages * 8;            // + stage * 8

  const u32 warpgroup = threadIdx.x / kWarpgroupThreads;
  const u32 lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b);
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbar_init(full_bar + 8 * s, 1);                 // the producer's arrive.expect_tx
      ptx::mbar_init(empty_bar + 8 * s, kNumMathWarps);     // one arrive per consumer warp
    }
    ptx::fence_mbar_init();
  }
  __syncthreads();

  const u32 num_tiles = sched.num_tiles();
  const u32 num_k_blocks = (k + BLOCK_K - 1) / BLOCK_K;

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    if constexpr (Regs::kEnabled) ptx::setmaxnreg_dec<Regs::kProducer>();
    if (threadIdx.x == 0) {
      u32 iter = 0;  // running count of K blocks: stage = iter % kNumStages, pass = iter / kNumStages
      for (u32 t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const TileInfo info = tile_info(sched, t, BLOCK_M, BLOCK_N, m, n);
        hooks.before_loads(info);
        ptx::fence_proxy_async_global();  // what the hook waited for is visible to the TMA loads
        const int m0 = static_cast<int>(info.m0), n0 = static_cast<int>(info.n0);
        for (u32 kb = 0; kb < num_k_blocks; ++kb, ++iter) {
          const u32 s = iter % kNumStages, phase = (iter / kNumStages) & 1;
          // The first pass finds every stage empty: waiting for parity phase ^ 1 of a fresh barrier
          // returns at once.
          ptx::mbar_wait(empty_bar + 8 * s, phase ^ 1, "producer empty");
          ptx::mbar_arrive_expect_tx(full_bar + 8 * s, kStageBytes);
          const int k0 = static_cast<int>(kb * BLOCK_K);
          ptx::tma_load_2d(smem_a + s * kTileABytes, &tmap_a, full_bar + 8 * s, k0, m0);
          ptx::tma_load_2d(smem_b + s * kTileBBytes, &tmap_b, full_bar + 8 * s, k0, n0);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  if constexpr (Regs::kEnabled) ptx::setmaxnreg_inc<Regs::kConsumer>();
  const u32 math_wg = warpgroup - 1;                       // rows [64 * math_wg, +64) of the tile
  const u32 math_thread = threadIdx.x - kWarpgroupThreads;  // 0 .. kNumMathThreads
  const u32 warp_in_wg = (threadIdx.x / 32) % 4;
  float acc[kAccum];

  u32 iter = 0;
  for (u32 t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileInfo info = tile_info(sched, t, BLOCK_M, BLOCK_N, m, n);
    const u32 m0 = info.m0, n0 = info.n0;

    for (u32 kb = 0; kb < num_k_blocks; ++kb, ++iter) {
      const u32 s = iter % kNumStages, phase = (iter / kNumStages) & 1;
      ptx::mbar_wait(full_bar + 8 * s, phase, "consumer full");
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
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kAccum; ++i) ptx::fence_operand(acc[i]);
      if (lane == 0) ptx::mbar_arrive(empty_bar + 8 * s);  // this warp is done reading the stage
    }

    // Epilogue. wgmma m64nNk16 accumulator layout: thread (warp w, lane l) holds, for each 8-column
    // group j, acc[4j], acc[4j+1] at row 16w + l/4, columns 8j + 2(l%4) + {0, 1}, and acc[4j+2],
    // acc[4j+3] at row 16w + l/4 + 8, same columns.
    const u32 row0 = m0 + math_wg * kWgmmaM + warp_in_wg * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
      const u32 col = n0 + j * 8 + (lane % 4) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const u32 row = row0 + 8 * h;
        if (row < m && col < n) {
          T* p = d + static_cast<u64>(row) * ldd + col;
          const float lo = acc[4 * j + 2 * h], hi = acc[4 * j + 2 * h + 1];
          if (col + 1 < n) {
            *reinterpret_cast<unsigned*>(p) = pack2<T>(lo, hi);  // col even, ldd even: 4-byte aligned
          } else {
            *p = from_float<T>(lo);
          }
        }
      }
    }
    // Every consumer thread has issued this tile's stores: the hook may publish the tile.
    ptx::named_barrier(1, kNumMathThreads);
    hooks.after_store(info, math_thread, kNumMathThreads);
  }
}

}  // namespace tdist::kernels::gemm
