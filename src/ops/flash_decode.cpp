// Decode attention, single GPU and sequence-parallel: argument checks, the split model, the typed
// launcher of the kernels in kernels/attention/flash_decode.cuh, and the symmetric LL buffer of the
// distributed merge.
#include "tdist/ops/flash_decode.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <utility>

#include "tdist/common/alignment.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/jit/jit.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/attention/flash_decode.cuh"
#include "tdist/runtime/symmetric_layout.hpp"

namespace tdist {

namespace attn = kernels::attention;
using device::u32;
using device::u64;

int64_t flash_decode_capacity(const FlashDecodeArgs& a) {
  return a.block_table ? a.max_pages * a.page_size : a.page_size;
}

namespace {

// Elements of one dense page (contiguous cache: one sequence's rows) of K or V.
int64_t dense_page_elems(const FlashDecodeArgs& a) { return a.page_size * a.kv_heads * a.head_dim; }

}  // namespace

void check_flash_decode_args(const FlashDecodeArgs& a) {
  TDIST_CHECK_ARG(a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16, "dtype",
                  "expected bf16 or f16 for q, the KV cache and out, got ", to_string(a.dtype));
  TDIST_CHECK_ARG(a.batch > 0 && a.batch <= 65535, "batch", "expected 1..65535 sequences, got ", a.batch);
  TDIST_CHECK_ARG(a.kv_heads > 0, "kv_heads", "expected a positive count, got ", a.kv_heads);
  TDIST_CHECK_ARG(a.q_heads > 0 && a.q_heads % a.kv_heads == 0, "q_heads", "expected a positive multiple of kv_heads (",
                  a.kv_heads, "), got ", a.q_heads);
  TDIST_CHECK_ARG(a.q_heads <= 65535, "q_heads", "expected at most 65535, got ", a.q_heads);
  TDIST_CHECK_ARG(a.head_dim == 64 || a.head_dim == 128 || a.head_dim == 256, "head_dim",
                  "expected 64, 128 or 256, got ", a.head_dim);
  TDIST_CHECK_ARG(std::isfinite(a.softmax_scale) && a.softmax_scale > 0.f, "softmax_scale",
                  "expected a positive finite scale, got ", a.softmax_scale);
  TDIST_CHECK_ARG(std::isfinite(a.softcap) && a.softcap >= 0.f, "softcap",
                  "expected 0 (no cap) or a positive finite cap, got ", a.softcap);
  const struct {
    const void* p;
    const char* name;
  } tensors[] = {{a.q, "q"}, {a.k_cache, "k_cache"}, {a.v_cache, "v_cache"}, {a.out, "out"}};
  for (const auto& t : tensors) {
    if (t.p == nullptr || !is_aligned(t.p, 16))
      detail::throw_at(__FILE__, __LINE__, "invalid argument '", t.name,
                       "': expected a 16-byte aligned device pointer, got ", t.p);
  }
  TDIST_CHECK_ARG(a.seq_lens != nullptr, "seq_lens", "expected device int32[batch], got nullptr");
  TDIST_CHECK_ARG(a.num_pages > 0, "num_pages", "expected a positive page count, got ", a.num_pages);
  if (a.block_table) {
    TDIST_CHECK_ARG(a.page_size >= 1 && a.page_size <= 256, "page_size", "expected 1..256 tokens per page, got ",
                    a.page_size);
    TDIST_CHECK_ARG(a.max_pages > 0, "max_pages", "expected the block table's positive row length, got ", a.max_pages);
  } else {
    TDIST_CHECK_ARG(a.page_size >= 1, "page_size", "expected the contiguous cache's capacity per sequence (>= 1), got ",
                    a.page_size);
    TDIST_CHECK_ARG(a.num_pages == a.batch, "num_pages",
                    "a contiguous cache holds one row of pages per sequence: expected ", a.batch, ", got ",
                    a.num_pages);
  }
  const int64_t capacity = flash_decode_capacity(a);
  TDIST_CHECK_ARG(capacity <= (int64_t{1} << 30), "max_pages",
                  "expected at most 2^30 tokens per sequence (max_pages x page_size), got ", capacity);
  TDIST_CHECK_ARG(a.num_pages * a.page_size <= (int64_t{1} << 40) / a.kv_heads, "num_pages",
                  "the cache is too large to index (", a.num_pages, " pages of ", a.page_size, " tokens)");
  const int64_t page_elems = dense_page_elems(a);
  TDIST_CHECK_ARG(a.page_stride == 0 || (a.page_stride >= page_elems && a.page_stride % 8 == 0 &&
                                         a.page_stride <= (int64_t{1} << 48) / a.num_pages),
                  "page_stride",
                  "expected 0 (dense pages) or a multiple of 8 elements, at least a page (page_size x kv_heads x "
                  "head_dim = ",
                  page_elems, "), with num_pages x page_stride below 2^48, got ", a.page_stride);
  TDIST_CHECK_ARG(a.max_seq_len >= 0 && a.max_seq_len <= capacity, "max_seq_len", "expected 0 (the capacity) to ",
                  capacity, " (the capacity), got ", a.max_seq_len);
}

static_assert(FlashDecodeSplitModel::kTokensPerStep == attn::kDecodeWarps * attn::kDecodeTile,
              "the split model's step is the split kernel's (its warps x their tiles)");

int flash_decode_heads_per_cta(int64_t group) {
  for (int g = attn::kMaxHeadsPerCta; g > 1; --g) {
    if (group % g == 0) return g;
  }
  return 1;
}

namespace {

int64_t piece_tokens(int64_t max_seq_len, int64_t splits) {
  using M = FlashDecodeSplitModel;
  return ((std::max<int64_t>(max_seq_len, 1) + splits - 1) / splits + M::kTokensPerStep - 1) / M::kTokensPerStep *
         M::kTokensPerStep;
}

}  // namespace

double flash_decode_estimate_us(int64_t cta_groups, int64_t head_dim, int64_t max_seq_len, int64_t splits, int num_sms,
                                int ctas_per_sm) {
  using M = FlashDecodeSplitModel;
  splits = flash_decode_nonempty_splits(max_seq_len, splits);
  const double per = static_cast<double>(piece_tokens(max_seq_len, splits));
  const double avg = static_cast<double>(std::max<int64_t>(max_seq_len, 1)) / static_cast<double>(splits);
  const double sms = static_cast<double>(num_sms);
  const auto wave_tokens = [&](int64_t n) {  // the wave's time in tokens at an SM's share of the bandwidth
    const int64_t k = std::min<int64_t>((n + num_sms - 1) / num_sms, ctas_per_sm);
    const double rate =
        static_cast<double>(k) * M::kLoneCtaRate / (1.0 + M::kSharedSmFalloff * static_cast<double>(k - 1));
    const double slowest_sm = per * static_cast<double>(k) / rate, bandwidth = static_cast<double>(n) * avg / sms;
    return std::pow(std::pow(slowest_sm, M::kBoundBlend) + std::pow(bandwidth, M::kBoundBlend), 1.0 / M::kBoundBlend);
  };
  const int64_t slots = static_cast<int64_t>(num_sms) * ctas_per_sm, ctas = cta_groups * splits;
  const int64_t full = ctas / slots, rest = ctas % slots;
  double tokens =
      static_cast<double>(full) * (full > 0 ? wave_tokens(slots) : 0.0) + (rest > 0 ? wave_tokens(rest) : 0.0);
  const double token_us =
      4.0 * static_cast<double>(head_dim) / (M::kSmShareGBps * 1e3);  // K and V rows, 2-byte elements
  double us = tokens * token_us + static_cast<double>(full + (rest > 0 ? 1 : 0)) * M::kWaveStartUs;
  if (splits > 1) {
    const int64_t per_round = attn::combine_batch_splits(static_cast<int>(head_dim));
    us += M::kMergeUs + static_cast<double>((splits + per_round - 1) / per_round) * M::kMergeRoundUs;
  }
  return us;
}

FlashDecodeSplitPlan plan_flash_decode(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t max_seq_len, int num_sms, int ctas_per_sm) {
  TDIST_CHECK_ARG(batch > 0 && kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0, "q_heads",
                  "expected positive batch and heads with q_heads a multiple of kv_heads, got batch ", batch,
                  ", q_heads ", q_heads, ", kv_heads ", kv_heads);
  TDIST_CHECK_ARG(head_dim == 64 || head_dim == 128 || head_dim == 256, "head_dim", "expected 64, 128 or 256, got ",
                  head_dim);
  TDIST_CHECK_ARG(num_sms > 0, "num_sms", "expected a positive SM count, got ", num_sms);
  TDIST_CHECK_ARG(ctas_per_sm > 0, "ctas_per_sm", "expected a positive count, got ", ctas_per_sm);
  TDIST_CHECK_ARG(max_seq_len >= 0, "max_seq_len", "expected >= 0, got ", max_seq_len);
  using M = FlashDecodeSplitModel;
  FlashDecodeSplitPlan plan;
  const int64_t group = q_heads / kv_heads;
  plan.heads_per_cta = flash_decode_heads_per_cta(group);
  plan.head_chunks = static_cast<int>(group / plan.heads_per_cta);
  const int64_t groups = batch * kv_heads * plan.head_chunks;
  // Every split count that leaves no piece empty, up to one step per piece; the first of equal
  // estimates (the fewest splits) wins.
  const int64_t most = std::min<int64_t>(M::kMaxSplits, (max_seq_len + M::kTokensPerStep - 1) / M::kTokensPerStep);
  double best_us = flash_decode_estimate_us(groups, head_dim, max_seq_len, 1, num_sms, ctas_per_sm);
  int last = 1;
  for (int64_t s = 2; s <= most; ++s) {
    const int splits = flash_decode_nonempty_splits(max_seq_len, s);
    if (splits == last) continue;
    last = splits;
    const double us = flash_decode_estimate_us(groups, head_dim, max_seq_len, splits, num_sms, ctas_per_sm);
    if (us < best_us) {
      best_us = us;
      plan.num_splits = splits;
    }
  }
  return plan;
}

int flash_decode_nonempty_splits(int64_t max_seq_len, int64_t splits) {
  using M = FlashDecodeSplitModel;
  // The kernel cuts a sequence into pieces of whole steps: fewer splits may cover max_seq_len (e.g.
  // 32K tokens in 33 splits are 32 pieces of 1024), and a split left empty would still be a CTA and
  // a partial to merge.
  splits = std::clamp<int64_t>(splits, 1, M::kMaxSplits);
  const int64_t per = piece_tokens(max_seq_len, splits);
  return static_cast<int>(std::max<int64_t>(1, (max_seq_len + per - 1) / per));
}

int resident_ctas_per_sm(int regs_per_thread, int threads, size_t smem_bytes, const SmLimits& sm) {
  TDIST_CHECK_ARG(regs_per_thread > 0 && threads > 0, "regs_per_thread",
                  "expected positive registers and threads, got ", regs_per_thread, " and ", threads);
  const int warps = (threads + 31) / 32;
  const int regs_per_warp = (regs_per_thread * 32 + 255) / 256 * 256;
  int n = std::min(sm.max_ctas, sm.max_threads / (warps * 32));
  n = std::min(n, sm.regs / (regs_per_warp * warps));
  if (smem_bytes > 0) n = std::min<int64_t>(n, static_cast<int64_t>(sm.smem / (smem_bytes + sm.smem_reserved_per_cta)));
  return std::max(n, 1);
}

// The kernels of one (dtype, head dim): the split kernel (any heads per CTA) and the combine kernel.
// Instance names are spelled here only.
class FlashDecodeKernels {
 public:
  static std::string split_instance(DType dtype, int head_dim) {
    return detail::concat("tdist::kernels::attention::flash_decode_split<", kernel_type_name(dtype), ", ", head_dim,
                          ">");
  }
  static std::string combine_instance(DType dtype, int head_dim) {
    return detail::concat("tdist::kernels::attention::flash_decode_combine<", kernel_type_name(dtype), ", ", head_dim,
                          ">");
  }
  static jit::CompileRequest compile_request(DType dtype, int head_dim) {
    jit::CompileRequest r;
    r.source = "#include \"tdist/kernels/attention/flash_decode.cuh\"\n";
    r.file_name = "flash_decode.cu";
    r.name_expressions.push_back(split_instance(dtype, head_dim));
    r.name_expressions.push_back(combine_instance(dtype, head_dim));
    return r;
  }

