// Parameter blocks of the overlap ops' device code (overlap.cuh), in plain C++ shared by the host
// (which fills them) and nvcc/NVRTC.
#pragma once

#include "tdist/kernels/gemm/tile_scheduler.cuh"

namespace tdist::kernels::gemm {

// Largest world of the overlap ops (pointer arrays in kernel parameters).
constexpr int kMaxOverlapRanks = 8;

// AllGather-GEMM, fused: the producer of each tile waits for the chunks of A the tile reads.
struct AllGatherWaitParams {
  const u64* chunk_flags;  // this rank's: chunk_flags[r] >= 1 once rank r's rows are in the gathered A
  RowChunks split;         // rows of the gathered A per rank
  int rank;                // own chunk: written before the launch, never waited for
};

// MoE AllGather + grouped GEMM, fused (kernels/moe/routing.cuh: the ag tile lists, run as one listed
// walk of GatherGroupedScheduler): a tile of list j holds rows of relative sources first .. j, where
// `first` is the source of its first row (an expert's rows come in relative-source order, real rows
// before padding), and waits for those chunks other than this rank's own.
struct MoeGatherWaitParams {
  const u64* chunk_flags;   // this rank's: chunk_flags[r] >= 1 once rank r's tokens have landed
  const int* token_of_row;  // the routing's (written before the launch, in stream order)
  RowChunks split;          // tokens per rank
  int rank;
};

// GEMM-ReduceScatter, fused: the GEMM counts finished tiles per row chunk and raises a chunk's flag
// when its last tile is stored.
struct ChunkPublishParams {
  u32* chunk_tiles_done;  // u32[world], local, zeroed before the launch
  u64* chunk_ready;       // u64[world], local, zeroed before the launch; 1 once the chunk is stored
  RowChunks split;
  u32 block_m;
  u32 tiles_n;
};

// out[i][j] = sum over s < num_sources of src[s][i][j] in fp32 (source order: every rank reducing the
// same rows gets the same bits) for rows x n elements, row stride n everywhere. out may be one of
// the sources (each element is read before it is written, by the same thread).
// Every block first waits for flags[s] >= 1, s != skip_wait (flags may be null).
struct ReduceParams {
  const void* src[kMaxOverlapRanks];
  int num_sources;
  int skip_wait;
  const u64* flags;
  void* out;
  u64 rows, n;
};

}  // namespace tdist::kernels::gemm
