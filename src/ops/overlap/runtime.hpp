// What every overlapped op shares: the per-call frame, the typed launchers of the overlap's kernels
// and of the hooked GEMMs, cuBLAS, the copy engine's side stream and tdist's collectives.
//
// The frame of a fused or chunked call:
//   1. begin_call: reset this rank's flags (memset, stream-ordered after this rank's previous call,
//      which was their only reader), then a barrier across ranks (Collectives::barrier): every rank
//      has reset its flags and finished the previous call's reads of the buffers peers are about to
//      write;
//   2. the copy engine moves data on side(), forked from the caller's stream, each transfer followed
//      by a flag write into the receiver's memory (stream-ordered after the copy);
//   3. the GEMM (one hooked launch, or one cuBLAS call per row chunk with wait_flags between) and the
//      fp32 reduction on the caller's stream; side() joins it at the end.
// Flags only go 0 -> 1 within a call, so a CUDA graph replays the same sequence safely.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "tdist/jit/autotune.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/kernels/gemm/overlap_params.cuh"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/detail/cublas.hpp"
#include "tdist/ops/detail/gemm_runtime.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/ops/overlap_ops.hpp"
#include "tdist/runtime/stream.hpp"

namespace tdist::overlap {

namespace kg = kernels::gemm;
using device::u32;
using device::u64;

// D = A x B^T, dense (leading dimensions K, K, N).
inline GemmArgs gemm_problem(const void* a, const void* b, void* d, int64_t m, int64_t n, int64_t k, DType dtype) {
  return GemmArgs{.a = a, .b = b, .d = d, .m = m, .n = n, .k = k, .dtype = dtype};
}

inline const char* byte_at(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }
inline char* byte_at(void* base, size_t bytes) { return static_cast<char*>(base) + bytes; }

// bf16 or fp16, else an error naming `dtype`.
void check_overlap_dtype(DType dtype);
// Non-null and 16-byte aligned when `needed`; the error names `what`.
void check_operand(const void* p, const char* what, bool needed);

// The overlap's kernels beside the GEMM (kernels/gemm/overlap_kernels.cuh): the flag wait between
// chunked GEMMs and the fp32 reduction of partials. One module; its instances are named here only.
class OverlapKernels {
 public:
  static jit::CompileRequest compile_request();
  explicit OverlapKernels(DType dtype);

  // Waits (one GPU thread, with the device API's timeout) until flags[i] >= 1 for i in
  // [first, first + count), except i == skip (-1: none).
  void wait_flags(const u64* flags, int first, int count, int skip, cudaStream_t stream) const;
  // The reduction of `p` over at most 2 blocks per SM.
  void reduce(const kg::ReduceParams& p, int num_sms, cudaStream_t stream) const;

 private:
  std::shared_ptr<jit::Module> module_;
  jit::Kernel wait_flags_, reduce_;
};

class OverlapRuntime {
 public:
  // `sequential_bytes`: the largest collective the sequential method hands to tdist's collectives
  // (capped); `with_addend`: cuBLAS's D = A x B^T + C too (the ReduceScatter ops' chunked pieces);
  // `op`: the op's name, for fault messages ("tdist's AllGather-GEMM").
  OverlapRuntime(World& world, SymmetricHeap& heap, DType dtype, size_t sequential_bytes, bool with_addend,
                 const std::string& op);
  ~OverlapRuntime();

  // The Collectives context's bytes for a sequential method of `sequential_bytes` (what the heap
  // sizes of the ops add).
  static size_t collectives_bytes(size_t sequential_bytes);
  static size_t collectives_heap_bytes(size_t sequential_bytes, int world_size, int num_sms);

  World& world() const { return world_; }
  SymmetricHeap& heap() const { return heap_; }
  Collectives& coll() const { return *coll_; }
  CublasGemm& cublas() { return *cublas_; }
  int rank() const { return world_.rank(); }
  int size() const { return world_.world_size(); }
  int num_sms() const { return num_sms_; }
  DType dtype() const { return dtype_; }
  size_t sequential_max_bytes() const { return coll_->max_bytes(); }
  // The copy engine's stream beside the caller's (fork / join within one call).
  SideStream& side() { return side_; }

  // Step 1 of the frame: zero `bytes` at each of `flags` on `stream`, then the barrier across ranks.
  void begin_call(std::initializer_list<std::pair<void*, size_t>> flags, cudaStream_t stream);

  void wait_flags(const u64* flags, int first, int count, int skip, cudaStream_t stream) const {
    kernels_.wait_flags(flags, first, count, skip, stream);
  }
  void reduce(const kg::ReduceParams& p, cudaStream_t stream) const { kernels_.reduce(p, num_sms_, stream); }