  FlashDecodeKernels(DType dtype, int head_dim)
      : split_smem_(attn::decode_smem_bytes(head_dim, static_cast<int>(dtype_size(dtype)))) {
    const auto compiled = jit::compile(compile_request(dtype, head_dim));
    module_ = jit::Module::load(compiled);
    const std::string name = split_instance(dtype, head_dim);
    split_ = module_->kernel(name);
    resident_ = resident_from_log(compiled->log, compiled->lowered_name(name), split_smem_, current_sm_limits());
    combine_ = module_->kernel(combine_instance(dtype, head_dim));
  }

  // Split CTAs one SM holds at once, from the registers ptxas reported and the shared memory.
  int resident() const { return resident_; }
  // The split kernel's dynamic shared memory (its pipelines).
  size_t split_smem() const { return split_smem_; }

  const jit::Kernel& split() const { return split_; }
  const jit::Kernel& combine() const { return combine_; }

  // Compiled once per process for each (dtype, head dim).
  static const FlashDecodeKernels& get(DType dtype, int head_dim) {
    static std::mutex mu;
    static std::map<std::pair<int, int>, std::unique_ptr<FlashDecodeKernels>> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = cache[{static_cast<int>(dtype), head_dim}];
    if (!slot) slot = std::make_unique<FlashDecodeKernels>(dtype, head_dim);
    return *slot;
  }

