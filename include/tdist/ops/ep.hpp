// tdist::EpBuffer: expert-parallel all-to-all for MoE layers (dispatch tokens to the ranks that hold
// their top-k experts, combine the experts' outputs back into one weighted sum per token), over the
// ranks of one NVLink domain. docs/ep.md has the protocol, the layouts and how inter-node would work.
//
//   tdist::EpConfig cfg{.max_tokens = 128, .hidden = 7168, .num_experts = 256, .topk = 8};
//   tdist::EpBuffer ep(world, heap, cfg);                 // collective; owns its symmetric buffers
//   tdist::EpLlHandle h = ep.ll_dispatch({.x = x, .topk_idx = idx, .num_tokens = t, .fp8 = true}, stream);
//   // expert GEMMs on h.recv_x [L][W * M][H] (e4m3) with h.recv_scales, h.recv_count[L] rows each
//   ep.ll_combine({.y = y, .topk_idx = idx, .topk_weights = w, .out = out}, h, stream);
//
// High-throughput mode (EpConfig::mode = kHighThroughput, thousands of tokens): a layout step on the
// GPU counts tokens per rank and expert and exchanges the counts, the dispatch sends each token once
// per destination rank, the receiver lays the rows out both compact and expert-major (padded per
// expert); the combine reduces locally with the weights, then sends one row per token and rank:
//   tdist::EpHtHandle h = ep.ht_dispatch({.x = x, .topk_idx = idx, .topk_weights = w, .num_tokens = t}, s);
//   ep.ht_combine({.y = expert_out, .topk_idx = idx, .out = out}, h, s);
//
// Low-latency mode: every call is stream-ordered, does no host synchronisation and can be captured
// in a CUDA graph and replayed with fresh routing (the call counts that order the flags live in
// device memory). Every rank makes the same sequence of calls. At most two dispatches (and two
// combines) may be in flight between a send and its receive (the receive hook); a dispatch's outputs
// stay valid until the dispatch two calls later.
//
// Errors: host checks (sizes, dtypes, alignment, counts) throw tdist::Error naming the argument
// before anything is launched. Expert ids outside [-1, num_experts) and repeats of an expert within
// one token are skipped by dispatch and combine alike and recorded on the device; check_errors()
// (synchronising) reports the first one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "tdist/common/device_buffer.hpp"
#include "tdist/common/dtype.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/symmetric_layout.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

// Which buffers an EpBuffer holds (each mode's are sized for its own batches; see docs/ep.md).
enum class EpMode { kLowLatency, kHighThroughput };

struct EpConfig {
  int64_t max_tokens = 128;  // tokens per rank and call, at most
  int64_t hidden = 7168;     // channels per token (a multiple of 8; of 128 for FP8 dispatch)
  int num_experts = 256;     // a multiple of the world size
  int topk = 8;              // 1 .. 32
  // Blocks of the send kernels; 0: every SM (low latency), 24 (high throughput). A low-latency call
  // without a hook runs send and receive in one grid of up to one block per SM (enough for either).
  int num_sms = 0;
  EpMode mode = EpMode::kLowLatency;
  int expert_alignment = 128;  // high throughput: rows of each expert in the expert-major output padded to it
};

// Throws naming the field when `config` cannot serve `world_size` ranks.
void check_ep_config(const EpConfig& config, int world_size);

// The symmetric bytes per rank that an EpBuffer of `config` takes on `world_size` ranks.
size_t ep_heap_bytes(const EpConfig& config, int world_size);

// The layout step's counts computed on the host, by the rule the kernels apply (a slot is sent
// when its id is in [0, num_experts) and no earlier slot of its token holds the same id): tokens
// this rank sends to each rank (a token counts once per rank) and rows it sends to each expert.
struct EpTokenCounts {
  std::vector<int> tokens_per_rank;   // [world_size]
  std::vector<int> rows_per_expert;   // [num_experts]
};
EpTokenCounts ep_count_tokens(const int64_t* topk_idx, int64_t num_tokens, int topk, int num_experts,
                              int world_size);
