// Mixture-of-experts layers under tensor parallelism (every rank holds every expert's shard of the
// intermediate features) with the communication behind the grouped GEMM. docs/moe.md.
//
//   first projection   d[rows in expert order][n] = allgather(a_local)[token of row] x B1_e^T
//   second projection  y[token][n] = sum over ranks and k of weight[token][k] x (h[row of (token, k)] x B2_e^T)
//                      (MoeGroupGemmRs: this rank's tokens; run_all_reduce: every token)
//
// Routing (kernels/moe/routing.cuh gives the layouts): the router's top-k ids of all M tokens
// (int32 [M][topk], the same on every rank) are sorted by expert on the GPU, each expert's rows
// padded to whole tiles of kMoeTile rows; the rows of one expert keep this rank's tokens first.
// Row r of the expert-ordered matrices holds token token_of_row[r] (-1: padding, read as zeros by
// the first projection's gathered-A GEMM); pair (t, k) sits at row row_of_pair[t][k].
// Expert-ordered matrices have moe_capacity(M, topk, E) rows; rows past offsets[E] are not written.
//
//   tdist::MoeAgGroupGemm up(world, heap, {.max_m = 16384, .k = 4096, .experts = 8, .topk = 2});
//   up.run({.a_local = x, .topk_ids = ids, .b = w13, .d = h13, .m = m, .n = 2 * 14336 / world}, stream);
//   swiglu(h13 -> h)                                            // the user's activation, row by row
//   tdist::MoeGroupGemmRs down(world, heap, {.max_m = 16384, .max_n = 4096, .experts = 8, .topk = 2});
//   down.run({.h = h, .b = w2, .topk_weights = w, .routing = &up.routing(), .d = y, .m = m, .n = 4096,
//             .k = 14336 / world}, stream);
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "tdist/common/dtype.hpp"
#include "tdist/ops/overlap_ops.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

// Rows of the expert-ordered matrices for any routing of m tokens (every pair plus a partial tile per
// expert), and their tiles of 128 rows.
int64_t moe_capacity(int64_t m, int topk, int experts);
int64_t moe_max_tiles(int64_t m, int topk, int experts);
// The rows offsets[E] of a uniform routing of m tokens on average: per expert the expected tiles
// E[ceil(c / 128)] of its count c ~ Binomial(m, topk / experts) (P(c >= 1) exactly, P(c > 128 j) for
// j >= 1 by the normal approximation), times 128; at most the capacity, which assumes every expert's
// last tile nearly empty. The M of the MoE GEMMs' tile choice.
int64_t moe_expected_rows(int64_t m, int topk, int experts);

// Throws tdist::Error naming the argument: m (>= 0, < 2^31 / topk), topk (1 .. experts), experts
// (1 .. 1024), world_size (1 .. 8), rank.
void check_moe_routing_args(int64_t m, int topk, int experts, int world_size, int rank);

// The routing of one rank, on the host (layouts in kernels/moe/routing.cuh). The GPU computes the
// same values; this is the reference of its tests.
struct MoeRoutingHost {
  std::vector<int> offsets, counts, token_of_row, row_of_pair;  // token_of_row: offsets[E] rows
  std::vector<int> compact_offsets, row_of_compact, token_of_compact, pair_of_compact, compact_of_pair;
  std::vector<std::vector<uint32_t>> ag_order, rs_order;  // [world] lists of tiles
  std::vector<uint32_t> pair_order;                       // every tile (grouped_pair_order)
};
// Throws naming "topk_ids" for a wrong size or an id outside [0, experts).
MoeRoutingHost moe_routing_reference(const std::vector<int>& topk_ids, int64_t m, int topk, int experts, int world_size,
                                     int rank);

