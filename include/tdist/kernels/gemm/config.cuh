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

// Shared memory layout, from a 1024-byte aligned base:
//   A ring   T[kNumStages][BLOCK_M][BLOCK_K]   128-byte swizzled rows of BLOCK_K elements (TMA box)
//   B ring   T[kNumStages][BLOCK_N][BLOCK_K]   same
//   full     u64[kNumStages]   mbarrier: the stage's A and B landed (TMA transaction bytes)
//   empty    u64[kNumStages]   mbarrier: every consumer warp has finished reading the stage
TDIST_HOST_DEVICE constexpr unsigned gemm_stage_bytes(unsigned block_m, unsigned block_n, unsigned block_k,
                                                      unsigned elem_bytes) {
  return (block_m + block_n) * block_k * elem_bytes;
}
TDIST_HOST_DEVICE constexpr unsigned gemm_smem_bytes(unsigned block_m, unsigned block_n, unsigned block_k,
                                                     unsigned stages, unsigned elem_bytes) {
  return kSmemAlign + stages * gemm_stage_bytes(block_m, block_n, block_k, elem_bytes) + 2 * stages * 8;
}

}  // namespace tdist::kernels::gemm