 private:
  static SmLimits current_sm_limits() {
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, current_device()));
    SmLimits sm;
    sm.regs = prop.regsPerMultiprocessor;
    sm.max_threads = prop.maxThreadsPerMultiProcessor;
    sm.max_ctas = prop.maxBlocksPerMultiProcessor;
    sm.smem = prop.sharedMemPerMultiprocessor;
    sm.smem_reserved_per_cta = prop.reservedSharedMemPerBlock;
    return sm;
  }

  // ptxas -v: "Compiling entry function '<symbol>' ... Used <R> registers, ... <S> bytes smem" (static
  // shared memory, added to the dynamic).
  static int resident_from_log(const std::string& log, const std::string& symbol, size_t dynamic_smem,
                               const SmLimits& sm) {
    const size_t at = log.find("entry function '" + symbol + "'");
    if (at == std::string::npos) return FlashDecodeSplitModel::kCtasPerSm;
    std::smatch m;
    const std::string rest = log.substr(at, 2000);
    if (!std::regex_search(rest, m, std::regex(R"(Used (\d+) registers[^\n]*?(?:(\d+) bytes smem)?\n)")))
      return FlashDecodeSplitModel::kCtasPerSm;
    const size_t smem = (m[2].matched ? std::stoul(m[2].str()) : 0) + dynamic_smem;
    return resident_ctas_per_sm(std::stoi(m[1].str()), attn::kDecodeThreads, smem, sm);
  }

  size_t split_smem_;
  std::shared_ptr<jit::Module> module_;
  jit::Kernel split_;
  jit::Kernel combine_;
  int resident_ = 0;
};