// The first expert-major row of each expert when expert e holds rows[e] rows padded to `alignment`,
// and the end: [rows.size() + 1].
std::vector<int> ep_expert_offsets(const std::vector<int>& rows, int alignment);

struct EpLlDispatchArgs {
  const void* x = nullptr;               // [num_tokens][hidden], 16-byte aligned
  const int64_t* topk_idx = nullptr;     // [num_tokens][topk]; -1 masks a slot
  int64_t num_tokens = 0;                // 0 .. max_tokens
  int64_t hidden = -1;                   // -1: the config's; else must equal it
  int topk = -1;                         // -1: the config's; else must equal it
  DType x_dtype = DType::kBFloat16;      // only bf16
  bool fp8 = false;                      // send e4m3 with one fp32 scale per 128 channels
  bool ue8m0 = false;                    // FP8 scales rounded up to powers of two
  bool return_hook = false;              // launch only the sends; the handle's hook receives
};

// What a dispatch returns and its combine takes. The pointers are the buffer's own memory for the
// handle's slot, valid until the dispatch two calls later.
struct EpLlHandle {
  int slot = 0;
  int64_t num_tokens = 0;
  bool fp8 = false;
  void* recv_x = nullptr;        // [L][W * max_tokens][hidden] bf16, or e4m3 bytes when fp8
  float* recv_scales = nullptr;  // [L][W * max_tokens][hidden / 128] when fp8
  int* recv_count = nullptr;     // [L] rows received per local expert (rows of an expert: 0 .. count)
  int* recv_route = nullptr;     // [L][W * max_tokens] (src_rank * max_tokens + token) * topk + slot
  int* own_row = nullptr;        // [num_tokens][topk] for the combine: where this rank's own rows are
  // Rows of an expert: this rank's own first, then the peers'; the order is not part of the contract
  // (recv_route names each row). Set when the dispatch was called with return_hook: `hook` launches
  // the receive on `stream`; after it (in stream order) the outputs above hold this dispatch's rows.
  // The send already writes into them (this rank's own rows).
  std::function<void(cudaStream_t)> hook;
};

struct EpLlCombineArgs {
  const void* y = nullptr;             // [L][W * max_tokens][hidden] bf16 expert outputs, rows as recv_x
  const int64_t* topk_idx = nullptr;   // the dispatch's [num_tokens][topk]
  const float* topk_weights = nullptr;  // [num_tokens][topk]
  void* out = nullptr;                 // [num_tokens][hidden] bf16: sum over valid j of w[t][j] * y(t, j)
  DType y_dtype = DType::kBFloat16;    // only bf16
  bool return_hook = false;            // launch only the sends; the returned hook sums into out
};

// Fields of the device error word: code (0: none, 1: expert id out of range, 2: repeated expert in a
// token), token, top-k slot, the offending id.
struct EpDeviceError {
  int code = 0, token = 0, slot = 0, value = 0;
};

struct EpHtDispatchArgs {
  const void* x = nullptr;                // [num_tokens][hidden] bf16, 16-byte aligned
  const int64_t* topk_idx = nullptr;      // [num_tokens][topk]; -1 masks a slot
  const float* topk_weights = nullptr;    // [num_tokens][topk]
  int64_t num_tokens = 0;                 // 0 .. max_tokens
  int64_t hidden = -1;                    // -1: the config's; else must equal it
  int topk = -1;                          // -1: the config's; else must equal it
  DType x_dtype = DType::kBFloat16;       // only bf16
  // Synchronise the stream and copy the counts into the handle's host fields. Off (the
  // worst-case-bound mode): no host synchronisation, the counts stay on the device (`info`) and the
  // call can be captured in a CUDA graph.
  bool sync_counts = false;
};

