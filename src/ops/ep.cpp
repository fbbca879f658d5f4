// Host side of tdist::EpBuffer: the symmetric layout, the typed kernel launcher, argument checks and
// launches. The protocol: include/tdist/kernels/ep/ll.cuh and docs/ep.md.
#include "tdist/ops/ep.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "tdist/common/alignment.hpp"
#include "tdist/common/checked.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/ep/ht.cuh"
#include "tdist/kernels/ep/ll.cuh"

namespace tdist {

using device::u32;
using device::u64;
using kernels::ep::EpHtParams;
using kernels::ep::EpLlParams;
using kernels::ep::EpState;

namespace {

size_t mul(size_t a, size_t b) { return checked_mul<size_t>(a, b, "an EP buffer size"); }

// The symmetric buffers of the low-latency mode, for W ranks (one allocation; this one description
// gives ep_heap_bytes() and the constructor's addresses). Meaning of each: kernels/ep/ll.cuh.
//   d_rows   char[2][L][W][M][2H]     d_scales f32[2][L][W][M][G]    d_route i32[2][L][W][M]
//   d_count  u64[2][L][W]             d_ack    u64[E]
//   c_rows   char[2][M][K][2H]        c_flags  u64[2][M][K]          c_ack   u64[W]
struct EpLlLayout {
  SymmetricLayout layout;
  SymmetricLayout::Region<char> d_rows, c_rows;
  SymmetricLayout::Region<float> d_scales;
  SymmetricLayout::Region<int> d_route;
  SymmetricLayout::Region<u64> d_count, d_ack, c_flags, c_ack;

  EpLlLayout(const EpConfig& c, int world) {
    const size_t W = static_cast<size_t>(world), L = static_cast<size_t>(c.num_experts) / W;
    const size_t M = static_cast<size_t>(c.max_tokens), H = static_cast<size_t>(c.hidden);
    const size_t K = static_cast<size_t>(c.topk), G = static_cast<size_t>(kernels::ep::scale_groups(c.hidden));
    const size_t d_slots = mul(mul(2 * L, W), M), c_slots = mul(2 * M, K);
    d_rows = layout.add<char>(mul(d_slots, 2 * H), "EP dispatch rows");
    d_scales = layout.add<float>(mul(d_slots, G), "EP dispatch scales");
    d_route = layout.add<int>(d_slots, "EP dispatch routes");
    d_count = layout.add<u64>(2 * L * W, "EP dispatch count flags");
    d_ack = layout.add<u64>(static_cast<size_t>(c.num_experts), "EP dispatch acknowledgements");
    c_rows = layout.add<char>(mul(c_slots, 2 * H), "EP combine rows");
    c_flags = layout.add<u64>(c_slots, "EP combine row flags");
    c_ack = layout.add<u64>(W, "EP combine acknowledgements");
  }
};

// The symmetric buffers of the high-throughput mode (meaning of each: kernels/ep/ht.cuh).
//   counts u64[2][W][W + E]   recv_x char[W M][2H]   recv_src i32[W M]
//   recv_idx i32[W M][K]      recv_w f32[W M][K]     recv_pos i32[W M][K]   done u64[W]
//   comb char[W][M][2H]       c_ready u64[W]         c_done u64[W]
struct EpHtLayout {
  SymmetricLayout layout;
  SymmetricLayout::Region<u64> counts, done, c_ready, c_done;
  SymmetricLayout::Region<char> recv_x, comb;
  SymmetricLayout::Region<int> recv_src, recv_idx, recv_pos;
  SymmetricLayout::Region<float> recv_w;