namespace {

std::vector<jit::CompileRequest> flash_decode_compile_requests() {
  std::vector<jit::CompileRequest> v;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (int d : {64, 128, 256}) v.push_back(FlashDecodeKernels::compile_request(dtype, d));
  return v;
}
TDIST_JIT_REGISTER_KERNELS(flash_decode, flash_decode_compile_requests);

void report_errors(u32* errors) {
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  u32 bits = 0;
  TDIST_CUDA_CHECK(cudaMemcpy(&bits, errors, sizeof(bits), cudaMemcpyDeviceToHost));
  if (bits == 0) return;
  DeviceBuffer::zero_now(errors, sizeof(u32));
  TDIST_CHECK_ARG(!(bits & attn::kErrBlockTable), "block_table",
                  "an entry outside [0, num_pages) was met on the device (its page was skipped)");
  TDIST_CHECK_ARG(!(bits & attn::kErrSeqLen), "seq_lens",
                  "a length outside [0, capacity] was met on the device (it was clamped)");
}

}  // namespace

// State shared by both ops: the split workspace (ordinary memory, grown on demand) and the error bits.
struct FlashDecode::Impl {
  int num_sms = sm_count(current_device());
  DeviceBuffer errors = DeviceBuffer::zeroed(sizeof(u32));
  DeviceBuffer partials;  // o_part f32[items][splits][D], then lse_part f32[items][splits]
  size_t partial_bytes = 0;

  // The split model weighs every split count (a few microseconds of host time): a decode loop calls
  // with one shape, so the last plan is kept.
  std::array<int64_t, 6> last_shape{};
  FlashDecodeSplitPlan last_plan;
  FlashDecodeSplitPlan plan_for(const FlashDecodeArgs& a, int64_t max_len, int resident) {
    const std::array<int64_t, 6> shape{a.batch, a.q_heads, a.kv_heads, a.head_dim, max_len, resident};
    if (shape != last_shape) {
      last_plan = plan_flash_decode(a.batch, a.q_heads, a.kv_heads, a.head_dim, max_len, num_sms, resident);
      last_shape = shape;
    }
    return last_plan;
  }