// What a high-throughput dispatch returns and its combine takes; valid until the next HT dispatch.
// Buffers are sized for the worst case: R = W * max_tokens compact rows, and
// X = W * max_tokens * min(topk, L) + L * (expert_alignment - 1) expert-major rows.
struct EpHtHandle {
  uint64_t call = 0;  // the dispatch's number on this buffer
  int64_t num_tokens = 0;
  // Compact output: one row per received token, source rank after source rank.
  void* recv_x = nullptr;                // [R][hidden] bf16
  int* recv_src = nullptr;               // [R] src_rank * max_tokens + token
  int* recv_topk_idx = nullptr;          // [R][topk] local expert, -1 when the slot's expert is elsewhere
  float* recv_topk_weights = nullptr;    // [R][topk]
  int* recv_expert_row = nullptr;        // [R][topk] the slot's expert-major row, -1 elsewhere
  // Expert-major output: local expert le's rows at [offset[le], offset[le] + count[le]), then padding
  // to expert_alignment (expert_src = -1 there).
  void* expert_x = nullptr;              // [X][hidden] bf16
  int* expert_src = nullptr;             // [X] compact row of each expert-major row, -1 for padding
  // Device counts: [0] compact rows received, [1] expert-major rows (padded), [2, 2 + L) rows of each
  // local expert, [2 + L, 3 + 2L) first expert-major row of each local expert, then the end.
  int* info = nullptr;
  int64_t max_recv_rows = 0, max_expert_rows = 0;
  // With sync_counts: the counts on the host; else -1 and empty.
  int64_t num_recv = -1, num_expert_rows = -1;
  std::vector<int> expert_counts, expert_offsets;
};

struct EpHtCombineArgs {
  // Either the expert outputs in the dispatch's expert-major layout (each compact row's local slots
  // summed with their weights on this rank first), or compact rows [R][hidden] sent as they are
  // (dispatch's backward: the gradient of a token is the sum of its copies' gradients).
  const void* y = nullptr;
  const void* y_compact = nullptr;
  const int64_t* topk_idx = nullptr;  // the dispatch's [num_tokens][topk]
  void* out = nullptr;                // [num_tokens][hidden] bf16: the sum over the ranks the token went to
  DType y_dtype = DType::kBFloat16;   // only bf16
};

class EpBuffer {
 public:
  static constexpr int kSlots = 2;

  // Collective over `world`; every rank in one NVLink (LSA) domain.
  EpBuffer(World& world, SymmetricHeap& heap, const EpConfig& config);
  ~EpBuffer();
  EpBuffer(const EpBuffer&) = delete;
  EpBuffer& operator=(const EpBuffer&) = delete;

  const EpConfig& config() const { return config_; }
  int num_local_experts() const { return config_.num_experts / world_size_; }
  int64_t recv_rows_per_expert() const { return config_.max_tokens * world_size_; }

  EpLlHandle ll_dispatch(const EpLlDispatchArgs& args, cudaStream_t stream);
  // Returns the receive hook when args.return_hook, else an empty function.
  std::function<void(cudaStream_t)> ll_combine(const EpLlCombineArgs& args, const EpLlHandle& handle,
                                               cudaStream_t stream);

  // High throughput (config.mode == kHighThroughput): layout step, dispatch and its receive.
  EpHtHandle ht_dispatch(const EpHtDispatchArgs& args, cudaStream_t stream);
  void ht_combine(const EpHtCombineArgs& args, const EpHtHandle& handle, cudaStream_t stream);

  // Host-side argument checks of the calls above (what they run first); throw naming the argument.
  void check_dispatch(const EpLlDispatchArgs& args) const;
  void check_combine(const EpLlCombineArgs& args, const EpLlHandle& handle) const;
  void check_ht_dispatch(const EpHtDispatchArgs& args) const;
  void check_ht_combine(const EpHtCombineArgs& args, const EpHtHandle& handle) const;

  // Synchronises `stream`, reads the device error word and clears it.
  EpDeviceError device_error(cudaStream_t stream);
  // Throws tdist::Error naming topk_idx when the device error word is set (and clears it).
  void check_errors(cudaStream_t stream);

 private:
  struct Kernels;
  struct Impl;
  World& world_;
  SymmetricHeap& heap_;
  EpConfig config_;
  int world_size_ = 0;
  int sms_ = 0;     // blocks of the send kernels
  int all_sms_ = 0;  // the GPU's SMs
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist
