// tdist::Collectives: AllGather, ReduceScatter, AllReduce and a stream barrier over the ranks of one
// NVLink domain (the LSA team), on symmetric memory. docs/collectives.md has the protocols, the
// methods and how the automatic choice is made.
//
//   tdist::World world;
//   tdist::SymmetricHeap heap(world, 4ull << 30);
//   tdist::Collectives coll(world, heap, 256 << 20);   // collective; owns workspace and flags
//   coll.all_reduce(d_in, d_out, count, tdist::DType::kBFloat16, stream);          // method by size
//   coll.all_gather(d_in, d_out, count_per_rank, tdist::DType::kFloat16, stream, tdist::AllGatherMethod::kCePush);
//
// Every call is stream-ordered, does no host synchronisation and can be captured in a CUDA graph
// (the call count that orders the flags lives in device memory). Every rank must make the same
// sequence of calls (same op, count, dtype and method) on streams ordered the same way; calls of
// one context must not run concurrently on two streams.
//
// Buffers: ordinary device memory works for every method (staged through the context's workspace
// inside the kernel). When `in` (or `out`) lies in `heap` it is used in place (zero copy), and must
// then be the same symmetric buffer on every rank. In place: all_reduce(in == out),
// all_gather(in == out + rank * count), reduce_scatter(out == in + rank * count).
//
// Method `auto`: on the first call of a size class (op, dtype, ranks, buffer kinds, in place or not,
// 16-byte alignment, size within a quarter octave) outside graph capture, every feasible method,
// NCCL included, is timed on scratch buffers of the call's kind, then the call runs with the fastest;
// later calls of the class look it up. The caller's data is never touched by the timing. Under
// capture, with TDIST_COLLECTIVE_TUNE=0 or above 1 GiB the table decides (docs/collectives.md).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <memory>
#include <vector>

#include "tdist/jit/launch.hpp"
#include "tdist/kernels/collectives/common.cuh"
#include "tdist/ops/collective_methods.hpp"
#include "tdist/ops/detail/collective_select.hpp"  // CollectiveShape, CollectiveLimits
#include "tdist/runtime/stream.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/symmetric_layout.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

namespace detail {
struct CollectiveTuner;  // the timed winners of `auto` (collectives.cpp)
}

struct CollectivesOptions {
  // Low-latency payload per rank (bytes): the largest AllReduce buffer, AllGather input or
  // ReduceScatter output (per rank) the LL methods can run. The LL buffer takes 4 x world x ll_bytes
  // per rank (two parities, 8-byte lines of 4 data bytes).
  size_t ll_bytes = 256 * 1024;
  // LL128 payload per rank (bytes): the largest AllReduce buffer the ll128 method can run. The
  // LL128 buffer takes 2 x world x (ll128_bytes / 120, rounded up) x 128 bytes per rank.
  size_t ll128_bytes = 1024 * 1024;
  // Blocks of the SM kernels at most; 0: the GPU's SM count. (ll128 runs smaller blocks: up to
  // kLl128BlocksPerSm of them for each of these.)
  int max_blocks = 0;
  // Launch the SM kernels with programmatic dependent launch: a call's kernel is scheduled while
  // the kernel before it on the stream finishes and waits on the GPU for it to end, which takes the
  // launch latency (about 1 us) off back-to-back small collectives. Off: plain stream order.
  bool programmatic_launch = true;
  // What fault messages call the context's buffers (SymmetricHeap::name_block).
  std::string owner = "tdist's collectives";
};

class Collectives {
 public:
  // Collective over `world`. `max_bytes`: the largest buffer an op stages (AllReduce buffer,
  // AllGather output, ReduceScatter input); allocates 2 * max_bytes of workspace from `heap`, plus
  // flags, barrier pads and the LL and LL128 buffers. Compiles (or loads from the JIT cache) every
  // kernel.
  Collectives(World& world, SymmetricHeap& heap, size_t max_bytes, const CollectivesOptions& options = {});
  ~Collectives();
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;