  // Launches the split kernel and fills the combine parameters (all but the exchange's). With
  // `may_finish` and a plan of one split, the split kernel writes out and lse itself; returns
  // nullopt then: there is nothing to combine.
  std::optional<attn::CombineParams> launch_split(const FlashDecodeArgs& a, cudaStream_t stream,
                                                  const FlashDecodeKernels*& kernels, bool may_finish) {
    check_flash_decode_args(a);
    const int64_t capacity = flash_decode_capacity(a);
    const int64_t max_len = a.max_seq_len > 0 ? a.max_seq_len : capacity;
    const int d = static_cast<int>(a.head_dim);
    kernels = &FlashDecodeKernels::get(a.dtype, d);
    FlashDecodeSplitPlan plan = plan_for(a, max_len, kernels->resident());
    // A fixed split count in place of the model's, for tuning experiments (read at each call: a
    // captured graph keeps the count it was captured with).
    const int64_t forced = env::integer("TDIST_FLASH_DECODE_SPLITS", 0, 0, FlashDecodeSplitModel::kMaxSplits);
    if (forced > 0) plan.num_splits = flash_decode_nonempty_splits(max_len, forced);
    const u64 items = static_cast<u64>(a.batch) * a.q_heads;
    // One split and nothing to exchange: the split's normalised output is the result, which the
    // combine kernel would only copy (a second launch, and the partials written and read again).
    const bool finish = may_finish && plan.num_splits == 1;
    const size_t need = finish ? 0 : items * plan.num_splits * (d + 1) * sizeof(float);
    if (need > partial_bytes) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      TDIST_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
      TDIST_CHECK_ARG(capturing == cudaStreamCaptureStatusNone, "batch", "the split workspace must grow to ", need,
                      " bytes for this shape, which cannot happen during "
                      "stream capture: run the largest shape once before capturing");
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old buffer may still be read
      partials = DeviceBuffer(need);
      partial_bytes = need;
    }

    attn::DecodeParams p{};
    p.q = a.q;
    p.k_cache = a.k_cache;
    p.v_cache = a.v_cache;
    p.block_table = a.block_table;
    p.seq_lens = a.seq_lens;
    p.o_part = partials.get<float>();
    p.lse_part = p.o_part ? p.o_part + items * plan.num_splits * d : nullptr;
    p.out = finish ? a.out : nullptr;
    p.lse = finish ? a.lse : nullptr;
    p.errors = errors.get<u32>();
    p.num_pages = static_cast<u64>(a.block_table ? a.num_pages : a.batch);
    p.page_size = static_cast<u32>(a.page_size);
    p.page_stride = static_cast<u64>(a.page_stride > 0 ? a.page_stride : dense_page_elems(a));
    p.max_pages = static_cast<u32>(a.block_table ? a.max_pages : 1);
    p.capacity = static_cast<u32>(capacity);
    p.q_heads = static_cast<u32>(a.q_heads);
    p.kv_heads = static_cast<u32>(a.kv_heads);
    p.group = static_cast<u32>(a.q_heads / a.kv_heads);
    p.heads = static_cast<u32>(plan.heads_per_cta);
    p.head_chunks = static_cast<u32>(plan.head_chunks);
    p.num_splits = static_cast<u32>(plan.num_splits);
    p.first_wave_ctas =
        static_cast<u32>(std::min<int64_t>(static_cast<int64_t>(kernels->resident()) * num_sms, UINT32_MAX));
    p.softmax_scale = a.softmax_scale;
    p.scale_log2 = a.softmax_scale * attn::kLog2e;
    p.softcap = a.softcap;
    p.cap_in = a.softcap > 0.f ? a.softmax_scale / a.softcap : 0.f;
    p.cap_out = a.softcap * attn::kLog2e;

    jit::LaunchConfig cfg;
    cfg.grid = {static_cast<unsigned>(a.kv_heads * plan.head_chunks), static_cast<unsigned>(plan.num_splits),
                static_cast<unsigned>(a.batch)};
    cfg.block = {static_cast<unsigned>(attn::kDecodeThreads)};
    cfg.shared_bytes = kernels->split_smem();
    cfg.stream = stream;
    cfg.programmatic_dependent_launch = true;  // the kernel waits for the one before it on the device
    jit::launch(kernels->split(), cfg, jit::make_args(p));
    if (finish) return std::nullopt;