  EpHtLayout(const EpConfig& c, int world) {
    const size_t W = static_cast<size_t>(world), E = static_cast<size_t>(c.num_experts);
    const size_t M = static_cast<size_t>(c.max_tokens), H = static_cast<size_t>(c.hidden);
    const size_t K = static_cast<size_t>(c.topk), R = mul(W, M);
    counts = layout.add<u64>(mul(2 * W, W + E), "EP layout counts");
    recv_x = layout.add<char>(mul(R, 2 * H), "EP compact rows");
    recv_src = layout.add<int>(R, "EP compact sources");
    recv_idx = layout.add<int>(mul(R, K), "EP compact top-k ids");
    recv_w = layout.add<float>(mul(R, K), "EP compact top-k weights");
    recv_pos = layout.add<int>(mul(R, K), "EP compact expert rows");
    done = layout.add<u64>(W, "EP dispatch done flags");
    comb = layout.add<char>(mul(R, 2 * H), "EP combine partial rows");
    c_ready = layout.add<u64>(W, "EP combine ready flags");
    c_done = layout.add<u64>(W, "EP combine done flags");
  }
};

// Expert-major rows of the high-throughput output at most: every received token at min(K, L) local
// experts, plus the padding of every expert.
int64_t ht_expert_rows(const EpConfig& c, int world) {
  const int64_t L = c.num_experts / world;
  return static_cast<int64_t>(world) * c.max_tokens * std::min<int64_t>(c.topk, L) + L * (c.expert_alignment - 1);
}

// The local (ordinary) memory of one output slot: recv_x [L][W M][2H bytes at most],
// recv_scales f32[L][W M][G], recv_route i32[L][W M], recv_count i32[L], own_row i32[M][K].
struct EpSlotBuffers {
  DeviceBuffer recv_x, recv_scales, recv_route, recv_count, own_row;
};

// The low-latency kernels, each named once here; one module (one header). kDispatch and kCombine
// run a whole call in one grid (no receive hook); the send/receive pairs serve the hooks.
enum class LlKernel { kDispatchSend, kDispatchRecv, kCombineSend, kCombineRecv, kDispatch, kCombine, kCount };

constexpr const char* kLlSymbols[] = {
    "tdist::kernels::ep::ep_ll_dispatch_send", "tdist::kernels::ep::ep_ll_dispatch_recv",
    "tdist::kernels::ep::ep_ll_combine_send",  "tdist::kernels::ep::ep_ll_combine_recv",
    "tdist::kernels::ep::ep_ll_dispatch",      "tdist::kernels::ep::ep_ll_combine",
};

enum class HtKernel { kLayout, kDispatch, kDispatchRecv, kCombineSend, kCombineRecv, kCount };

constexpr const char* kHtSymbols[] = {
    "tdist::kernels::ep::ep_ht_layout",       "tdist::kernels::ep::ep_ht_dispatch",
    "tdist::kernels::ep::ep_ht_dispatch_recv", "tdist::kernels::ep::ep_ht_combine_send",
    "tdist::kernels::ep::ep_ht_combine_recv",
};

jit::CompileRequest ht_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/ep/ht.cuh\"\n";
  r.file_name = "ep_ht.cu";
  for (const char* s : kHtSymbols) r.name_expressions.push_back(s);
  return r;
}

jit::CompileRequest ll_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/ep/ll.cuh\"\n";
  r.file_name = "ep_ll.cu";
  for (const char* s : kLlSymbols) r.name_expressions.push_back(s);
  return r;
}

std::vector<jit::CompileRequest> ep_compile_requests() { return {ll_request(), ht_request()}; }

}  // namespace

TDIST_JIT_REGISTER_KERNELS(ep, ep_compile_requests);

void check_ep_config(const EpConfig& c, int world_size) {
  TDIST_CHECK_ARG(world_size >= 1 && world_size <= device::kMaxLsaRanks, "world_size", "1 to ",
                  device::kMaxLsaRanks, " ranks in one NVLink domain, got ", world_size);
  TDIST_CHECK_ARG(c.max_tokens >= 1 && c.max_tokens <= (1 << 20), "config.max_tokens", "1 to 2^20, got ",
                  c.max_tokens);
  TDIST_CHECK_ARG(c.hidden >= 8 && c.hidden % 8 == 0 && c.hidden <= (1 << 20), "config.hidden",
                  "a multiple of 8 (16-byte bf16 rows) from 8 to 2^20, got ", c.hidden);
  TDIST_CHECK_ARG(c.num_experts >= world_size && c.num_experts % world_size == 0, "config.num_experts",
                  "a positive multiple of the world size ", world_size, ", got ", c.num_experts);
  TDIST_CHECK_ARG(c.topk >= 1 && c.topk <= kernels::ep::kMaxTopk && c.topk <= c.num_experts, "config.topk", "1 to ",
                  kernels::ep::kMaxTopk, " and at most num_experts (", c.num_experts, "), got ", c.topk);
  TDIST_CHECK_ARG(c.num_sms >= 0, "config.num_sms", "0 (the mode's default) or a positive count, got ", c.num_sms);
  TDIST_CHECK_ARG(c.mode == EpMode::kLowLatency || c.mode == EpMode::kHighThroughput, "config.mode",
                  "kLowLatency or kHighThroughput");
  TDIST_CHECK_ARG(c.expert_alignment >= 1 && c.expert_alignment <= 4096, "config.expert_alignment", "1 to 4096, got ",
                  c.expert_alignment);
  // The layout step keeps a count per rank and expert in shared memory.
  TDIST_CHECK_ARG(c.mode != EpMode::kHighThroughput || world_size + c.num_experts <= 8192, "config.num_experts",
                  "world_size + num_experts <= 8192 in high-throughput mode, got ", world_size + c.num_experts);
  if (c.mode == EpMode::kHighThroughput)
    TDIST_CHECK_ARG(ht_expert_rows(c, world_size) * c.hidden * 2 < (int64_t{1} << 40) &&
                        ht_expert_rows(c, world_size) < (int64_t{1} << 31),
                    "config.max_tokens", "an expert-major output below 2^31 rows and 1 TiB, got ",
                    ht_expert_rows(c, world_size), " rows");
  // Routes pack (src * M + t) * K + j into an int.
  TDIST_CHECK_ARG(static_cast<int64_t>(world_size) * c.max_tokens * c.topk < (int64_t{1} << 31), "config.max_tokens",
                  "world_size * max_tokens * topk below 2^31, got ", world_size, " * ", c.max_tokens, " * ", c.topk);
}

