// The catalogue of overlapped ops (ops/overlap_ops.hpp): the registry each op's file adds its traits
// to, the checks every call shares, and the context cache with its growth policy.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/error.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"  // RowChunks
#include "tdist/ops/detail/overlap_registry.hpp"
#include "tdist/ops/overlap_ops.hpp"
#include "tdist/runtime/stream.hpp"

namespace tdist {

namespace {

std::vector<const OverlapOpTraits*>& registry() {
  static std::vector<const OverlapOpTraits*> ops;
  return ops;
}

constexpr int64_t kExtentLimit = int64_t{1} << 31;  // the GEMM's 32-bit tile coordinates

}  // namespace

detail::OverlapOpRegistrar::OverlapOpRegistrar(const OverlapOpTraits& (*traits)()) {
  const OverlapOpTraits& t = traits();
  auto& ops = registry();
  for (const OverlapOpTraits* o : ops) {
    if (std::string(o->name) == t.name) {
      std::fprintf(stderr, "tdist: two overlapped ops are registered as '%s'\n", t.name);
      std::abort();
    }
  }
  if (t.num_operands() > kMaxOverlapOperands || t.operands.empty() || !t.heap_bytes || !t.create || t.n_multiple < 8) {
    std::fprintf(stderr, "tdist: the overlapped op '%s' has an invalid description\n", t.name);
    std::abort();
  }
  ops.push_back(&t);
  std::sort(ops.begin(), ops.end(),
            [](const OverlapOpTraits* a, const OverlapOpTraits* b) { return std::string(a->name) < b->name; });
}

const std::vector<const OverlapOpTraits*>& overlap_ops() { return registry(); }

const OverlapOpTraits& find_overlap_op(const std::string& name, const char* what) {
  std::string known;
  for (const OverlapOpTraits* o : registry()) {
    if (name == o->name) return *o;
    known += known.empty() ? "" : ", ";
    known += o->name;
  }
  TDIST_FAIL("invalid argument '", what, "': no overlapped op is named '", name, "' (known: ", known, ")");
}

int OverlapOpTraits::operand_index(const std::string& operand) const {
  for (int i = 0; i < num_operands(); ++i)
    if (operand == operands[i].name) return i;
  return -1;
}

const char* to_string(Extent e) {
  switch (e) {
    case Extent::kM: return "M";
    case Extent::kRows: return "rows";
    case Extent::kN: return "N";
    case Extent::kHalfN: return "N/2";
    case Extent::kK: return "K";
  }
  return "?";
}

int64_t OverlapExtents::operator[](Extent e) const {
  switch (e) {
    case Extent::kM: return m;
    case Extent::kRows: return rows;
    case Extent::kN: return n;
    case Extent::kHalfN: return n / 2;
    case Extent::kK: return k;
  }
  return 0;
}

OverlapExtents overlap_extents(int64_t m, int64_t n, int64_t k, int world_size, int rank) {
  TDIST_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size, "rank", "expected 0 <= rank < ", world_size,
                  ", got ", rank);
  TDIST_CHECK_ARG(m >= 0 && m < kExtentLimit, "m", "expected 0 <= m < 2^31, got ", m);
  const kernels::gemm::RowChunks chunks{static_cast<uint64_t>(m), world_size};
  return {m, static_cast<int64_t>(chunks.rows(rank)), n, k};
}

void check_overlap_call(const OverlapOpTraits& op, DType dtype, const OverlapCall& call, int world_size, int rank) {
  TDIST_CHECK_ARG(dtype == DType::kBFloat16 || dtype == DType::kFloat16, "dtype", "tdist.", op.name,
                  " takes bf16 or fp16, got ", to_string(dtype));
  const OverlapExtents e = overlap_extents(call.m, call.n, call.k, world_size, rank);
  TDIST_CHECK_ARG(call.n > 0 && call.n % op.n_multiple == 0 && call.n < kExtentLimit, "n", "tdist.", op.name,
                  ": expected N a positive multiple of ", op.n_multiple, " below 2^31, got ", call.n);
  TDIST_CHECK_ARG(call.k > 0 && call.k % 8 == 0 && call.k < kExtentLimit, "k", "tdist.", op.name,
                  ": expected K a positive multiple of 8 (16-byte rows) below 2^31, got ", call.k);
  for (int i = 0; i < op.num_operands(); ++i) {
    const OperandTraits& t = op.operands[i];
    const void* p = call.operands[i];
    if (e[t.rows] == 0 || e[t.cols] == 0) continue;  // holds no data
    if (t.role == OperandRole::kOptionalOutput && p == nullptr) continue;
    if (p == nullptr)
      TDIST_FAIL("invalid argument '", t.name, "': tdist.", op.name, ": null pointer for a ", e[t.rows], " x ",
                 e[t.cols], " operand");
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
      TDIST_FAIL("invalid argument '", t.name, "': tdist.", op.name, ": must be 16-byte aligned, got ", p);
  }
}

