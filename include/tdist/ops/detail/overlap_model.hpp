// Internals of the overlapped ops that the CPU tests reach: the performance model behind kAuto, the
// row pieces of the chunked ReduceScatter / AllReduce, and the typed ops' argument checks. Not part
// of the user API (ops/gemm_overlap.hpp, ops/overlap_ops.hpp).
#pragma once

#include <cstdint>

#include "tdist/common/dtype.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/ops/overlap_ops.hpp"

namespace tdist {

// The problem an overlap op solves, for the performance model: what crosses the links, the whole M
// (all ranks' rows), the N and K of one rank's GEMM (AllGather-GEMM: N = the local shard's columns;
// ReduceScatter/AllReduce: K = the local slice).
struct OverlapShape {
  OverlapComm comm;
  int64_t m, n, k;
  int world_size;
  DType dtype = DType::kBFloat16;
};
// The method kAuto runs (pure; CPU-tested): the no-overlap sequence when the model gives the overlap
// no gain (small M, where per-chunk launches and flag waits cost more than the hidden
// communication), otherwise the chunked method.
OverlapMethod choose_overlap_method(const OverlapShape& shape);

// M's bucket in the shape classes that `auto` times its methods for (pure; CPU-tested): the first
// of 1, 2, 3, 4, 6, 8, 12, 16, ... (2^i and 3 * 2^(i-1)) at or above m, so that the calls reusing a
// winner have an M within 1.5x of the one it was timed at.
int64_t overlap_m_bucket(int64_t m);

// The chunked ReduceScatter and AllReduce cut every rank's row chunk into this many pieces (pure;
// CPU-tested): each peer piece goes to its owner as soon as its GEMM is done, and the owner's GEMM
// of a piece adds the received partial in its epilogue, so no separate reduction pass remains
// (two ranks) and only the last piece's exchange is exposed. ReduceScatter: as few pieces as let
// each piece's transfer hide behind one piece of GEMM (at least 2); AllReduce: more as the chunk
// grows (its last piece is gathered after the GEMMs). A power of two (tile-aligned pieces), at most
// kMaxOverlapPieces, none under 512 rows; 1 (fewer than 1024 rows per rank, or one rank) keeps one
// GEMM per chunk and the fp32 reduction after them. TDIST_OVERLAP_PIECES (1 to kMaxOverlapPieces)
// overrides.
constexpr int kMaxOverlapPieces = 4;
int overlap_row_pieces(const OverlapShape& shape);

// Argument checks of the typed ops (pure, CPU-tested; the classes call them): every error names the
// argument.
void check_all_gather_gemm_args(const AllGatherGemmArgs& args, const AllGatherGemmConfig& config, int world_size,
                                int rank);
void check_gemm_reduce_scatter_args(const GemmReduceScatterArgs& args, const GemmReduceScatterConfig& config);
void check_gemm_all_reduce_args(const GemmAllReduceArgs& args, const GemmAllReduceConfig& config);

}  // namespace tdist