// A routing in device memory, as the ops read it (owned by a MoeRouter or an op).
struct MoeRouting {
  const int* offsets = nullptr;        // int32[E + 1]
  const int* counts = nullptr;         // int32[E]
  const int* token_of_row = nullptr;   // int32[capacity]
  const int* row_of_pair = nullptr;    // int32[M][topk]
  const uint32_t* ag_order = nullptr;  // u32[world][max_tiles]
  const uint32_t* ag_count = nullptr;  // u32[world]
  const uint32_t* rs_order = nullptr;  // u32[world][max_tiles]
  const uint32_t* rs_count = nullptr;  // u32[world]
  const uint32_t* pair_order = nullptr;  // u32[offsets[E] / 128]: the walk of a 2-CTA cluster
  int64_t m = 0, capacity = 0, max_tiles = 0;
  int topk = 0, experts = 0, world_size = 0, rank = 0;
};

// A routing's arrays in the caller's device memory (int32, layouts in kernels/moe/routing.cuh),
// for callers that keep them past the next routing (the Python ops' backward). The compact ones
// are written only where compact_offsets is set (then all five must be); with m = 0 only offsets,
// counts and compact_offsets are written (the others may be null).
struct MoeRoutingArrays {
  int* offsets = nullptr;           // [E + 1]
  int* counts = nullptr;            // [E]
  int* token_of_row = nullptr;      // [capacity(m)]: every row, -1 for padding and past offsets[E]
  int* row_of_pair = nullptr;       // [m][topk]
  int* compact_offsets = nullptr;   // [E + 1]
  int* row_of_compact = nullptr;    // [m topk]
  int* token_of_compact = nullptr;  // [m topk]
  int* pair_of_compact = nullptr;   // [m topk]
  int* compact_of_pair = nullptr;   // [m][topk]
};

// Routing on the GPU for up to max_m tokens: four small kernels, no host synchronisation.
class MoeRouter {
 public:
  MoeRouter(int64_t max_m, int topk, int experts, int world_size, int rank);
  ~MoeRouter();
  MoeRouter(const MoeRouter&) = delete;
  MoeRouter& operator=(const MoeRouter&) = delete;

  // Routes m tokens' ids (device, int32 [m][topk]) on `stream`; the view stays valid until the next
  // call. An id outside [0, experts) is routed to expert 0 (the kernels go on: no trap, which would
  // lose the CUDA context), printed from the device and recorded; check_errors() reports it.
  const MoeRouting& route(const int* topk_ids, int64_t m, cudaStream_t stream);
  const MoeRouting& routing() const;
  // The same routing into `out` (the tile lists stay in the router's buffers); throws naming
  // the argument for a null or misaligned array.
  void route_into(const int* topk_ids, int64_t m, const MoeRoutingArrays& out, cudaStream_t stream);
  // Synchronises the device; throws naming topk_ids if a routing since the last report met an id
  // outside [0, experts).
  void check_errors();