size_t ep_heap_bytes(const EpConfig& config, int world_size) {
  check_ep_config(config, world_size);
  if (config.mode == EpMode::kHighThroughput) return EpHtLayout(config, world_size).layout.bytes();
  return EpLlLayout(config, world_size).layout.bytes();
}

EpTokenCounts ep_count_tokens(const int64_t* topk_idx, int64_t num_tokens, int topk, int num_experts,
                              int world_size) {
  TDIST_CHECK_ARG(num_tokens >= 0 && (num_tokens == 0 || topk_idx != nullptr), "topk_idx",
                  "a host array of num_tokens x topk ids");
  TDIST_CHECK_ARG(topk >= 1, "topk", "at least 1, got ", topk);
  TDIST_CHECK_ARG(world_size >= 1 && num_experts >= world_size && num_experts % world_size == 0, "num_experts",
                  "a positive multiple of world_size ", world_size, ", got ", num_experts);
  const int L = num_experts / world_size;
  EpTokenCounts c{std::vector<int>(static_cast<size_t>(world_size)), std::vector<int>(static_cast<size_t>(num_experts))};
  auto sent = [&](const int64_t* row, int j) {
    if (row[j] < 0 || row[j] >= num_experts) return false;
    for (int k = 0; k < j; ++k)
      if (row[k] == row[j]) return false;
    return true;
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t* row = topk_idx + t * topk;
    std::vector<bool> to_rank(static_cast<size_t>(world_size), false);
    for (int j = 0; j < topk; ++j) {
      if (!sent(row, j)) continue;
      ++c.rows_per_expert[static_cast<size_t>(row[j])];
      to_rank[static_cast<size_t>(row[j] / L)] = true;
    }
    for (int r = 0; r < world_size; ++r) c.tokens_per_rank[static_cast<size_t>(r)] += to_rank[static_cast<size_t>(r)];
  }
  return c;
}

std::vector<int> ep_expert_offsets(const std::vector<int>& rows, int alignment) {
  TDIST_CHECK_ARG(alignment >= 1, "alignment", "at least 1, got ", alignment);
  std::vector<int> off(rows.size() + 1, 0);
  for (size_t e = 0; e < rows.size(); ++e) {
    TDIST_CHECK_ARG(rows[e] >= 0, "rows", "non-negative counts, got ", rows[e], " at ", e);
    off[e + 1] = off[e] + (rows[e] + alignment - 1) / alignment * alignment;
  }
  return off;
}

struct EpBuffer::Impl {
  SymmetricBlock block;
  DeviceBuffer state, error;
  // Low latency
  EpLlParams base{};  // the symmetric and state fields, filled once
  DeviceBuffer send_counts, epoch_slots;
  std::array<EpSlotBuffers, kSlots> slots;
  std::shared_ptr<jit::Module> module;
  std::array<jit::Kernel, static_cast<size_t>(LlKernel::kCount)> kernels;
  uint64_t dispatch_calls = 0, combine_calls = 0;
  // High throughput: local buffers send_base i32[W], exp_base i32[E], rank_ctr u32[W], exp_ctr u32[E],
  // info i32[3 + 2L], expert_x bf16[X][H], expert_src i32[X] (ht.cuh)
  EpHtParams ht{};
  DeviceBuffer send_base, exp_base, rank_ctr, exp_ctr, info, expert_x, expert_src;
  std::shared_ptr<jit::Module> ht_module;
  std::array<jit::Kernel, static_cast<size_t>(HtKernel::kCount)> ht_kernels;
  uint64_t ht_calls = 0;

  const jit::Kernel& get(LlKernel k) const { return kernels[static_cast<size_t>(k)]; }
  const jit::Kernel& get(HtKernel k) const { return ht_kernels[static_cast<size_t>(k)]; }
  u64* epoch_slot(int slot, int which) const { return epoch_slots.get<u64>() + 2 * slot + which; }
};