OverlapContextConfig overlap_context_for(const OverlapOpTraits& op, DType dtype, int64_t m, int64_t n, int64_t k) {
  OverlapContextConfig c;
  c.dtype = dtype;
  c.max_m = std::max<int64_t>(m, 1);
  c.max_n = op.context_by_n ? n : 0;
  c.k = op.context_by_k ? k : 0;
  return c;
}

bool overlap_context_serves(const OverlapOpTraits& op, const OverlapContextConfig& have,
                            const OverlapContextConfig& need) {
  return have.dtype == need.dtype && (!op.context_by_k || have.k == need.k) && have.max_m >= need.max_m &&
         (!op.context_by_n || have.max_n >= need.max_n);
}

// ---------------------------------------------------------------------------------------------
// OverlapContextCache

namespace {

size_t mib(size_t bytes) { return (bytes + (size_t{1} << 20) - 1) >> 20; }

std::string describe(const OverlapOpTraits& op, const OverlapContextConfig& c) {
  std::string s = detail::concat("max_m=", c.max_m);
  if (op.context_by_n) s += detail::concat(", max_n=", c.max_n);
  if (op.context_by_k) s += detail::concat(", K=", c.k);
  return s + ", " + to_string(c.dtype);
}

}  // namespace

OverlapContextCache::OverlapContextCache(World& world, SymmetricHeap& heap) : world_(world), heap_(heap) {
  num_sms_ = sm_count(world.device());
}

OverlapContextCache::~OverlapContextCache() = default;

OverlapContextConfig OverlapContextCache::grown_config(const OverlapOpTraits& op, const OverlapContextConfig* old,
                                                       const OverlapContextConfig& need, size_t room, int world_size,
                                                       int num_sms) {
  if (!old) return need;
  OverlapContextConfig c = need;
  // M at least doubles when it grows; N grows to the largest seen; less when the heap lacks room.
  c.max_m = need.max_m <= old->max_m ? old->max_m : std::max(need.max_m, 2 * old->max_m);
  if (op.context_by_n) c.max_n = std::max(need.max_n, old->max_n);
  if (op.heap_bytes(c, world_size, num_sms) > room) c.max_m = std::max(need.max_m, old->max_m);
  if (op.heap_bytes(c, world_size, num_sms) > room) c = need;  // the old sizes do not fit beside: just this call's
  return c;
}

OverlapContext& OverlapContextCache::get(const OverlapOpTraits& op, DType dtype, int64_t m, int64_t n, int64_t k,
                                         cudaStream_t stream) {
  const OverlapContextConfig need = overlap_context_for(op, dtype, m, n, k);
  auto& slot = contexts_[Key{op.name, dtype, need.k}];
  if (slot && overlap_context_serves(op, slot->context_config(), need)) return *slot;

  const int w = world_.world_size();
  const OverlapContextConfig old = slot ? slot->context_config() : OverlapContextConfig{};
  const size_t old_bytes = slot ? op.heap_bytes(old, w, num_sms_) : 0;
  const size_t room = heap_.capacity() - heap_.bytes_in_use() + old_bytes;
  const OverlapContextConfig c = grown_config(op, slot ? &old : nullptr, need, room, w, num_sms_);
  const size_t bytes = op.heap_bytes(c, w, num_sms_);
  const std::string want = describe(op, c);
  const std::string have = slot ? detail::concat("; the current one has ", describe(op, old)) : std::string();
  TDIST_CHECK(!stream_is_capturing(stream), "tdist.", op.name, ": this call needs a new context (", want, have,
              ") but the stream is capturing a CUDA graph, and creating a context allocates symmetric memory, "
              "compiles kernels and synchronises every rank. Call the op once with the largest shapes before the "
              "capture (a warm-up, on every rank)");
  if (bytes > room) {
    const size_t gib = (heap_.capacity() + (bytes - room) + (size_t{1} << 30) - 1) >> 30;
    TDIST_FAIL("tdist.", op.name, ": its context (", want, ") needs about ", mib(bytes),
               " MiB of symmetric memory, but the heap has ", mib(room), " MiB free of ", mib(heap_.capacity()),
               " MiB; raise the symmetric heap's size (heap_size in tdist.init, e.g. heap_size=\"", gib,
               "G\") or free symmetric buffers");
  }
  slot.reset();  // collective: its buffers go back to the heap first
  try {
    slot = op.create(world_, heap_, c);
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.find("out of memory") != std::string::npos)
      TDIST_FAIL("tdist.", op.name, ": creating its context (", want,
                 ") ran out of symmetric memory; raise the symmetric heap's size (heap_size in tdist.init). ", what);
    throw;
  }
  return *slot;
}

std::vector<std::pair<const OverlapOpTraits*, OverlapContextConfig>> OverlapContextCache::contexts() const {
  std::vector<std::pair<const OverlapOpTraits*, OverlapContextConfig>> v;
  for (const auto& [key, ctx] : contexts_)
    if (ctx) v.emplace_back(&find_overlap_op(std::get<0>(key)), ctx->context_config());
  return v;
}

void OverlapContextCache::clear() { contexts_.clear(); }

}  // namespace tdist