    attn::CombineParams c{};
    c.o_part = p.o_part;
    c.lse_part = p.lse_part;
    c.out = a.out;
    c.lse = a.lse;
    c.items = static_cast<u32>(items);
    c.max_items = static_cast<u32>(items);
    c.num_splits = p.num_splits;
    return c;
  }

  // Whether the one-rank combine runs a CTA per item: while the warp-per-item grid would leave SMs
  // without a CTA (items <= 4 x SMs: batch 1, say) and there are splits enough for two a warp. Its
  // warps share the item's splits, so that their loads spread over more SMs (with 2 to 4 splits the
  // larger grid cost more than it saved: 0.5-1.5 % at batch 8-12). With the exchange, always a warp.
  bool combine_cta_per_item(u64 items, u32 num_splits) const {
    constexpr u32 kWarps = attn::kCombineThreads / 32;
    return num_splits >= 2 * kWarps && items <= static_cast<u64>(num_sms) * kWarps;
  }
  // The combine kernel's grid: a CTA per item (c.cta_per_item), or a warp per item, at most what stays
  // resident (4 CTAs per SM; with the exchange a waiting CTA must not hold back another's pushes).
  jit::LaunchConfig combine_config(const attn::CombineParams& c, cudaStream_t stream) const {
    constexpr u64 kWarps = attn::kCombineThreads / 32;
    jit::LaunchConfig cfg;
    cfg.grid = {static_cast<unsigned>(
        c.cta_per_item ? c.items : std::min<u64>((c.items + kWarps - 1) / kWarps, static_cast<u64>(num_sms) * 4))};
    cfg.block = {static_cast<unsigned>(attn::kCombineThreads)};
    cfg.stream = stream;
    cfg.programmatic_dependent_launch = true;  // scheduled as the split kernel ends; waits for it on the device
    return cfg;
  }
};

FlashDecode::FlashDecode() : impl_(std::make_unique<Impl>()) {}
FlashDecode::~FlashDecode() = default;

void FlashDecode::run(const FlashDecodeArgs& a, cudaStream_t stream) {
  TDIST_NVTX_RANGE("tdist::flash_decode", "batch=", a.batch, " heads=", a.q_heads, "/", a.kv_heads, " d=", a.head_dim);
  const FlashDecodeKernels* kernels = nullptr;
  std::optional<attn::CombineParams> c = impl_->launch_split(a, stream, kernels, /*may_finish=*/true);
  if (!c) return;
  c->cta_per_item = impl_->combine_cta_per_item(c->items, c->num_splits);
  jit::launch(kernels->combine(), impl_->combine_config(*c, stream), jit::make_args(*c));
}

void FlashDecode::check_errors() { report_errors(impl_->errors.get<u32>()); }

namespace {

// The distributed merge's symmetric buffer.
struct DecodeExchangeLayout {
  SymmetricLayout layout;
  // u64[2][world][max_items][head_dim + 1]: LL lines {f32 bits, epoch} of each rank's merged item
  // (its output, then its log2-sum), parity = epoch & 1.
  SymmetricLayout::Region<u64> ll;
  DecodeExchangeLayout(const DistributedFlashDecodeConfig& c, int world)
      : ll(layout.add<u64>(2 * static_cast<size_t>(world) * static_cast<size_t>(c.max_batch * c.q_heads) *
                               static_cast<size_t>(c.head_dim + 1),
                           "flash_decode ll")) {}
};

}  // namespace

namespace {

void check_config(const DistributedFlashDecodeConfig& c) {
  TDIST_CHECK_ARG(c.max_batch > 0 && c.max_batch <= 65535, "config.max_batch", "expected 1..65535, got ", c.max_batch);
  TDIST_CHECK_ARG(c.q_heads > 0 && c.q_heads <= 65535, "config.q_heads", "expected 1..65535, got ", c.q_heads);
  TDIST_CHECK_ARG(c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256, "config.head_dim",
                  "expected 64, 128 or 256, got ", c.head_dim);
}

// Every rank must be a load/store peer: the merge stores into, and reads from, peers' buffers.
void check_view(const device::SymmetricHeapView& v) {
  TDIST_CHECK_ARG(v.num_ranks >= 1 && v.rank >= 0 && v.rank < v.num_ranks, "heap",
                  "expected a rank in [0, world), got rank ", v.rank, " of ", v.num_ranks);
  TDIST_CHECK_ARG(v.lsa_size == v.num_ranks && v.lsa_rank == v.rank && v.num_ranks <= device::kMaxLsaRanks, "world",
                  "the merge exchanges through load/store peers: every rank must be in one LSA team (", v.lsa_size,
                  " of ", v.num_ranks, ")");
  for (int r = 0; r < v.num_ranks; ++r)
    TDIST_CHECK_ARG(v.lsa_bases[r] != nullptr, "heap", "rank ", r, "'s buffer is not mapped here");
}

}  // namespace