 private:
  void launch(const int* topk_ids, int64_t m, const MoeRoutingArrays& out, cudaStream_t stream, bool all_rows);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The method `auto` runs (pure): the unfused sequence (kBaseline) on one rank or below 256 tokens per
// rank, where a chunk's GEMM is too short to hide a transfer behind (the dense ops' bound,
// docs/gemm_overlap.md); kChunked otherwise. Not yet tuned on MoE shapes.
OverlapMethod choose_moe_method(int64_t m, int world_size);

struct MoeConfig {
  int64_t max_m = 0;  // tokens (all ranks)
  int64_t k = 0;      // MoeAgGroupGemm: the hidden size (columns of a_local)
  int64_t max_n = 0;  // MoeGroupGemmRs: the largest N (the hidden size of its output)
  int experts = 0;
  int topk = 0;
  // bf16 or fp16 (inputs and outputs), or kFloat8E4M3: e4m3 inputs (tokens or h, and weights) with
  // DeepSeek-V3's block scales (the FP8 grouped GEMM's, ops/grouped_gemm.hpp), bf16 outputs.
  DType dtype = DType::kBFloat16;
};

// Symmetric-heap bytes of one context on world_size ranks of num_sms SMs.
size_t moe_ag_group_gemm_heap_bytes(const MoeConfig& config, int world_size, int num_sms);
size_t moe_group_gemm_rs_heap_bytes(const MoeConfig& config, int world_size, int num_sms);

struct MoeAgGroupGemmArgs {
  const void* a_local = nullptr;  // T[rows(rank)][k]: this rank's tokens
  const int* topk_ids = nullptr;  // int32[m][topk], device: every token's experts
  const void* b = nullptr;        // T[experts][n][k]: this rank's shard of every expert
  void* d = nullptr;              // T[moe_capacity(m)][n]: expert order (routing().token_of_row); bf16 for FP8
  int64_t m = 0, n = 0;
  // FP8 (config.dtype kFloat8E4M3) only, KB = ceil(k / 128), NB = ceil(n / 128):
  const float* a_local_scales = nullptr;  // f32[rows(rank)][KB] row-major: a token's scale per 128 columns
  const float* b_scales = nullptr;        // f32[experts][NB][KB]: one per 128 x 128 block of each expert's b
};

// AllGather + grouped GEMM. Methods: chunked (copy-engine puts with one flag per source chunk; the
// tiles whose rows are all this rank's run first, then each chunk's tiles once its flag is up, a
// launch per chunk), fused (the same puts; one grouped GEMM launch whose producer waits before each
// tile for the chunks of its rows' sources), baseline (NCCL AllGather, then the grouped GEMM), auto
// (the fastest of them timed at a shape class's first call; else choose_moe_method). FP8 moves each
// token's e4m3 row and its scales and runs the FP8 grouped GEMM; it has no fused method yet.
class MoeAgGroupGemm {
 public:
  MoeAgGroupGemm(World& world, SymmetricHeap& heap, const MoeConfig& config);
  ~MoeAgGroupGemm();
  OverlapMethod method(const MoeAgGroupGemmArgs& args, OverlapMethod requested = OverlapMethod::kAuto) const;
  void run(const MoeAgGroupGemmArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  // The routing of the last run (device memory, valid until the next run).
  const MoeRouting& routing() const;
  const MoeConfig& config() const;
  // Its router's check_errors(): throws naming topk_ids if a run met an expert id out of range.
  void check_errors();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct MoeGroupGemmRsArgs {
  const void* h = nullptr;              // T[routing->capacity][k], expert order
  const void* b = nullptr;              // T[experts][n][k]
  const float* topk_weights = nullptr;  // fp32[m][topk], device: the router's weights
  const MoeRouting* routing = nullptr;  // of these m tokens on this rank (MoeAgGroupGemm::routing())
  void* d = nullptr;                    // T[rows(rank)][n] (run_all_reduce: T[m][n]); bf16 for FP8
  int64_t m = 0, n = 0, k = 0;
  // FP8 (config.dtype kFloat8E4M3) only, k a multiple of 16, KB = ceil(k / 128), NB = ceil(n / 128):
  const float* h_scales = nullptr;  // f32: row r's scale of K block kb at h_scales[r * row_stride + kb * kb_stride]
  // h_scales' strides in elements; both 0: row-major [routing->capacity][KB]. Column-major (row stride 1,
  // kb stride a multiple of 4, 16-byte aligned) is the faster: the grouped GEMM copies a tile's scales
  // in one piece (kernels/gemm/sm90_fp8_gemm.cuh).
  int64_t h_scales_row_stride = 0, h_scales_kb_stride = 0;
  const float* b_scales = nullptr;  // f32[experts][NB][KB]: one per 128 x 128 block of each expert's b
};

// Grouped GEMM + top-k weighted reduce + ReduceScatter (or AllReduce). Methods of run: chunked (the
// tiles of the peers' tokens first, each peer's reduced rows sent by copy engine as soon as they are
// done, own tokens last, summed with what arrived), baseline (grouped GEMM, reduce, NCCL
// ReduceScatter), auto (choose_moe_method). run_all_reduce: grouped GEMM, reduce, then tdist's AllReduce (NCCL
// past its capacity), for decode.
class MoeGroupGemmRs {
 public:
  MoeGroupGemmRs(World& world, SymmetricHeap& heap, const MoeConfig& config);
  ~MoeGroupGemmRs();
  OverlapMethod method(const MoeGroupGemmRsArgs& args, OverlapMethod requested = OverlapMethod::kAuto) const;
  void run(const MoeGroupGemmRsArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  void run_all_reduce(const MoeGroupGemmRsArgs& args, cudaStream_t stream);
  const MoeConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist
