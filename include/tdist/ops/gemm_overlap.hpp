// Tensor-parallel linear layers whose communication overlaps the GEMM, inside one NVLink domain:
//
//   AllGatherGemm      D = allgather(A) x B^T   A split by rows over the ranks, B = this rank's N x K shard
//   GemmReduceScatter  D = rows of this rank of sum_r (A_r x B_r^T)   each rank holds a K slice
//   GemmAllReduce      D = sum_r (A_r x B_r^T) on every rank
//
// Layout as tdist::Gemm ("TN", y = x W^T): A is M x K row-major, B (the weight shard) N x K row-major,
// D M x N row-major, all dense (leading dimension = columns), bf16 or fp16, fp32 accumulation.
//
// Rows split over ranks as RowChunks{M, world_size} (tile_scheduler.cuh): rank r owns rows
// [begin(r), +rows(r)); the first M % world_size ranks own one row more. AllGatherGemm's A_local and
// GemmReduceScatter's D are that chunk.
//
//   tdist::World world;
//   tdist::SymmetricHeap heap(world, 8ull << 30);
//   tdist::AllGatherGemm ag(world, heap, {.max_m = 16384, .k = 8192, .dtype = tdist::DType::kBFloat16});
//   ag.run({.a_local = x_shard, .b = w_shard, .d = y, .m = 16384, .n = 7168}, stream);
//
// Each context is created collectively (every rank, same config), owns its symmetric buffers and
// flags, compiles its kernels up front, and serves any call up to its configured sizes. Calls are
// stream-ordered, do no host synchronisation and can be captured in CUDA graphs; every rank makes the
// same sequence of calls with the same M, N, K and method. Calls of one context must not run
// concurrently on two streams.
//
// Methods (docs/gemm_overlap.md has the protocols and the performance model):
//   kFused     tdist's persistent GEMM, one launch. AllGather: the copy engine pushes each rank's chunk
//              to every peer with a flag per chunk; each tile's producer waits (acquire) for the flags
//              of the rows it reads, and the walk starts at the local chunk. ReduceScatter/AllReduce:
//              the GEMM walks the peers' rows first; finished row chunks go to their owner by copy
//              engine while the remaining tiles run, and the owner reduces them in fp32.
//   kChunked   the same protocols with the GEMM split into one cuBLAS call per row chunk; the
//              ReduceScatter and AllReduce cut each chunk into pieces (overlap_row_pieces), and the
//              owner's GEMM of a piece adds the received partial in cuBLASLt's epilogue.
//   kSequential cuBLAS and tdist's own collective (Collectives: LL / one-shot / copy engine) in
//              sequence: no overlap, for small M where tdist's low-latency collectives beat NCCL and
//              there is too little GEMM to hide anything behind. AllGather-GEMM and GEMM-ReduceScatter
//              need M divisible by the world size for it (equal per-rank counts).
//   kBaseline  NCCL collective and cuBLAS in sequence (what the overlap must beat).
//   kAuto      the performance model's choice (choose_overlap_method); TDIST_OVERLAP_METHOD overrides.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "tdist/ops/collective_select.hpp"  // DType
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

enum class OverlapMethod { kAuto, kFused, kChunked, kSequential, kBaseline };
const char* to_string(OverlapMethod method);
// "auto", "fused", "chunked", "sequential", "baseline"; throws tdist::Error naming `what` otherwise.
OverlapMethod parse_overlap_method(const std::string& text, const char* what = "method");

enum class OverlapOp { kAllGatherGemm, kGemmReduceScatter, kGemmAllReduce };
const char* to_string(OverlapOp op);

// The problem an overlap op solves, for the performance model: the whole M (all ranks' rows), the N
// and K of one rank's GEMM (AllGather-GEMM: N = the local shard's columns; ReduceScatter/AllReduce:
// K = the local slice).
struct OverlapShape {
  OverlapOp op;
  int64_t m, n, k;
  int world_size;
  DType dtype = DType::kBFloat16;
};
// The method kAuto runs (pure; CPU-tested): the baseline when the model gives the overlap no gain
// (small M, where per-chunk launches and flag waits cost more than the hidden communication),
// otherwise the chunked or fused method.
OverlapMethod choose_overlap_method(const OverlapShape& shape);

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

