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
//
// Each class is an OverlapContext (ops/overlap_ops.hpp): the catalogue names them ag_gemm, gemm_rs
// and gemm_ar, and OverlapContextCache creates and grows them on demand for callers that do not
// manage contexts themselves (the Python package does so).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "tdist/common/dtype.hpp"
#include "tdist/ops/overlap_ops.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

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

class AllGatherGemm final : public OverlapContext {
 public:
  AllGatherGemm(World& world, SymmetricHeap& heap, const AllGatherGemmConfig& config);
  ~AllGatherGemm() override;
  AllGatherGemm(const AllGatherGemm&) = delete;
  AllGatherGemm& operator=(const AllGatherGemm&) = delete;

  void run(const AllGatherGemmArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  // The method run() would use (resolves kAuto and TDIST_OVERLAP_METHOD); checks the arguments.
  OverlapMethod method(const AllGatherGemmArgs& args, OverlapMethod method = OverlapMethod::kAuto) const;
  // This rank's rows inside the context's symmetric gathered-A buffer, for M = m: an a_local that is
  // this pointer (the caller wrote its rows there) is used without a copy.
  void* local_rows(int64_t m) const;
  const AllGatherGemmConfig& config() const;

  // OverlapContext: operands (a_local, b, d, gathered).
  OverlapContextConfig context_config() const override;
  OverlapMethod method(const OverlapCall& call, OverlapMethod requested) const override;
  void run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) override;

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

class GemmReduceScatter final : public OverlapContext {
 public:
  GemmReduceScatter(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& config);
  ~GemmReduceScatter() override;
  GemmReduceScatter(const GemmReduceScatter&) = delete;
  GemmReduceScatter& operator=(const GemmReduceScatter&) = delete;

  void run(const GemmReduceScatterArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  OverlapMethod method(const GemmReduceScatterArgs& args, OverlapMethod method = OverlapMethod::kAuto) const;
  const GemmReduceScatterConfig& config() const;

  // OverlapContext: operands (a, b, d).
  OverlapContextConfig context_config() const override;
  OverlapMethod method(const OverlapCall& call, OverlapMethod requested) const override;
  void run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) override;

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

class GemmAllReduce final : public OverlapContext {
 public:
  GemmAllReduce(World& world, SymmetricHeap& heap, const GemmAllReduceConfig& config);
  ~GemmAllReduce() override;
  GemmAllReduce(const GemmAllReduce&) = delete;
  GemmAllReduce& operator=(const GemmAllReduce&) = delete;

  void run(const GemmAllReduceArgs& args, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto);
  OverlapMethod method(const GemmAllReduceArgs& args, OverlapMethod method = OverlapMethod::kAuto) const;
  const GemmAllReduceConfig& config() const;

  // OverlapContext: operands (a, b, d).
  OverlapContextConfig context_config() const override;
  OverlapMethod method(const OverlapCall& call, OverlapMethod requested) const override;
  void run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The symmetric-heap bytes a context of this config allocates (its buffers and its Collectives) on
// `world_size` ranks of GPUs with `num_sms` SMs: what the heap must have free for the constructor.
// Pure (computed from the layouts the constructors allocate), CPU-tested.
size_t all_gather_gemm_heap_bytes(const AllGatherGemmConfig& config, int world_size, int num_sms);
size_t gemm_reduce_scatter_heap_bytes(const GemmReduceScatterConfig& config, int world_size, int num_sms);
size_t gemm_all_reduce_heap_bytes(const GemmAllReduceConfig& config, int world_size, int num_sms);

}  // namespace tdist