  // tdist's persistent GEMM with the tile hooks of Params (AllGatherWaitParams, ChunkPublishParams),
  // its walk starting at the m-tile of `first_row`, on at most `max_ctas` CTAs (0: one per SM).
  template <typename Params>
  void hooked_gemm(const GemmArgs& args, const GemmTile& tile, const Params& params, int64_t first_row, int max_ctas,
                   cudaStream_t stream) {
    GemmRunOptions options;
    options.first_row = first_row;
    options.max_ctas = max_ctas;
    static_assert(std::is_same_v<Params, kg::AllGatherWaitParams> || std::is_same_v<Params, kg::ChunkPublishParams>,
                  "the overlap runtime holds GEMMs with the AllGather-wait and chunk-publish hooks");
    if constexpr (std::is_same_v<Params, kg::AllGatherWaitParams>)
      gather_gemm_.run(args, tile, params, options, stream);
    else
      publish_gemm_.run(args, tile, params, options, stream);
  }

  GemmTile tile_for(int64_t m, int64_t n, int64_t k) const { return choose_gemm_tile(m, n, k, num_sms_); }

  // The method a call runs: `requested`, or for kAuto TDIST_OVERLAP_METHOD, else the model's choice
  // for `comm`; checks that it is possible (`sequential_ok`: equal per-rank counts and small enough).
  OverlapMethod resolve(OverlapMethod requested, OverlapComm comm, int64_t m, int64_t n, int64_t k,
                        bool sequential_ok) const;

  // The method a call runs: resolve()'s, except where `auto` would take the model's choice and
  // tuning is on (TDIST_OVERLAP_TUNE, default 1): then the fastest of the methods possible here,
  // timed by running the call itself (`run(method, stream)`, a few times each) at the first call
  // of its shape class (M's bucket, N, K, dtype, world size) outside a graph capture. Every rank
  // times the same candidates in the same order and takes the same winner (the slowest rank's
  // time counts); winners persist in the autotuner's cache, so later processes only read them. A
  // capture uses a known winner, else the model's choice. Collective, like the call.
  using MethodRunner = std::function<void(OverlapMethod method, cudaStream_t stream)>;
  OverlapMethod choose(OverlapMethod requested, OverlapComm comm, int64_t m, int64_t n, int64_t k, bool sequential_ok,
                       cudaStream_t stream, const MethodRunner& run);
  // A dense op's run: check_call before any launch, then run(choose(...), stream).
  void run_call(OverlapMethod requested, OverlapComm comm, int64_t m, int64_t n, int64_t k, bool sequential_ok,
                cudaStream_t stream, const MethodRunner& run) {
    check_call(comm, m, n, k, requested, stream);
    run(choose(requested, comm, m, n, k, sequential_ok, stream, run), stream);
  }

  // The timing behind choose(), for ops with their own candidates and shape classes (the MoE ops):
  // the winner among `candidates` for `shape` (a string naming the op and every size that sets its
  // speed, with overlap_m_bucket(M)), timed now if need be; `fallback` where nothing may be timed (inside a
  // capture with no known winner, TDIST_OVERLAP_TUNE=0, or TDIST_OVERLAP_METHOD set).
  OverlapMethod tune_methods(const std::string& shape, const std::vector<OverlapMethod>& candidates,
                             OverlapMethod fallback, cudaStream_t stream, const MethodRunner& run);

  // Under call checking (World::check_same_call), compares this call with the other ranks'.
  void check_call(OverlapComm comm, int64_t m, int64_t n, int64_t k, OverlapMethod method, cudaStream_t stream) const;

 private:
  std::string shape_class(OverlapComm comm, int64_t m, int64_t n, int64_t k) const;
  // A winner timed earlier for this call's shape class, if any.
  bool tuned_winner(const std::string& shape, OverlapMethod& method) const;

  World& world_;
  SymmetricHeap& heap_;
  DType dtype_;
  int num_sms_ = 0;
  bool fused_ok_ = false;  // tdist's GEMM runs here (sm_90a)
  std::unique_ptr<Collectives> coll_;
  std::unique_ptr<CublasGemm> cublas_;
  SideStream side_;
  OverlapKernels kernels_;
  detail::HookedGemm<kg::AllGatherWaitParams> gather_gemm_;
  detail::HookedGemm<kg::ChunkPublishParams> publish_gemm_;
  bool tune_ = true;
  std::unique_ptr<jit::Autotuner> tuner_;  // created at the first tuning
  mutable std::mutex tuned_mu_;
  std::map<std::string, OverlapMethod> tuned_;  // shape class -> winner
};

}  // namespace tdist::overlap