// ---------------------------------------------------------------------------------------------
struct AllGatherGemmConfig {
  int64_t max_m = 0;  // largest total M (rows of the gathered A)
  int64_t k = 0;      // K of every call (multiple of 8)
  DType dtype = DType::kBFloat16;
};

struct AllGatherGemmArgs {
  const void* a_local = nullptr;  // RowChunks{m, world}.rows(rank) x K: this rank's rows of A
  const void* b = nullptr;        // N x K: this rank's weight shard
  void* d = nullptr;              // M x N
  void* a_gathered = nullptr;     // optional M x K: receives the gathered A
  int64_t m = 0, n = 0;
};

class AllGatherGemm {
 public:
  AllGatherGemm(World& world, SymmetricHeap& heap, const AllGatherGemmConfig& config);
  ~AllGatherGemm();
  AllGatherGemm(const AllGatherGemm&) = delete;
  AllGatherGemm& operator=(const AllGatherGemm&) = delete;

  void run(const AllGatherGemmArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  // The method run() would use (resolves kAuto and TDIST_OVERLAP_METHOD); checks the arguments.
  OverlapMethod method(const AllGatherGemmArgs& args, OverlapMethod method = OverlapMethod::kAuto) const;
  // This rank's rows inside the context's symmetric gathered-A buffer, for M = m: an a_local that is
  // this pointer (the caller wrote its rows there) is used without a copy.
  void* local_rows(int64_t m) const;
  const AllGatherGemmConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
struct GemmReduceScatterConfig {
  int64_t max_m = 0;  // largest total M
  int64_t max_n = 0;  // largest N
  DType dtype = DType::kBFloat16;
};

struct GemmReduceScatterArgs {
  const void* a = nullptr;  // M x K: every row, this rank's K slice
  const void* b = nullptr;  // N x K: this rank's K slice of the weight
  void* d = nullptr;        // RowChunks{m, world}.rows(rank) x N: this rank's rows of the sum
  int64_t m = 0, n = 0, k = 0;
};

class GemmReduceScatter {
 public:
  GemmReduceScatter(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& config);
  ~GemmReduceScatter();
  GemmReduceScatter(const GemmReduceScatter&) = delete;
  GemmReduceScatter& operator=(const GemmReduceScatter&) = delete;

  void run(const GemmReduceScatterArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  OverlapMethod method(const GemmReduceScatterArgs& args, OverlapMethod method = OverlapMethod::kAuto) const;
  const GemmReduceScatterConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
using GemmAllReduceConfig = GemmReduceScatterConfig;

struct GemmAllReduceArgs {
  const void* a = nullptr;  // M x K: every row, this rank's K slice
  const void* b = nullptr;  // N x K: this rank's K slice of the weight
  void* d = nullptr;        // M x N: the sum over ranks, on every rank
  int64_t m = 0, n = 0, k = 0;
};

class GemmAllReduce {
 public:
  GemmAllReduce(World& world, SymmetricHeap& heap, const GemmAllReduceConfig& config);
  ~GemmAllReduce();
  GemmAllReduce(const GemmAllReduce&) = delete;
  GemmAllReduce& operator=(const GemmAllReduce&) = delete;

  void run(const GemmAllReduceArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  OverlapMethod method(const GemmAllReduceArgs& args, OverlapMethod method = OverlapMethod::kAuto) const;
  const GemmAllReduceConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The symmetric-heap bytes a context of this config allocates (its buffers and its Collectives) on
// `world_size` ranks of GPUs with `num_sms` SMs: what the heap must have free for the constructor.
// Pure (computed from the sizes the constructors allocate), CPU-tested.
size_t all_gather_gemm_heap_bytes(const AllGatherGemmConfig& config, int world_size, int num_sms);
size_t gemm_reduce_scatter_heap_bytes(const GemmReduceScatterConfig& config, int world_size, int num_sms);
size_t gemm_all_reduce_heap_bytes(const GemmAllReduceConfig& config, int world_size, int num_sms);

// Argument checks (pure, CPU-tested; the classes call them): every error names the argument.
void check_all_gather_gemm_args(const AllGatherGemmArgs& args, const AllGatherGemmConfig& config, int world_size,
                                int rank);
void check_gemm_reduce_scatter_args(const GemmReduceScatterArgs& args, const GemmReduceScatterConfig& config);
void check_gemm_all_reduce_args(const GemmAllReduceArgs& args, const GemmAllReduceConfig& config);

}  // namespace tdist
