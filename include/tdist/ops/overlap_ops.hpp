// The overlapped ops as plug-ins. Every op that overlaps a GEMM with communication describes itself
// once, in an OverlapOpTraits entry of the catalogue (overlap_ops()): its name, its operands and their
// shapes, the dtypes it takes, what its context is sized by, the symmetric memory a context takes and
// how to create one. The Python binding, the Python fake (meta) implementations, the context cache
// below and the benchmarks read this description; none of them branches on an op's name.
// docs/adding_an_op.md walks through adding an op.
//
// Shapes are written in four extents of a call:
//   M      all ranks' rows (the whole problem)
//   Rows   this rank's rows of M, split as RowChunks{M, world_size}: rank r owns rows
//          [begin(r), +rows(r)), the first M % world_size ranks one row more
//   N, K   this rank's GEMM: D = A x B^T with B of shape N x K
// plus HalfN = N / 2 for ops whose epilogue halves the columns (SwiGLU).
//
// Every operand is a dense row-major matrix (leading dimension = its columns), 16-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "tdist/common/dtype.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

enum class OverlapMethod { kAuto, kFused, kChunked, kSequential, kBaseline };
const char* to_string(OverlapMethod method);
// "auto", "fused", "chunked", "sequential", "baseline"; throws tdist::Error naming `what` otherwise.
OverlapMethod parse_overlap_method(const std::string& text, const char* what = "method");

// What crosses the links in one call, for the performance model (choose_overlap_method).
enum class OverlapComm {
  kGatherA,     // every rank's rows of A reach every rank (M x K in all)
  kScatterD,    // every rank's partial D reaches the owner of its rows (M x N in all)
  kAllReduceD,  // the partial D is reduced and the sum reaches every rank (2 x M x N in all)
};
const char* to_string(OverlapComm comm);  // "gather_a", "scatter_d", "all_reduce_d"

enum class Extent { kM, kRows, kN, kHalfN, kK };
const char* to_string(Extent extent);  // "M", "rows", "N", "N/2", "K"

enum class OperandRole { kInput, kOutput, kOptionalOutput };

struct OperandTraits {
  const char* name;  // the argument's name in every layer ("a_local", "b", "d", ...)
  Extent rows, cols;
  OperandRole role;
};

constexpr int kMaxOverlapOperands = 4;

// One call of an op: pointers in its traits' operand order (null for an absent optional output),
// and the extents (m: all ranks' rows; n, k: this rank's GEMM).
struct OverlapCall {
  std::array<void*, kMaxOverlapOperands> operands{};
  int64_t m = 0, n = 0, k = 0;
};

// What a context is created for. Fields the op's traits do not size it by stay 0.
struct OverlapContextConfig {
  DType dtype = DType::kBFloat16;
  int64_t max_m = 0;  // largest M
  int64_t max_n = 0;  // largest N (ops sized by N)
  int64_t k = 0;      // the K of every call (ops whose buffers hold rows of A)
};

// A created op: symmetric buffers, flags and compiled kernels for calls up to its config.
// Collective to create and destroy; calls are stream-ordered and graph-capturable.
class OverlapContext {
 public:
  virtual ~OverlapContext() = default;
  virtual OverlapContextConfig context_config() const = 0;
  // The method run() would use (resolves kAuto and TDIST_OVERLAP_METHOD); checks the call.
  virtual OverlapMethod method(const OverlapCall& call, OverlapMethod requested = OverlapMethod::kAuto) const = 0;
  virtual void run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method = OverlapMethod::kAuto) = 0;
};