  // out[i] = sum over ranks of in[i], count elements; fp32 accumulation.
  void all_reduce(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                  AllReduceMethod method = AllReduceMethod::kAuto);
  // out[r * count, +count) = rank r's in[0, count).
  void all_gather(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                  AllGatherMethod method = AllGatherMethod::kAuto);
  // out[0, count) = sum over ranks of their in[rank * count, +count); in holds world_size * count.
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                      ReduceScatterMethod method = ReduceScatterMethod::kAuto);
  // Work after it on `stream` (on every rank) starts after work before it on every rank's stream.
  void barrier(cudaStream_t stream);

  // The method a call with these arguments would run (resolves auto and the environment override;
  // throws as the call would on an infeasible explicit method). For auto: the timed winner of the
  // call's size class once a call has timed it, the table's pick before (it times nothing).
  AllReduceMethod all_reduce_method(const void* in, void* out, size_t count, DType dtype,
                                    AllReduceMethod method = AllReduceMethod::kAuto) const;
  AllGatherMethod all_gather_method(const void* in, void* out, size_t count, DType dtype,
                                    AllGatherMethod method = AllGatherMethod::kAuto) const;
  ReduceScatterMethod reduce_scatter_method(const void* in, void* out, size_t count, DType dtype,
                                            ReduceScatterMethod method = ReduceScatterMethod::kAuto) const;

  // The symmetric-heap bytes a Collectives(world, heap, max_bytes, options) allocates on a GPU with
  // `num_sms` SMs (each allocation rounded to the heap's alignment), for sizing the heap.
  static size_t heap_bytes(int world_size, size_t max_bytes, int num_sms, const CollectivesOptions& options = {});

  // As the *_method() queries, but first times the call's size class when auto would time it and
  // has not yet (collective, like the call; outside graph capture): the method the call will run,
  // without running it. Reads and writes nothing of `in` / `out`. For warming up the sizes of a
  // program before capturing it in a graph, or before timing it.
  AllReduceMethod tune_all_reduce(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                                  AllReduceMethod method = AllReduceMethod::kAuto);
  AllGatherMethod tune_all_gather(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                                  AllGatherMethod method = AllGatherMethod::kAuto);
  ReduceScatterMethod tune_reduce_scatter(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                                          ReduceScatterMethod method = ReduceScatterMethod::kAuto);

  // Whether auto times new size classes (TDIST_COLLECTIVE_TUNE, default on).
  bool tuning() const;
  // Size classes whose winner this context has timed or loaded (those left to the table excluded).
  size_t tuned_classes() const;

  size_t max_bytes() const { return max_bytes_; }
  CollectiveLimits limits() const { return {max_bytes_, ll_bytes_, ll128_bytes_}; }
  World& world() const { return world_; }
  SymmetricHeap& heap() const { return heap_; }

 private:
  struct Kernels;
  // One call as the method choice sees it: buffers, element count and dtype, shape, in-place flag.
  struct Call {
    CollectiveOp op;
    const void* in;
    size_t in_bytes;
    void* out;
    size_t out_bytes;
    size_t count;  // the op's count argument
    DType dtype;
    bool in_place;
    CollectiveShape shape;
  };
  // Argument checks and the call's shape (throw as the ops do).
  Call all_reduce_call(const void* in, void* out, size_t count, DType dtype) const;
  Call all_gather_call(const void* in, void* out, size_t count, DType dtype) const;
  Call reduce_scatter_call(const void* in, void* out, size_t count, DType dtype) const;
  // Times every candidate of `cls` on scratch buffers shaped like `call`'s and returns the winner
  // (the method's enum value), or -1 when the table must decide (capture, no scratch to be had).
  // Collective: every rank calls it for the same class at the same call.
  int tune_class(const Call& call, const CollectiveClass& cls, cudaStream_t stream);
  CollectiveShape shape(size_t bytes, DType dtype, const void* in, size_t in_bytes, const void* out, size_t out_bytes,
                        size_t stride_bytes) const;
  kernels::coll::CollParams params(const void* in, void* out, size_t count, bool zero_copy, bool vec) const;
  void launch(const jit::Kernel& k, unsigned blocks, const kernels::coll::CollParams& p, cudaStream_t stream,
              unsigned threads = kernels::coll::kThreads);
  void ce_barrier(cudaStream_t stream);
  // A device-to-device copy on the side stream after what `stream` has so far; side_.join(stream)
  // makes `stream` wait for it.
  void copy_beside(void* dst, const void* src, size_t bytes, cudaStream_t stream);
  // ceil(bytes / per_block) blocks, at least 1, at most blocks_per_sm x max_blocks_.
  unsigned blocks_for(size_t bytes, size_t per_block, int blocks_per_sm = 1) const;

  World& world_;
  SymmetricHeap& heap_;
  size_t max_bytes_;
  size_t ll_bytes_;
  size_t ll128_bytes_;
  int max_blocks_;
  bool programmatic_launch_;
  SymmetricBlock block_;                 // every symmetric buffer below (CollectivesLayout, collectives.cpp)
  char* workspace_ = nullptr;            // 2 slots of max_bytes_
  device::u64* flags_ = nullptr;         // kPhases x max_blocks x world_size
  device::u64* barrier_pads_ = nullptr;  // [0]: barrier(), [1]: copy-engine phases
  // Copy-engine ReduceScatter: halving pieces, the smallest at least kCePieceBytes, at most kCePieces
  // of them; ce_flags_[piece * world_size + src] = 1 once rank src's piece has landed here (symmetric).
  static constexpr size_t kCePieceBytes = size_t{4} << 20;
  static constexpr size_t kCePieces = 16;
  device::u64* ce_flags_ = nullptr;
  char* ll_ = nullptr;                          // 2 x world_size x ll_words
  char* ll128_ = nullptr;                       // 2 x world_size x ll128 lines (ll128.cuh)
  kernels::coll::EpochState* epoch_ = nullptr;  // ordinary device memory
  // Copies that run beside the caller's stream (forked from it and joined back within one call).
  SideStream side_;
  std::unique_ptr<Kernels> kernels_;
  std::unique_ptr<detail::CollectiveTuner> tuner_;
};

// JIT compile requests of every collective kernel (registered for tdist-compile --all).
std::vector<jit::CompileRequest> collective_compile_requests();

}  // namespace tdist