struct DistributedFlashDecode::Impl {
  device::SymmetricHeapView view;
  DistributedFlashDecodeConfig config;
  DecodeExchangeLayout layout;
  SymmetricBlock block;  // empty over a caller's buffer
  u64* ll = nullptr;
  FlashDecode::Impl local;
  DeviceBuffer epoch = DeviceBuffer::zeroed(sizeof(kernels::coll::EpochState));  // this rank's call count

  Impl(World& w, SymmetricHeap& h, const DistributedFlashDecodeConfig& c)
      : view(h.view()),
        config(c),
        layout(c, w.world_size()),
        block(h, layout.layout, "tdist's distributed flash-decode exchange"),
        ll(block[layout.ll]) {}
  Impl(const device::SymmetricHeapView& v, void* buffer, const DistributedFlashDecodeConfig& c)
      : view(v), config(c), layout(c, v.num_ranks), ll(layout.ll.at(buffer)) {}
};

size_t DistributedFlashDecode::heap_bytes(const DistributedFlashDecodeConfig& config, int world_size) {
  return DecodeExchangeLayout(config, world_size).layout.bytes();
}

DistributedFlashDecode::DistributedFlashDecode(World& world, SymmetricHeap& heap,
                                               const DistributedFlashDecodeConfig& config) {
  check_config(config);
  check_view(heap.view());
  impl_ = std::make_unique<Impl>(world, heap, config);
}

DistributedFlashDecode::DistributedFlashDecode(const device::SymmetricHeapView& heap, void* buffer,
                                               const DistributedFlashDecodeConfig& config) {
  check_config(config);
  check_view(heap);
  TDIST_CHECK_ARG(buffer != nullptr && heap.local_base() == static_cast<char*>(buffer), "buffer",
                  "expected the local buffer, mapped at heap.lsa_bases[rank]");
  impl_ = std::make_unique<Impl>(heap, buffer, config);
}

DistributedFlashDecode::~DistributedFlashDecode() {
  cudaDeviceSynchronize();  // peers' lines may still be landing in the buffer
}

void DistributedFlashDecode::run(const FlashDecodeArgs& a, cudaStream_t stream) {
  TDIST_NVTX_RANGE("tdist::distributed_flash_decode", "batch=", a.batch, " heads=", a.q_heads, "/", a.kv_heads,
                   " d=", a.head_dim, " ranks=", impl_->view.num_ranks);
  const auto& cfg = impl_->config;
  TDIST_CHECK_ARG(a.batch > 0 && a.batch <= cfg.max_batch, "batch", "expected 1..", cfg.max_batch,
                  " (config.max_batch), got ", a.batch);
  TDIST_CHECK_ARG(a.q_heads == cfg.q_heads, "q_heads", "expected config.q_heads = ", cfg.q_heads, ", got ", a.q_heads);
  TDIST_CHECK_ARG(a.head_dim == cfg.head_dim, "head_dim", "expected config.head_dim = ", cfg.head_dim, ", got ",
                  a.head_dim);
  const FlashDecodeKernels* kernels = nullptr;
  attn::CombineParams c = *impl_->local.launch_split(a, stream, kernels, /*may_finish=*/false);
  c.heap = impl_->view;
  c.ll = impl_->ll;
  c.epoch = impl_->epoch.get<kernels::coll::EpochState>();
  c.max_items = static_cast<u32>(cfg.max_batch * cfg.q_heads);
  jit::launch(kernels->combine(), impl_->local.combine_config(c, stream), jit::make_args(c));  // a warp per item
}

void DistributedFlashDecode::check_errors() { report_errors(impl_->local.errors.get<u32>()); }

}  // namespace tdist