struct OverlapOpTraits {
  const char* name;                     // catalogue name: "ag_gemm"
  const char* summary;                  // one line, for help texts and docstrings
  std::vector<OperandTraits> operands;  // inputs first, then outputs
  OverlapComm comm;
  int n_multiple;     // N must be a multiple of this (8: 16-byte rows of D)
  bool context_by_k;  // a context serves one K (its buffers hold rows of A)
  bool context_by_n;  // a context serves N up to its max_n (its buffers hold rows of D)
  // Symmetric-heap bytes a context of `config` allocates on world_size ranks of GPUs with num_sms
  // SMs (pure: the same layout the constructor allocates).
  size_t (*heap_bytes)(const OverlapContextConfig& config, int world_size, int num_sms);
  // Creates a context (collective).
  std::unique_ptr<OverlapContext> (*create)(World& world, SymmetricHeap& heap, const OverlapContextConfig& config);

  int num_operands() const { return static_cast<int>(operands.size()); }
  // The index of the operand named `name`, or -1.
  int operand_index(const std::string& name) const;
};

// The catalogue, sorted by name. Each op's source file adds its entry (TDIST_REGISTER_OVERLAP_OP,
// ops/detail/overlap_registry.hpp).
const std::vector<const OverlapOpTraits*>& overlap_ops();
// By catalogue name; throws tdist::Error naming `what` and listing the known names otherwise.
const OverlapOpTraits& find_overlap_op(const std::string& name, const char* what = "op");

// The value of each extent in a call on `rank` of `world_size` (m, n, k as in OverlapCall).
struct OverlapExtents {
  int64_t m = 0, rows = 0, n = 0, k = 0;
  int64_t operator[](Extent e) const;
};
OverlapExtents overlap_extents(int64_t m, int64_t n, int64_t k, int world_size, int rank);

// The checks every op's call shares (pure, CPU-tested; errors name the argument): dtype, extents
// in range, N a multiple of the op's n_multiple, every operand that holds data non-null and 16-byte
// aligned (optional outputs may be null).
void check_overlap_call(const OverlapOpTraits& op, DType dtype, const OverlapCall& call, int world_size, int rank);

// The smallest context config that serves a call of `op` with these extents.
OverlapContextConfig overlap_context_for(const OverlapOpTraits& op, DType dtype, int64_t m, int64_t n, int64_t k);
// Whether a context of `have` serves a call that needs `need` (same dtype, K where sized by K, at
// least need's M and N).
bool overlap_context_serves(const OverlapOpTraits& op, const OverlapContextConfig& have,
                            const OverlapContextConfig& need);

// Contexts created on first use and re-created larger when a call exceeds them, one per (op, dtype
// and, for ops sized by K, K). Growth: a re-created context takes at least twice the old max_m when
// the heap has room, so a run of growing M re-creates it O(log M) times; N grows to the largest seen.
// Creating a context is collective (every rank makes the same sequence of calls) and never happens
// while `stream` captures a CUDA graph: that call throws, asking for a warm-up call first.
class OverlapContextCache {
 public:
  OverlapContextCache(World& world, SymmetricHeap& heap);
  ~OverlapContextCache();
  OverlapContextCache(const OverlapContextCache&) = delete;
  OverlapContextCache& operator=(const OverlapContextCache&) = delete;

  OverlapContext& get(const OverlapOpTraits& op, DType dtype, int64_t m, int64_t n, int64_t k, cudaStream_t stream);
  // The live contexts (op, config).
  std::vector<std::pair<const OverlapOpTraits*, OverlapContextConfig>> contexts() const;
  // Destroys every context (collective).
  void clear();

  // The config a context re-created for `need` gets when it replaces `old` (null: none) and the heap
  // has `room` bytes for it (pure, CPU-tested).
  static OverlapContextConfig grown_config(const OverlapOpTraits& op, const OverlapContextConfig* old,
                                           const OverlapContextConfig& need, size_t room, int world_size, int num_sms);

 private:
  World& world_;
  SymmetricHeap& heap_;
  int num_sms_ = 0;
  using Key = std::tuple<std::string, DType, int64_t>;  // op name, dtype, K (0 for ops not sized by K)
  std::map<Key, std::unique_ptr<OverlapContext>> contexts_;
};

}  // namespace tdist