namespace {

// The fields both protocols' kernel parameters share (EpHtParams and EpLlParams name them alike).
template <class Params>
void set_common_params(Params& p, const SymmetricHeap& heap, const EpConfig& c, int num_local_experts,
                       EpState* state, int* error) {
  p.heap = heap.view();
  p.max_tokens = static_cast<int>(c.max_tokens);
  p.hidden = static_cast<int>(c.hidden);
  p.num_experts = c.num_experts;
  p.num_local_experts = num_local_experts;
  p.topk = c.topk;
  p.state = state;
  p.error = error;
}

// The checks ll_dispatch and ht_dispatch share (EpLlDispatchArgs and EpHtDispatchArgs name them alike).
template <class Args>
void check_dispatch_common(const Args& a, const EpConfig& c) {
  TDIST_CHECK_ARG(a.x_dtype == DType::kBFloat16, "x_dtype", "bf16, got ", to_string(a.x_dtype));
  TDIST_CHECK_ARG(a.hidden == -1 || a.hidden == c.hidden, "hidden", "the buffer's hidden size ", c.hidden, ", got ",
                  a.hidden);
  TDIST_CHECK_ARG(a.topk == -1 || a.topk == c.topk, "topk", "the buffer's topk ", c.topk, ", got ", a.topk);
  TDIST_CHECK_ARG(a.num_tokens >= 0 && a.num_tokens <= c.max_tokens, "num_tokens", "0 to max_tokens (", c.max_tokens,
                  "), got ", a.num_tokens);
}

}  // namespace

EpBuffer::EpBuffer(World& world, SymmetricHeap& heap, const EpConfig& config)
    : world_(world), heap_(heap), config_(config), world_size_(world.world_size()) {
  check_ep_config(config, world_size_);
  TDIST_CHECK(world.lsa_size() == world_size_, "EpBuffer needs every rank in one NVLink (LSA) domain; the LSA team has ",
              world.lsa_size(), " of ", world_size_, " ranks");
  all_sms_ = sm_count(world.device());
  const bool ht = config.mode == EpMode::kHighThroughput;
  // Low latency takes every SM (latency); high throughput leaves SMs to the computation it overlaps.
  sms_ = config.num_sms > 0 ? std::min(config.num_sms, all_sms_) : (ht ? std::min(24, all_sms_) : all_sms_);
  impl_ = std::make_unique<Impl>();
  Impl& m = *impl_;
  const size_t W = static_cast<size_t>(world_size_), L = static_cast<size_t>(num_local_experts());
  const size_t E = static_cast<size_t>(config.num_experts), H = static_cast<size_t>(config.hidden);
  m.state = DeviceBuffer::zeroed(sizeof(EpState));
  m.error = DeviceBuffer::zeroed(4 * sizeof(int));
  if (ht) {
    const EpHtLayout layout(config, world_size_);
    m.block = SymmetricBlock(heap, layout.layout, "tdist's EP buffer (high-throughput dispatch and combine)");
    const size_t X = static_cast<size_t>(ht_expert_rows(config, world_size_));
    m.send_base = DeviceBuffer::zeroed(W * sizeof(int));
    m.exp_base = DeviceBuffer::zeroed(E * sizeof(int));
    m.rank_ctr = DeviceBuffer::zeroed(W * sizeof(u32));
    m.exp_ctr = DeviceBuffer::zeroed(E * sizeof(u32));
    m.info = DeviceBuffer::zeroed((3 + 2 * L) * sizeof(int));
    m.expert_x = DeviceBuffer(mul(X, 2 * H));
    m.expert_src = DeviceBuffer(X * sizeof(int));
    EpHtParams& p = m.ht;
    set_common_params(p, heap, config, num_local_experts(), m.state.get<EpState>(), m.error.get<int>());
    p.alignment = config.expert_alignment;
    p.counts = m.block[layout.counts];
    p.recv_x = m.block[layout.recv_x];
    p.recv_src = m.block[layout.recv_src];
    p.recv_idx = m.block[layout.recv_idx];
    p.recv_w = m.block[layout.recv_w];
    p.recv_pos = m.block[layout.recv_pos];
    p.done = m.block[layout.done];
    p.comb = m.block[layout.comb];
    p.c_ready = m.block[layout.c_ready];
    p.c_done = m.block[layout.c_done];
    p.send_base = m.send_base.get<int>();
    p.exp_base = m.exp_base.get<int>();
    p.rank_ctr = m.rank_ctr.get<u32>();
    p.exp_ctr = m.exp_ctr.get<u32>();
    p.info = m.info.get<int>();
    p.expert_x = m.expert_x.get<char>();
    p.expert_src = m.expert_src.get<int>();
    m.ht_module = jit::Module::load(jit::compile(ht_request()));
    for (size_t k = 0; k < m.ht_kernels.size(); ++k) m.ht_kernels[k] = m.ht_module->kernel(kHtSymbols[k]);
  } else {
    const EpLlLayout layout(config, world_size_);
    m.block = SymmetricBlock(heap, layout.layout, "tdist's EP buffer (low-latency dispatch and combine)");
    const size_t rows = L * static_cast<size_t>(recv_rows_per_expert());
    const size_t G = static_cast<size_t>(kernels::ep::scale_groups(config.hidden));
    m.send_counts = DeviceBuffer::zeroed(sizeof(u32) * E);
    m.epoch_slots = DeviceBuffer::zeroed(sizeof(u64) * 2 * kSlots);
    for (EpSlotBuffers& s : m.slots) {
      s.recv_x = DeviceBuffer(mul(rows, 2 * H));
      s.recv_scales = DeviceBuffer(mul(rows, G) * sizeof(float));
      s.recv_route = DeviceBuffer(rows * sizeof(int));
      s.recv_count = DeviceBuffer::zeroed(L * sizeof(int));
      s.own_row =
          DeviceBuffer(mul(static_cast<size_t>(config.max_tokens), static_cast<size_t>(config.topk)) * sizeof(int));
    }
    EpLlParams& p = m.base;
    set_common_params(p, heap, config, num_local_experts(), m.state.get<EpState>(), m.error.get<int>());
    p.d_rows = m.block[layout.d_rows];
    p.d_scales = m.block[layout.d_scales];
    p.d_route = m.block[layout.d_route];
    p.d_count = m.block[layout.d_count];
    p.d_ack = m.block[layout.d_ack];
    p.c_rows = m.block[layout.c_rows];
    p.c_flags = m.block[layout.c_flags];
    p.c_ack = m.block[layout.c_ack];
    p.send_counts = m.send_counts.get<u32>();
    m.module = jit::Module::load(jit::compile(ll_request()));
    for (size_t k = 0; k < m.kernels.size(); ++k) m.kernels[k] = m.module->kernel(kLlSymbols[k]);
  }
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  world.barrier("tdist ep buffer ready");
}

