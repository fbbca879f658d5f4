// Launch facts of the sm_90a GEMM kernel that the host needs too (threads, shared memory), in plain
// C++ shared by the host, nvcc and NVRTC.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::kernels::gemm {

// One producer warpgroup (TMA) plus one consumer warpgroup (wgmma) per 64 rows of the tile.
constexpr unsigned kWarpgroupThreads = 128;
constexpr unsigned kWgmmaM = 64;
// Dynamic shared memory is rounded up to this at run time (128-byte swizzled tiles need 1024-byte
// aligned bases); the slack is part of the request.
constexpr unsigned kSmemAlign = 1024;
// Largest dynamic shared memory a CTA may use on sm_90 (227 KiB).
constexpr unsigned kMaxSmemBytes = 227 * 1024;

TDIST_HOST_DEVICE constexpr unsigned gemm_math_warpgroups(unsigned block_m) { return block_m / kWgmmaM; }
TDIST_HOST_DEVICE constexpr unsigned gemm_threads(unsigned block_m) {
  return kWarpgroupThreads * (1 + gemm_math_warpgroups(block_m));
}

// Epilogue: each consumer warpgroup stages its 64 rows of D in shared memory, EPI_N columns at a
// time (a "chunk": 64 x EPI_N elements, rows of EPI_N * elem bytes swizzled like TMA's
// CU_TENSOR_MAP_SWIZZLE_<EPI_N * elem>B), and one thread of the warpgroup stores each chunk with a TMA
// store. EPI_N is the widest of 64, 32, 16 that divides BLOCK_N (64 x 2 bytes: one 128-byte swizzle
// row). A warpgroup has gemm_epi_buffers() chunk buffers in rotation (2 when they fit beside the
// ring, else 1), so it writes one chunk while the previous one's store is still reading.
TDIST_HOST_DEVICE constexpr unsigned gemm_epi_cols(unsigned block_n) {
  return block_n % 64 == 0 ? 64 : block_n % 32 == 0 ? 32 : 16;
}
TDIST_HOST_DEVICE constexpr unsigned gemm_epi_chunk_bytes(unsigned block_n, unsigned elem_bytes) {
  return kWgmmaM * gemm_epi_cols(block_n) * elem_bytes;
}

// Shared memory layout, from a 1024-byte aligned base:
//   A ring   T[kNumStages][BLOCK_M][BLOCK_K]   128-byte swizzled rows of BLOCK_K elements (TMA box)
//   B ring   T[kNumStages][BLOCK_N][BLOCK_K]   same
//   D chunks D[BLOCK_M / 64][epi_buffers][64][EPI_N]   per consumer warpgroup, swizzled (TMA store box)
//   full     u64[kNumStages]   mbarrier: the stage's A and B landed (TMA transaction bytes)
//   empty    u64[kNumStages]   mbarrier: every consumer warp has finished reading the stage
// Every part starts 1024-byte aligned (tiles and chunks are multiples of 2 KiB). The operands' element
// size (in_bytes) and D's (out_bytes) differ in the FP8 GEMM (e4m3 in, bf16 out): the *_mixed forms.
TDIST_HOST_DEVICE constexpr unsigned gemm_stage_bytes(unsigned block_m, unsigned block_n, unsigned block_k,
                                                      unsigned elem_bytes) {
  return (block_m + block_n) * block_k * elem_bytes;
}
TDIST_HOST_DEVICE constexpr unsigned gemm_smem_bytes_with(unsigned block_m, unsigned block_n, unsigned block_k,
                                                          unsigned stages, unsigned in_bytes, unsigned out_bytes,
                                                          unsigned epi_buffers, unsigned stage_extra = 0) {
  return kSmemAlign + stages * (gemm_stage_bytes(block_m, block_n, block_k, in_bytes) + stage_extra) +
         gemm_math_warpgroups(block_m) * epi_buffers * gemm_epi_chunk_bytes(block_n, out_bytes) + 2 * stages * 8;
}
// Chunk buffers per consumer warpgroup: 2 if they fit beside the ring, else 1. `stage_extra`: bytes per
// stage beside A and B (the FP8 GEMM's scales), placed after the D chunks.
TDIST_HOST_DEVICE constexpr unsigned gemm_epi_buffers_mixed(unsigned block_m, unsigned block_n, unsigned block_k,
                                                            unsigned stages, unsigned in_bytes, unsigned out_bytes,
                                                            unsigned stage_extra = 0) {
  return gemm_smem_bytes_with(block_m, block_n, block_k, stages, in_bytes, out_bytes, 2, stage_extra) <= kMaxSmemBytes
             ? 2
             : 1;
}
TDIST_HOST_DEVICE constexpr unsigned gemm_smem_bytes_mixed(unsigned block_m, unsigned block_n, unsigned block_k,
                                                           unsigned stages, unsigned in_bytes, unsigned out_bytes,
                                                           unsigned stage_extra = 0) {
  return gemm_smem_bytes_with(
      block_m, block_n, block_k, stages, in_bytes, out_bytes,
      gemm_epi_buffers_mixed(block_m, block_n, block_k, stages, in_bytes, out_bytes, stage_extra), stage_extra);
}
TDIST_HOST_DEVICE constexpr unsigned gemm_epi_buffers(unsigned block_m, unsigned block_n, unsigned block_k,
                                                      unsigned stages, unsigned elem_bytes) {
  return gemm_epi_buffers_mixed(block_m, block_n, block_k, stages, elem_bytes, elem_bytes);
}
TDIST_HOST_DEVICE constexpr unsigned gemm_smem_bytes(unsigned block_m, unsigned block_n, unsigned block_k,
                                                     unsigned stages, unsigned elem_bytes) {
  return gemm_smem_bytes_mixed(block_m, block_n, block_k, stages, elem_bytes, elem_bytes);
}

// The FP8 GEMM (sm90_fp8_gemm.cuh): K per stage, and the scale block along K and N.
constexpr int kFp8BlockK = 128;

// Shared bytes per stage of its scales: A's of the tile's BLOCK_M rows, then B's, padded to 16 bytes.
TDIST_HOST_DEVICE constexpr unsigned fp8_scale_stage_bytes(unsigned block_m) { return (block_m + 4) * 4; }

// Its scales (layout at sm90_fp8_gemm.cuh). Device pointers; strides in elements.
struct Fp8BlockScales {
  const float* a = nullptr;        // gathered A: the scales of token t at row t (RowGather's `gathered`)
  const float* a_local = nullptr;  // gathered A only: RowGather's `local` tokens' scales, from local_begin
  tdist::device::u64 a_row_stride = 0, a_kb_stride = 0;  // both of a and a_local
  const float* b = nullptr;
  // 1: a's rows are contiguous (a_row_stride 1, column-major), a and a_kb_stride 16-byte aligned and M a
  // multiple of 4, so a tile's A scales of one K block come in one bulk copy (a TMA A only).
  unsigned a_rows_contiguous = 0;
  unsigned n_blocks = 0;  // NB = ceil(N / 128)
  unsigned k_blocks = 0;  // KB = ceil(K / 128)
};

}  // namespace tdist::kernels::gemm