EpBuffer::~EpBuffer() {
  cudaDeviceSynchronize();  // the symmetric block goes back to the heap after this
}

void EpBuffer::check_dispatch(const EpLlDispatchArgs& a) const {
  TDIST_CHECK_ARG(config_.mode == EpMode::kLowLatency, "config.mode", "a low-latency buffer for ll_dispatch");
  check_dispatch_common(a, config_);
  TDIST_CHECK_ARG(!a.fp8 || config_.hidden % kernels::ep::kFp8GroupSize == 0, "fp8",
                  "a hidden size that is a multiple of 128 (one scale per 128 channels), got ", config_.hidden);
  TDIST_CHECK_ARG(!a.ue8m0 || a.fp8, "ue8m0", "fp8 dispatch (UE8M0 scales are FP8 scales)");
  if (a.num_tokens > 0) {
    TDIST_CHECK_ARG(a.x != nullptr && is_aligned(a.x, 16), "x", "a 16-byte aligned device pointer");
    TDIST_CHECK_ARG(a.topk_idx != nullptr && is_aligned(a.topk_idx, 8), "topk_idx", "an 8-byte aligned device pointer");
  }
}

void EpBuffer::check_combine(const EpLlCombineArgs& a, const EpLlHandle& h) const {
  TDIST_CHECK_ARG(config_.mode == EpMode::kLowLatency, "config.mode", "a low-latency buffer for ll_combine");
  TDIST_CHECK_ARG(a.y_dtype == DType::kBFloat16, "y_dtype", "bf16, got ", to_string(a.y_dtype));
  TDIST_CHECK_ARG(h.slot >= 0 && h.slot < kSlots && h.recv_count != nullptr &&
                      h.recv_count == impl_->slots[static_cast<size_t>(h.slot)].recv_count.get<int>() &&
                      h.own_row == impl_->slots[static_cast<size_t>(h.slot)].own_row.get<int>(),
                  "handle", "a handle returned by this buffer's ll_dispatch");
  TDIST_CHECK_ARG(a.y != nullptr && is_aligned(a.y, 16), "y", "a 16-byte aligned device pointer");
  if (h.num_tokens > 0) {
    TDIST_CHECK_ARG(a.topk_idx != nullptr && is_aligned(a.topk_idx, 8), "topk_idx", "an 8-byte aligned device pointer");
    TDIST_CHECK_ARG(a.topk_weights != nullptr && is_aligned(a.topk_weights, 4), "topk_weights",
                    "a 4-byte aligned device pointer");
    TDIST_CHECK_ARG(a.out != nullptr && is_aligned(a.out, 16), "out", "a 16-byte aligned device pointer");
  }
}

namespace {

// One launch path for both protocols; a grid is never empty (a rank with no tokens still takes part).
template <class Params>
void launch_ep(const jit::Kernel& k, unsigned blocks, unsigned threads, size_t smem, const Params& p,
               cudaStream_t stream) {
  jit::LaunchConfig cfg;
  cfg.grid = {std::max(blocks, 1u)};
  cfg.block = {threads};
  cfg.shared_bytes = smem;
  cfg.stream = stream;
  cfg.programmatic_dependent_launch = true;  // every EP kernel waits for the one before it first (begin_kernel)
  jit::launch(k, cfg, jit::make_args(p));
}

void launch_ll(const jit::Kernel& k, unsigned blocks, const EpLlParams& p, cudaStream_t stream) {
  launch_ep(k, blocks, static_cast<unsigned>(kernels::ep::kLlThreads), 0, p, stream);
}

// The grid of a kernel that runs both parts of a low-latency call: enough blocks for either part,
// never more than one per SM (the receiving blocks spin on flags the sending blocks of the same grid
// raise, so every block must be resident at once; __launch_bounds__(kLlThreads, 1) makes one fit).
unsigned fused_blocks(unsigned send_blocks, unsigned recv_blocks, int sms) {
  return std::clamp(std::max(send_blocks, recv_blocks), 1u, static_cast<unsigned>(std::max(sms, 1)));
}

unsigned warp_blocks(int64_t warps, int cap) {
  const int64_t b = (warps + kernels::ep::kLlWarps - 1) / kernels::ep::kLlWarps;
  return static_cast<unsigned>(std::clamp<int64_t>(b, 1, cap));
}

}  // namespace

EpLlHandle EpBuffer::ll_dispatch(const EpLlDispatchArgs& a, cudaStream_t stream) {
  check_dispatch(a);
  TDIST_NVTX_RANGE("tdist::EpBuffer::ll_dispatch", "tokens=", a.num_tokens, a.fp8 ? " fp8" : " bf16");
  Impl& m = *impl_;
  const int slot = static_cast<int>(m.dispatch_calls++ % kSlots);
  EpSlotBuffers& out = m.slots[static_cast<size_t>(slot)];
  EpLlParams p = m.base;
  p.num_tokens = static_cast<int>(a.num_tokens);
  p.fp8 = a.fp8 ? 1 : 0;
  p.ue8m0 = a.ue8m0 ? 1 : 0;
  p.x = a.x;
  p.topk_idx = reinterpret_cast<const long long*>(a.topk_idx);
  p.epoch_slot = m.epoch_slot(slot, 0);
  p.recv_x = out.recv_x.get<char>();
  p.recv_scales = out.recv_scales.get<float>();
  p.recv_route = out.recv_route.get<int>();
  p.recv_count = out.recv_count.get<int>();
  p.own_row = out.own_row.get<int>();

  EpLlHandle h;
  h.slot = slot;
  h.num_tokens = a.num_tokens;
  h.fp8 = a.fp8;
  h.recv_x = p.recv_x;
  h.recv_scales = p.recv_scales;
  h.recv_count = p.recv_count;
  h.recv_route = p.recv_route;
  h.own_row = p.own_row;
  // Sends: a block per token, every SM (or num_sms) busy even for a few hundred tokens. Receives: a
  // block per local expert.
  const unsigned send_blocks = static_cast<unsigned>(std::clamp<int64_t>(a.num_tokens, 1, sms_));
  const unsigned recv_blocks = static_cast<unsigned>(std::min(num_local_experts(), all_sms_));
  if (!a.return_hook) {
    // One grid for both parts; its blocks wait on each other, so it never exceeds one block per SM.
    launch_ll(m.get(LlKernel::kDispatch), fused_blocks(send_blocks, recv_blocks, all_sms_), p, stream);
    return h;
  }
  launch_ll(m.get(LlKernel::kDispatchSend), send_blocks, p, stream);
  h.hook = [this, p, recv_blocks](cudaStream_t s) {
    launch_ll(impl_->get(LlKernel::kDispatchRecv), recv_blocks, p, s);
  };
  return h;
}

std::function<void(cudaStream_t)> EpBuffer::ll_combine(const EpLlCombineArgs& a, const EpLlHandle& h,
                                                       cudaStream_t stream) {
  check_combine(a, h);
  TDIST_NVTX_RANGE("tdist::EpBuffer::ll_combine", "tokens=", h.num_tokens);
  Impl& m = *impl_;
  const int slot = static_cast<int>(m.combine_calls++ % kSlots);
  EpLlParams p = m.base;
  p.num_tokens = static_cast<int>(h.num_tokens);
  p.topk_idx = reinterpret_cast<const long long*>(a.topk_idx);
  p.topk_weights = a.topk_weights;
  p.y = a.y;
  p.out = a.out;
  p.epoch_slot = m.epoch_slot(slot, 1);
  p.recv_route = h.recv_route;
  p.recv_count = h.recv_count;
  p.own_row = h.own_row;
  const unsigned send_blocks = static_cast<unsigned>(sms_);
  const unsigned recv_blocks = static_cast<unsigned>(std::clamp<int64_t>(h.num_tokens, 1, all_sms_));
  if (!a.return_hook) {
    launch_ll(m.get(LlKernel::kCombine), fused_blocks(send_blocks, recv_blocks, all_sms_), p, stream);
    return {};
  }
  launch_ll(m.get(LlKernel::kCombineSend), send_blocks, p, stream);
  return [this, p, recv_blocks](cudaStream_t s) { launch_ll(impl_->get(LlKernel::kCombineRecv), recv_blocks, p, s); };
}

void EpBuffer::check_ht_dispatch(const EpHtDispatchArgs& a) const {
  TDIST_CHECK_ARG(config_.mode == EpMode::kHighThroughput, "config.mode", "a high-throughput buffer for ht_dispatch");
  check_dispatch_common(a, config_);
  if (a.num_tokens > 0) {
    TDIST_CHECK_ARG(a.x != nullptr && is_aligned(a.x, 16), "x", "a 16-byte aligned device pointer");
    TDIST_CHECK_ARG(a.topk_idx != nullptr && is_aligned(a.topk_idx, 8), "topk_idx", "an 8-byte aligned device pointer");
    TDIST_CHECK_ARG(a.topk_weights != nullptr && is_aligned(a.topk_weights, 4), "topk_weights",
                    "a 4-byte aligned device pointer");
  }
}

void EpBuffer::check_ht_combine(const EpHtCombineArgs& a, const EpHtHandle& h) const {
  TDIST_CHECK_ARG(config_.mode == EpMode::kHighThroughput, "config.mode", "a high-throughput buffer for ht_combine");
  TDIST_CHECK_ARG(a.y_dtype == DType::kBFloat16, "y_dtype", "bf16, got ", to_string(a.y_dtype));
  TDIST_CHECK_ARG(h.call != 0 && h.call == impl_->ht_calls && h.info == impl_->info.get<int>(), "handle",
                  "the handle of this buffer's latest ht_dispatch (a dispatch's outputs live until the next one)");
  TDIST_CHECK_ARG((a.y != nullptr) != (a.y_compact != nullptr), "y",
                  "exactly one of y (expert-major) and y_compact (compact rows)");
  TDIST_CHECK_ARG(a.y == nullptr || is_aligned(a.y, 16), "y", "a 16-byte aligned device pointer");
  TDIST_CHECK_ARG(a.y_compact == nullptr || is_aligned(a.y_compact, 16), "y_compact", "a 16-byte aligned device pointer");
  if (h.num_tokens > 0) {
    TDIST_CHECK_ARG(a.topk_idx != nullptr && is_aligned(a.topk_idx, 8), "topk_idx", "an 8-byte aligned device pointer");
    TDIST_CHECK_ARG(a.out != nullptr && is_aligned(a.out, 16), "out", "a 16-byte aligned device pointer");
  }
}

EpHtHandle EpBuffer::ht_dispatch(const EpHtDispatchArgs& a, cudaStream_t stream) {
  check_ht_dispatch(a);
  TDIST_NVTX_RANGE("tdist::EpBuffer::ht_dispatch", "tokens=", a.num_tokens);
  Impl& m = *impl_;
  EpHtParams p = m.ht;
  p.num_tokens = static_cast<int>(a.num_tokens);
  p.x = a.x;
  p.topk_idx = reinterpret_cast<const long long*>(a.topk_idx);
  p.topk_weights = a.topk_weights;
  const size_t smem = sizeof(int) * static_cast<size_t>(world_size_ + config_.num_experts);
  // The layout step counts with many blocks (a warp handles a few tokens; the last block lays out).
  const int64_t layout_warps = (a.num_tokens + 3) / 4, layout_block_warps = kernels::ep::kHtLayoutThreads / 32;
  const unsigned layout_blocks =
      static_cast<unsigned>(std::clamp<int64_t>((layout_warps + layout_block_warps - 1) / layout_block_warps, 1, sms_));
  launch_ep(m.get(HtKernel::kLayout), layout_blocks, kernels::ep::kHtLayoutThreads, smem, p, stream);
  // The dispatch's senders take num_sms blocks (they feed NVLink); the blocks that place this rank's
  // own tokens (HBM-bound, beside the transfer) take the other SMs, a quarter of them at least.
  const unsigned send_blocks = warp_blocks(a.num_tokens, sms_);
  const unsigned local_blocks =
      warp_blocks(a.num_tokens, std::max({all_sms_ - static_cast<int>(send_blocks), all_sms_ / 4, 1}));
  p.send_blocks = static_cast<int>(send_blocks);
  launch_ep(m.get(HtKernel::kDispatch), send_blocks + local_blocks, kernels::ep::kHtThreads, 0, p, stream);
  launch_ep(m.get(HtKernel::kDispatchRecv), static_cast<unsigned>(all_sms_), kernels::ep::kHtThreads, 0, p, stream);

  EpHtHandle h;
  h.call = ++m.ht_calls;
  h.num_tokens = a.num_tokens;
  h.recv_x = p.recv_x;
  h.recv_src = p.recv_src;
  h.recv_topk_idx = p.recv_idx;
  h.recv_topk_weights = p.recv_w;
  h.recv_expert_row = p.recv_pos;
  h.expert_x = p.expert_x;
  h.expert_src = p.expert_src;
  h.info = p.info;
  h.max_recv_rows = static_cast<int64_t>(world_size_) * config_.max_tokens;
  h.max_expert_rows = ht_expert_rows(config_, world_size_);
  if (a.sync_counts) {
    const int L = num_local_experts();
    std::vector<int> info(static_cast<size_t>(3 + 2 * L));
    TDIST_CUDA_CHECK(cudaMemcpyAsync(info.data(), p.info, info.size() * sizeof(int), cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    h.num_recv = info[0];
    h.num_expert_rows = info[1];
    h.expert_counts.assign(info.begin() + 2, info.begin() + 2 + L);
    h.expert_offsets.assign(info.begin() + 2 + L, info.end());
  }
  return h;
}

void EpBuffer::ht_combine(const EpHtCombineArgs& a, const EpHtHandle& h, cudaStream_t stream) {
  check_ht_combine(a, h);
  TDIST_NVTX_RANGE("tdist::EpBuffer::ht_combine", "tokens=", h.num_tokens);
  Impl& m = *impl_;
  EpHtParams p = m.ht;
  p.num_tokens = static_cast<int>(h.num_tokens);
  p.topk_idx = reinterpret_cast<const long long*>(a.topk_idx);
  p.y = a.y;
  p.y_compact = a.y_compact;
  p.out = a.out;
  // The combine send reads every expert-major row once (K rows per token at most, far more bytes than
  // it sends), so by default it takes every SM, as the receives do; num_sms, when set, bounds it.
  const int send_sms = config_.num_sms > 0 ? sms_ : all_sms_;
  launch_ep(m.get(HtKernel::kCombineSend), static_cast<unsigned>(send_sms), kernels::ep::kHtThreads, 0, p, stream);
  launch_ep(m.get(HtKernel::kCombineRecv), warp_blocks(h.num_tokens, all_sms_), kernels::ep::kHtThreads, 0, p,
            stream);
}

EpDeviceError EpBuffer::device_error(cudaStream_t stream) {
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  int host[4];
  TDIST_CUDA_CHECK(cudaMemcpy(host, impl_->error.get(), sizeof(host), cudaMemcpyDeviceToHost));
  DeviceBuffer::zero_now(impl_->error.get(), sizeof(host));  // landed before the next call's kernels
  return EpDeviceError{host[0], host[1], host[2], host[3]};
}

void EpBuffer::check_errors(cudaStream_t stream) {
  const EpDeviceError e = device_error(stream);
  if (e.code == kernels::ep::kEpExpertOutOfRange)
    TDIST_CHECK_ARG(false, "topk_idx", "expert ids in [-1, ", config_.num_experts, "); token ", e.token, " slot ",
                    e.slot, " holds ", e.value, " (that row was skipped)");
  if (e.code == kernels::ep::kEpDuplicateExpert)
    TDIST_CHECK_ARG(false, "topk_idx", "distinct experts within a token; token ", e.token, " slot ", e.slot,
                    " repeats expert ", e.value, " (that row was skipped)");
  TDIST_CHECK(e.code == 0, "EpBuffer: unknown device error code ", e.code);
}

}  // namespace tdist
