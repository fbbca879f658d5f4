// Host side of tdist::Collectives: buffers, kernel loading, method resolution and launches.
// Protocols and the CUDA-graph argument: include/tdist/kernels/collectives/*.cuh and
// docs/collectives.md.
#include "tdist/ops/collectives.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <unordered_map>

#include "src/ops/nccl_dtype.hpp"
#include "tdist/common/alignment.hpp"
#include "tdist/common/checked.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/log.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/device/barrier_pad.cuh"
#include "tdist/jit/autotune.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/collectives/ll128.cuh"
#include "tdist/kernels/collectives/reduce_scatter.cuh"
#include "tdist/runtime/device_fault.hpp"
#include "tdist/runtime/stream.hpp"

namespace tdist {

using kernels::coll::CollParams;
using kernels::coll::EpochState;

using detail::nccl_type;

namespace {

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

size_t round_up(size_t v, size_t a) { return checked_align_up(v, a, "a collectives buffer size rounded up"); }

// ---------------------------------------------------------------------------------------------
// The symmetric buffers of one context, for n ranks (one allocation; the same layout gives
// heap_bytes() and the constructor's addresses):
//   workspace     char[2][max_bytes]               two slots, calls alternate between them
//   flags         u64[kPhases][max_blocks][n]      the SM kernels' per-block phase flags
//   barrier_pads  u64[2][barrier_pad_words(n)]     [0]: barrier(), [1]: copy-engine phases
//   ce_flags      u64[ce_pieces][n]                ce_flags[piece * n + src] = 1 once src's piece landed
//   ll            u64[2][n][ll_words]              LL lines: parity x source, one 8-byte line per 4
//                                                  payload bytes (ll.cuh)
//   ll128         char[2][n][ll128_lines][128]     LL128 lines: parity x source (ll128.cuh)
struct CollectivesLayout {
  static size_t ll_words(size_t ll_bytes) { return ll_bytes / 4; }
  static size_t ll128_lines(size_t ll128_bytes) { return kernels::coll::ll128_lines(ll128_bytes); }

  SymmetricLayout layout;
  SymmetricLayout::Region<char> workspace;
  SymmetricLayout::Region<device::u64> flags, barrier_pads, ce_flags, ll;
  SymmetricLayout::Region<char> ll128;

  // max_bytes and ll_bytes as the context rounds them (round_up 256 and 16).
  CollectivesLayout(int n, size_t max_bytes, size_t ll_bytes, size_t ll128_bytes, int max_blocks, size_t ce_pieces) {
    const size_t ranks = static_cast<size_t>(n);
    workspace = layout.add<char>(checked_mul<size_t>(2, max_bytes, "the collectives workspace (2 * max_bytes)"),
                                 "collectives workspace");
    flags =
        layout.add<device::u64>(checked_mul<size_t>(static_cast<size_t>(kernels::coll::kPhases) * ranks,
                                                    static_cast<size_t>(max_blocks), "the collectives' phase flags"),
                                "collectives phase flags");
    barrier_pads = layout.add<device::u64>(2 * device::barrier_pad_words(n), "collectives barrier pads");
    ce_flags = layout.add<device::u64>(ce_pieces * ranks, "collectives copy-engine flags");
    ll = layout.add<device::u64>(checked_mul<size_t>(2 * ranks, ll_words(ll_bytes), "the LL buffer"),
                                 "collectives LL lines");
    ll128 = layout.add<char>(
        checked_mul<size_t>(2 * ranks * ll128_lines(ll128_bytes), kernels::coll::kLl128LineBytes, "the LL128 buffer"),
        "collectives LL128 lines");
  }
};

// ---------------------------------------------------------------------------------------------
// The kernels, each named once here: its header, its symbol (kernels::coll), whether it has an
// instance per element type. Compile requests group them by header; the loaded kernels are found
// by (CollKernel, DType), never by a name assembled at the call site or a module's position.
enum class CollKernel {
  kAgSm,
  kAgPush,
  kLlAllGather,
  kBarrier,
  kRsFused,
  kRsCePipelined,
  kArOneShot,
  kArTwoShot,
  kLlAllReduce,
  kLlReduceScatter,
  kLl128AllReduce,
  kCount
};

struct KernelInfo {
  CollKernel id;
  const char* header;  // under tdist/kernels/collectives/
  const char* symbol;  // a function template (per_dtype) or an extern "C" / plain kernel
  bool per_dtype;
};

constexpr KernelInfo kKernels[] = {
    {CollKernel::kAgSm, "all_gather.cuh", "tdist::kernels::coll::tdist_ag_sm", false},
    {CollKernel::kAgPush, "all_gather.cuh", "tdist::kernels::coll::tdist_ag_push", false},
    {CollKernel::kRsFused, "reduce_scatter.cuh", "tdist::kernels::coll::rs_fused", true},
    {CollKernel::kRsCePipelined, "reduce_scatter.cuh", "tdist::kernels::coll::rs_ce_pipelined", true},
    {CollKernel::kArOneShot, "all_reduce.cuh", "tdist::kernels::coll::ar_one_shot", true},
    {CollKernel::kArTwoShot, "all_reduce.cuh", "tdist::kernels::coll::ar_two_shot", true},
    {CollKernel::kLlAllGather, "ll.cuh", "tdist::kernels::coll::tdist_ll_all_gather", false},
    {CollKernel::kLlAllReduce, "ll.cuh", "tdist::kernels::coll::ll_all_reduce", true},
    {CollKernel::kLlReduceScatter, "ll.cuh", "tdist::kernels::coll::ll_reduce_scatter", true},
    {CollKernel::kBarrier, "barrier.cuh", "tdist_coll_barrier", false},
    {CollKernel::kLl128AllReduce, "ll128.cuh", "tdist::kernels::coll::ll128_all_reduce", true},
};

// The name expression of one instance: "symbol<T>" for a template, the symbol otherwise.
std::string instance_name(const KernelInfo& k, DType t) {
  return k.per_dtype ? detail::concat(k.symbol, "<", kernel_type_name(t), ">") : std::string(k.symbol);
}

// The headers in kKernels' order of first appearance: one module each.
std::vector<std::string> kernel_headers() {
  std::vector<std::string> headers;
  for (const KernelInfo& k : kKernels)
    if (std::find(headers.begin(), headers.end(), k.header) == headers.end()) headers.push_back(k.header);
  return headers;
}

jit::CompileRequest header_request(const std::string& header) {
  jit::CompileRequest r;
  r.source = detail::concat("#include \"tdist/kernels/collectives/", header, "\"\n");
  r.file_name = detail::concat("collectives_", header.substr(0, header.find('.')), ".cu");
  for (const KernelInfo& k : kKernels) {
    if (header != k.header) continue;
    if (!k.per_dtype)
      r.name_expressions.push_back(k.symbol);
    else
      for (DType t : kDTypes) r.name_expressions.push_back(instance_name(k, t));
  }
  return r;
}

}  // namespace

std::vector<jit::CompileRequest> collective_compile_requests() {
  std::vector<jit::CompileRequest> v;
  for (const std::string& h : kernel_headers()) v.push_back(header_request(h));
  return v;
}

TDIST_JIT_REGISTER_KERNELS(collectives, collective_compile_requests);

namespace detail {

struct CollectiveTuner {
  bool on = env::flag(kCollectiveTuneEnv, true);
  // class_key -> the winner (the method enum's value), or -1: the table decides the class for good.
  std::unordered_map<uint64_t, int> winners;
  std::unique_ptr<jit::Autotuner> autotuner;  // created at the first timing
};

}  // namespace detail

struct Collectives::Kernels {
  std::vector<std::shared_ptr<jit::Module>> modules;  // keep the kernels' modules loaded
  std::array<std::array<jit::Kernel, std::size(kDTypes)>, static_cast<size_t>(CollKernel::kCount)> table{};

  Kernels() {
    for (const std::string& h : kernel_headers()) {
      auto module = jit::Module::load(jit::compile(header_request(h)));
      for (const KernelInfo& k : kKernels) {
        if (h != k.header) continue;
        for (DType t : kDTypes)
          table[static_cast<size_t>(k.id)][static_cast<size_t>(t)] = module->kernel(instance_name(k, t));
      }
      modules.push_back(std::move(module));
    }
  }
  // The instance of `k` for `t` (kernels without per-type instances: any t).
  const jit::Kernel& get(CollKernel k, DType t = DType::kFloat32) const {
    return table[static_cast<size_t>(k)][static_cast<size_t>(t)];
  }
};

Collectives::Collectives(World& world, SymmetricHeap& heap, size_t max_bytes, const CollectivesOptions& options)
    : world_(world), heap_(heap) {
  TDIST_CHECK_ARG(max_bytes > 0, "max_bytes", "the workspace must hold at least one byte");
  TDIST_CHECK_ARG(options.ll_bytes > 0, "options.ll_bytes", "the low-latency buffer must hold at least one byte");
  TDIST_CHECK_ARG(options.ll128_bytes > 0, "options.ll128_bytes", "the LL128 buffer must hold at least one byte");
  const int n = world.world_size();
  TDIST_CHECK(n <= device::kMaxLsaRanks && n <= kernels::coll::kThreads, "world of ", n, " ranks is too large");
  TDIST_CHECK(world.lsa_size() == n, "Collectives needs every rank in one NVLink (LSA) domain; the LSA team has ",
              world.lsa_size(), " of ", n, " ranks");
  max_blocks_ = options.max_blocks > 0 ? options.max_blocks : sm_count(world.device());
  programmatic_launch_ = options.programmatic_launch;
  max_bytes_ = round_up(max_bytes, 256);
  ll_bytes_ = round_up(options.ll_bytes, 16);
  ll128_bytes_ = kernels::coll::ll128_lines(options.ll128_bytes) * kernels::coll::kLl128Payload;
  const CollectivesLayout layout(n, max_bytes_, ll_bytes_, ll128_bytes_, max_blocks_, kCePieces);
  block_ = SymmetricBlock(heap, layout.layout, options.owner);
  workspace_ = block_[layout.workspace];
  flags_ = block_[layout.flags];
  barrier_pads_ = block_[layout.barrier_pads];
  ce_flags_ = block_[layout.ce_flags];
  ll_ = reinterpret_cast<char*>(block_[layout.ll]);
  ll128_ = block_[layout.ll128];
  TDIST_CUDA_CHECK(cudaMalloc(&epoch_, sizeof(EpochState)));
  TDIST_CUDA_CHECK(cudaMemset(epoch_, 0, sizeof(EpochState)));
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  kernels_ = std::make_unique<Kernels>();
  tuner_ = std::make_unique<detail::CollectiveTuner>();
  // Settings that pick the kernels must agree, or ranks run different protocols and time out.
  world.check_same_on_all_ranks(
      "the method settings (TDIST_ALLREDUCE_METHOD, TDIST_ALLGATHER_METHOD, TDIST_REDUCESCATTER_METHOD, "
      "TDIST_COLLECTIVE_TUNE, TDIST_OVERLAP_METHOD, TDIST_OVERLAP_PIECES, TDIST_OVERLAP_TUNE, TDIST_CHECK_CALLS)",
      detail::concat(env::text(kAllReduceMethodEnv), "|", env::text(kAllGatherMethodEnv), "|",
                     env::text(kReduceScatterMethodEnv), "|", tuner_->on, "|", env::text("TDIST_OVERLAP_METHOD"), "|",
                     env::text("TDIST_OVERLAP_PIECES"), "|", env::text("TDIST_OVERLAP_TUNE"), "|",
                     to_string(world.call_check_mode())));
}

Collectives::~Collectives() {
  cudaDeviceSynchronize();  // the symmetric block goes back to the heap after this
  cudaFree(epoch_);
}

size_t Collectives::heap_bytes(int world_size, size_t max_bytes, int max_blocks, const CollectivesOptions& options) {
  const CollectivesLayout layout(
      world_size, round_up(std::max<size_t>(max_bytes, 1), 256), round_up(std::max<size_t>(options.ll_bytes, 1), 16),
      std::max<size_t>(options.ll128_bytes, 1), options.max_blocks > 0 ? options.max_blocks : max_blocks, kCePieces);
  return layout.layout.bytes();
}

unsigned Collectives::blocks_for(size_t bytes, size_t per_block, int blocks_per_sm) const {
  const size_t b = (bytes + per_block - 1) / per_block;
  return static_cast<unsigned>(std::clamp<size_t>(b, 1, static_cast<size_t>(blocks_per_sm) * max_blocks_));
}

CollectiveShape Collectives::shape(size_t bytes, DType dtype, const void* in, size_t in_bytes, const void* out,
                                   size_t out_bytes, size_t stride_bytes) const {
  const auto& v = heap_.view();
  CollectiveShape s;
  s.bytes = bytes;
  s.dtype = dtype;
  s.world_size = world_.world_size();
  s.in_symmetric = check_symmetric_range("in", in, in_bytes, v.local_base(), v.size);
  s.out_symmetric = check_symmetric_range("out", out, out_bytes, v.local_base(), v.size);
  s.aligned16 = is_aligned(in, 16) && is_aligned(out, 16) && stride_bytes % 16 == 0;
  return s;
}

CollParams Collectives::params(const void* in, void* out, size_t count, bool zero_copy, bool vec) const {
  CollParams p{};
  p.heap = heap_.view();
  p.out = out;
  p.in = in;
  p.ws = workspace_;
  p.slot_bytes = max_bytes_;
  p.count = count;
  p.flags = flags_;
  p.max_blocks = static_cast<device::u64>(max_blocks_);
  p.epoch = epoch_;
  p.ll = ll_;
  p.ll_words = CollectivesLayout::ll_words(ll_bytes_);
  p.ll128 = ll128_;
  p.ll128_lines = CollectivesLayout::ll128_lines(ll128_bytes_);
  p.zero_copy = zero_copy ? 1 : 0;
  p.vec = vec ? 1 : 0;
  return p;
}

void Collectives::launch(const jit::Kernel& k, unsigned blocks, const CollParams& p, cudaStream_t stream,
                         unsigned threads) {
  jit::LaunchConfig cfg;
  cfg.grid = {blocks};
  cfg.block = {threads};
  cfg.programmatic_dependent_launch = programmatic_launch_;  // every such kernel starts in begin_call
  cfg.stream = stream;
  jit::launch(k, cfg, jit::make_args(p));
}

void Collectives::ce_barrier(cudaStream_t stream) {
  jit::LaunchConfig cfg;
  cfg.grid = {1};
  cfg.block = {128};
  cfg.stream = stream;
  jit::launch(kernels_->get(CollKernel::kBarrier), cfg,
              jit::make_args(heap_.view(), barrier_pads_ + device::barrier_pad_words(world_.world_size())));
}

void Collectives::copy_beside(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  side_.fork(stream);
  TDIST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, side_.get()));
}

void Collectives::barrier(cudaStream_t stream) {
  TDIST_NVTX_RANGE("tdist::Collectives::barrier");
  jit::LaunchConfig cfg;
  cfg.grid = {1};
  cfg.block = {128};
  cfg.stream = stream;
  jit::launch(kernels_->get(CollKernel::kBarrier), cfg, jit::make_args(heap_.view(), barrier_pads_));
}

// ---------------------------------------------------------------------------------------------
// Method choice: requested > environment > the class's timed winner > timing the class now > table.

namespace {

// Per method enum: its environment variable, its candidates and its resolution without timing.
template <typename M>
struct MethodOf;
template <>
struct MethodOf<AllReduceMethod> {
  static constexpr const char* kEnv = kAllReduceMethodEnv;
  static constexpr auto candidates = all_reduce_candidates;
  static constexpr auto resolve = resolve_all_reduce;
};
template <>
struct MethodOf<AllGatherMethod> {
  static constexpr const char* kEnv = kAllGatherMethodEnv;
  static constexpr auto candidates = all_gather_candidates;
  static constexpr auto resolve = resolve_all_gather;
};
template <>
struct MethodOf<ReduceScatterMethod> {
  static constexpr const char* kEnv = kReduceScatterMethodEnv;
  static constexpr auto candidates = reduce_scatter_candidates;
  static constexpr auto resolve = resolve_reduce_scatter;
};

// `time(cls)`: the class's winner timed now, or -1 (table); kNoTiming for the queries.
template <typename M, typename Time>
M choose_method(M requested, CollectiveOp op, const CollectiveShape& s, bool in_place, const CollectiveLimits& l,
                detail::CollectiveTuner& t, Time&& time) {
  const char* env = std::getenv(MethodOf<M>::kEnv);
  const unsigned candidates = MethodOf<M>::candidates(s, l);
  if (tune_skip_reason(requested == M::kAuto, env, t.on, s, candidates, false) != TuneSkip::kNone)
    return MethodOf<M>::resolve(requested, env, s, l);
  // Every call after a class's first: one key and one lookup.
  const CollectiveClass cls = collective_class(op, s, in_place, candidates);
  const auto it = t.winners.find(class_key(cls));
  const int winner = it != t.winners.end() ? it->second : time(cls);
  return winner < 0 ? MethodOf<M>::resolve(requested, env, s, l) : static_cast<M>(winner);
}

constexpr auto kNoTiming = [](const CollectiveClass&) { return -1; };

// Compares a collective call with the other ranks' (World::check_same_call): op, count, dtype, the
// method asked for and the buffer kinds. It runs before the method is chosen, since choosing may
// time candidates together with the other ranks, which mismatched calls would turn into a device
// timeout. What `auto` resolves to follows from these fields, the settings the constructor compared
// and the timed winners the ranks agree on. Alignment steers only auto's choice, so it is part of
// the signature under auto alone (an explicit method runs alike on buffers of either alignment).
template <typename M>
void check_call(World& world, cudaStream_t stream, const char* op, size_t count, const char* count_unit, DType dtype,
                M method, const CollectiveShape& s, bool in_place) {
  const bool is_auto = method == M::kAuto;
  CallKey key(op);
  key.add(static_cast<uint64_t>(count))
      .add(static_cast<int>(dtype))
      .add(static_cast<int>(method))
      .add(s.in_symmetric)
      .add(s.out_symmetric)
      .add(in_place)
      .add(is_auto && s.aligned16);
  world.check_same_call(key.value(), stream, [&] {
    return detail::concat(op, "(count=", count, count_unit, ", ", to_string(dtype), ", method ", to_string(method),
                          ", in ", s.in_symmetric ? "symmetric" : "ordinary", ", out ",
                          s.out_symmetric ? "symmetric" : "ordinary", in_place ? ", in place" : "",
                          !is_auto ? "" : s.aligned16 ? ", 16-byte aligned" : ", not 16-byte aligned", ")");
  });
}

}  // namespace

bool Collectives::tuning() const { return tuner_->on; }

size_t Collectives::tuned_classes() const {
  size_t n = 0;
  for (const auto& [key, winner] : tuner_->winners) n += winner >= 0 ? 1 : 0;
  return n;
}

Collectives::Call Collectives::all_reduce_call(const void* in, void* out, size_t count, DType dtype) const {
  check_dtype(dtype);
  check_count("all_reduce", count);
  const size_t bytes = count * dtype_size(dtype);
  check_buffers("all_reduce", in, bytes, out, bytes, out);
  const bool in_place = in == out;
  const CollectiveShape s = shape(bytes, dtype, in, bytes, out, bytes, 16);
  return Call{CollectiveOp::kAllReduce, in, bytes, out, bytes, count, dtype, in_place, s};
}

Collectives::Call Collectives::all_gather_call(const void* in, void* out, size_t count, DType dtype) const {
  check_dtype(dtype);
  check_count("all_gather", count);
  const size_t b = count * dtype_size(dtype), total = b * world_.world_size();
  const void* in_place_in = static_cast<const char*>(out) + world_.rank() * b;
  check_buffers("all_gather", in, b, out, total, in_place_in);
  const bool in_place = in == in_place_in;
  return Call{
      CollectiveOp::kAllGather, in, b, out, total, count, dtype, in_place, shape(total, dtype, in, b, out, total, b)};
}

Collectives::Call Collectives::reduce_scatter_call(const void* in, void* out, size_t count, DType dtype) const {
  check_dtype(dtype);
  check_count("reduce_scatter", count);
  const size_t b = count * dtype_size(dtype), total = b * world_.world_size();
  const void* in_place_in = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(out) - world_.rank() * b);
  check_buffers("reduce_scatter", in, total, out, b, in_place_in);
  const bool in_place = in == in_place_in;
  const CollectiveShape s = shape(total, dtype, in, total, out, b, b);
  return Call{CollectiveOp::kReduceScatter, in, total, out, b, count, dtype, in_place, s};
}

AllReduceMethod Collectives::all_reduce_method(const void* in, void* out, size_t count, DType dtype,
                                               AllReduceMethod method) const {
  const Call c = all_reduce_call(in, out, count, dtype);
  return choose_method(method, c.op, c.shape, c.in_place, limits(), *tuner_, kNoTiming);
}

AllReduceMethod Collectives::tune_all_reduce(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                                             AllReduceMethod method) {
  const Call c = all_reduce_call(in, out, count, dtype);
  return choose_method(method, c.op, c.shape, c.in_place, limits(), *tuner_,
                       [&](const CollectiveClass& cls) { return tune_class(c, cls, stream); });
}

AllGatherMethod Collectives::all_gather_method(const void* in, void* out, size_t count, DType dtype,
                                               AllGatherMethod method) const {
  const Call c = all_gather_call(in, out, count, dtype);
  return choose_method(method, c.op, c.shape, c.in_place, limits(), *tuner_, kNoTiming);
}

AllGatherMethod Collectives::tune_all_gather(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                                             AllGatherMethod method) {
  const Call c = all_gather_call(in, out, count, dtype);
  return choose_method(method, c.op, c.shape, c.in_place, limits(), *tuner_,
                       [&](const CollectiveClass& cls) { return tune_class(c, cls, stream); });
}

ReduceScatterMethod Collectives::reduce_scatter_method(const void* in, void* out, size_t count, DType dtype,
                                                       ReduceScatterMethod method) const {
  const Call c = reduce_scatter_call(in, out, count, dtype);
  return choose_method(method, c.op, c.shape, c.in_place, limits(), *tuner_, kNoTiming);
}

ReduceScatterMethod Collectives::tune_reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                                                     cudaStream_t stream, ReduceScatterMethod method) {
  const Call c = reduce_scatter_call(in, out, count, dtype);
  return choose_method(method, c.op, c.shape, c.in_place, limits(), *tuner_,
                       [&](const CollectiveClass& cls) { return tune_class(c, cls, stream); });
}

namespace {

// One buffer of a call as its scratch copy must reproduce it: [lo, lo + extent) in the caller's
// memory, symmetric or not. In place, input and output are one region.
struct ScratchRegion {
  const char* lo;
  size_t extent;
  bool symmetric;
  // Scratch bytes: the extent plus room to keep lo's offset modulo 256.
  size_t bytes() const { return extent + 256; }
};

}  // namespace

// Timing never touches the caller's buffers: every candidate runs on scratch of the same kinds,
// sizes, in-place layout and offsets modulo 256 (symmetric scratch from the heap, at the same offset
// on every rank as a symmetric buffer must be; ordinary scratch from cudaMalloc), filled with zeros.
// The ranks first agree on the class and on having scratch (one max-reduction), so that all time
// the same candidates in the same order or none do.
int Collectives::tune_class(const Call& call, const CollectiveClass& cls, cudaStream_t stream) {
  if (stream_is_capturing(stream)) return -1;  // not remembered: timed at the class's first call outside capture
  detail::CollectiveTuner& t = *tuner_;
  const uint64_t key = class_key(cls);
  const char* in = static_cast<const char*>(call.in);
  const char* out = static_cast<const char*>(call.out);
  std::vector<ScratchRegion> regions;
  if (call.in_place) {
    const char* lo = std::min(in, out);
    const char* hi = std::max(in + call.in_bytes, out + call.out_bytes);
    regions.push_back({lo, static_cast<size_t>(hi - lo), call.shape.out_symmetric});
  } else {
    regions.push_back({in, call.in_bytes, call.shape.in_symmetric});
    regions.push_back({out, call.out_bytes, call.shape.out_symmetric});
  }
  // Ordinary scratch now (a failure only makes this rank vote against timing); symmetric scratch is
  // collective and allocated once every rank has voted for it.
  std::vector<char*> base(regions.size(), nullptr);
  size_t symmetric_bytes = 0;
  bool have_scratch = true;
  auto free_ordinary = [&] {
    for (size_t i = 0; i < regions.size(); ++i)
      if (!regions[i].symmetric && base[i] != nullptr) cudaFree(base[i]);
  };
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].symmetric) {
      symmetric_bytes += round_up(regions[i].bytes(), 256);
      continue;
    }
    if (cudaMalloc(&base[i], regions[i].bytes()) != cudaSuccess) {
      (void)cudaGetLastError();
      base[i] = nullptr;
      have_scratch = false;
    }
  }
  if (symmetric_bytes > 0 && heap_.largest_free_block() < symmetric_bytes + SymmetricHeap::kDefaultAlignment)
    have_scratch = false;
  // A class differing between ranks would make them time different candidates: agree first.
  const std::vector<double> agreed =
      world_.max_across_ranks("tdist collective method tuning: class",
                              {static_cast<double>(key), -static_cast<double>(key), have_scratch ? 0.0 : 1.0});
  if (agreed[0] != -agreed[1]) {
    // Every rank sees the mismatch here, so all stop timing together (and all stop using their
    // winners, which might now differ): the table decides from here on, as before any timing.
    free_ordinary();
    t.on = false;
    TDIST_WARN(TUNE, "collectives: the ranks called ", to_string(cls.op), " with buffers of different kinds, in-place ",
               "layout or 16-byte alignment (this rank: ", describe(cls), "); timing is off for this context, the ",
               "table decides every call. Pass alike buffers on every rank.");
    return -1;
  }
  if (agreed[2] > 0) {
    free_ordinary();
    t.winners[key] = -1;
    TDIST_INFO(TUNE, "collectives ", describe(cls), ": not timed, no scratch of ", symmetric_bytes,
               " symmetric bytes (heap) or of the ordinary buffers' size on some rank; the table decides");
    return -1;
  }
  char* symmetric = nullptr;
  std::vector<char*> scratch(regions.size());
  try {
    if (symmetric_bytes > 0) symmetric = static_cast<char*>(heap_.allocate(symmetric_bytes));
    size_t offset = 0;
    for (size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].symmetric) {
        base[i] = symmetric + offset;
        offset += round_up(regions[i].bytes(), 256);
      } else {
        TDIST_CUDA_CHECK(cudaMemsetAsync(base[i], 0, regions[i].bytes(), stream));  // anything finite
      }
      scratch[i] = base[i] + reinterpret_cast<uintptr_t>(regions[i].lo) % 256;
    }
  } catch (...) {
    free_ordinary();
    throw;
  }
  // The call's buffers mapped into the scratch.
  const void* s_in = call.in_place ? scratch[0] + (in - regions[0].lo) : scratch[0];
  void* s_out = call.in_place ? scratch[0] + (out - regions[0].lo) : scratch[1];

  jit::TuneRequest req;
  req.kernel = "tdist.collective_method.v1";
  int nccl_version = 0;
  TDIST_NCCL_CHECK(ncclGetVersion(&nccl_version));
  req.shape_class = detail::concat(describe(cls), " nccl=", nccl_version, " max_blocks=", max_blocks_);
  for (int m : candidate_list(cls.candidates))
    req.configs.push_back({method_name(cls.op, m), {{"method", static_cast<int64_t>(m)}}});
  const int calls = tune_calls_per_launch(call.shape.bytes);
  req.launch = [&](const jit::TuneConfig& c, int, cudaStream_t st) {
    const int m = static_cast<int>(c.params.at("method"));
    for (int i = 0; i < calls; ++i) {
      if (cls.op == CollectiveOp::kAllReduce)
        all_reduce(s_in, s_out, call.count, call.dtype, st, static_cast<AllReduceMethod>(m));
      else if (cls.op == CollectiveOp::kAllGather)
        all_gather(s_in, s_out, call.count, call.dtype, st, static_cast<AllGatherMethod>(m));
      else
        reduce_scatter(s_in, s_out, call.count, call.dtype, st, static_cast<ReduceScatterMethod>(m));
    }
  };
  // Outside the timed region: every rank starts each timed launch together, so a rank that reached
  // it early does not count its wait for the others.
  req.rotate = [&](int) { barrier(stream); };
  req.stream = stream;
  req.warmup = 2;
  req.repeat = 7;
  if (!t.autotuner)
    t.autotuner = std::make_unique<jit::Autotuner>("", jit::Autotuner::Timer{}, [this](const std::vector<double>& v) {
      return world_.max_across_ranks("tdist collective method tuning: times", v);
    });
  int winner = -1;
  std::string failure;
  {
    // The timed calls are not compared one by one: the class was agreed once, and a host exchange
    // per timed call would be timed with it.
    const ScopedCallCheckMode checks_off(world_, CallCheckMode::kOff);
    try {
      winner = static_cast<int>(t.autotuner->tune(req).params.at("method"));
    } catch (const std::exception& e) {
      // No candidate ran, or the record could not be written (this rank only): agreed on below.
      failure = e.what();
    }
  }
  // Scratch back once the timed calls are done (on every rank: heap_.free is collective).
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (symmetric != nullptr) heap_.free(symmetric);
  free_ordinary();
  // Every rank runs the class alike: the winner where all have the same one, else the table.
  const std::vector<double> result =
      world_.max_across_ranks("tdist collective method tuning: winner",
                              {failure.empty() ? 0.0 : 1.0, static_cast<double>(winner), -static_cast<double>(winner)});
  if (result[0] > 0 || result[1] != -result[2]) {
    t.winners[key] = -1;
    TDIST_WARN(TUNE, "collectives ", describe(cls), ": timing failed on some rank, the table decides the class",
               failure.empty() ? "" : " (this rank: ", failure, failure.empty() ? "" : ")");
    return -1;
  }
  t.winners[key] = winner;
  TDIST_INFO(TUNE, "collectives ", describe(cls), ": method ", method_name(cls.op, winner),
             " (auto, timed on this machine, ", calls, " calls per timed launch)");
  return winner;
}

void Collectives::all_reduce(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                             AllReduceMethod method) {
  check_device_faults();  // NCCL's methods launch nothing of tdist's: refuse them here too
  const Call call = all_reduce_call(in, out, count, dtype);
  check_call(world_, stream, "all_reduce", count, "", dtype, method, call.shape, call.in_place);
  const AllReduceMethod m = choose_method(method, call.op, call.shape, call.in_place, limits(), *tuner_,
                                          [&](const CollectiveClass& cls) { return tune_class(call, cls, stream); });
  TDIST_NVTX_RANGE("tdist::Collectives::all_reduce", "count=", count, " ", to_string(dtype), " ", to_string(m));
  const size_t bytes = count * dtype_size(dtype);
  const CollectiveShape& s = call.shape;
  switch (m) {
    case AllReduceMethod::kNccl:
      TDIST_NCCL_CHECK(ncclAllReduce(in, out, count, nccl_type(dtype), ncclSum, world_.comm(), stream));
      world_.watch_nccl(stream, "AllReduce");
      return;
    case AllReduceMethod::kLowLatency:
      launch(kernels_->get(CollKernel::kLlAllReduce, dtype), blocks_for((bytes + 3) / 4, kernels::coll::kThreads),
             params(in, out, count, false, false), stream);
      return;
    case AllReduceMethod::kLowLatency128: {
      // One warp per 4 lines (ll128.cuh) in 4-warp blocks: spread over more SMs, they ran 1-5 %
      // faster from 128 KB to 512 KB than 16-warp blocks, and 6.63 against 6.90 us at 1 MB, where
      // 16-warp blocks need more than one per SM (bench/results/h200x2/ll128_blocks/). At most
      // kLl128BlocksPerSm for each of max_blocks_ SMs, all resident at once; more lines loop.
      using namespace kernels::coll;
      launch(kernels_->get(CollKernel::kLl128AllReduce, dtype),
             blocks_for(ll128_lines(bytes), kLl128LinesPerWarp * (kLl128Threads / 32), kLl128BlocksPerSm),
             params(in, out, count, false, false), stream, kLl128Threads);
      return;
    }
    case AllReduceMethod::kOneShot: {
      // Zero copy needs out != in: peers read `in` until the closing exchange.
      const bool zc = s.in_symmetric && in != out;
      launch(kernels_->get(CollKernel::kArOneShot, dtype), blocks_for(bytes, 16 << 10),
             params(in, out, count, zc, s.aligned16), stream);
      return;
    }
    case AllReduceMethod::kTwoShot: {
      const size_t slice = kernels::coll::two_shot_slice(count, world_.world_size()) * dtype_size(dtype);
      launch(kernels_->get(CollKernel::kArTwoShot, dtype), blocks_for(slice, 16 << 10),
             params(in, out, count, s.in_symmetric, s.aligned16), stream);
      return;
    }
    case AllReduceMethod::kCe: {
      // Two-shot by copy engine: the ce ReduceScatter leaves this rank's slice of the sum in its part
      // of `out` (in place when in == out), then the ce_push AllGather, in place, pushes it into every
      // peer's `out`. Its entry barrier follows each peer's ReduceScatter copies, the last readers of
      // `in` and of the workspace it may stage through.
      const size_t slice = count / world_.world_size();
      char* mine = static_cast<char*>(out) + world_.rank() * slice * dtype_size(dtype);
      reduce_scatter(in, mine, slice, dtype, stream, ReduceScatterMethod::kCe);
      all_gather(mine, out, slice, dtype, stream, AllGatherMethod::kCePush);
      return;
    }
    default: TDIST_FAIL("unreachable all_reduce method ", to_string(m));
  }
}

void Collectives::all_gather(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                             AllGatherMethod method) {
  check_device_faults();  // NCCL's methods launch nothing of tdist's: refuse them here too
  const Call call = all_gather_call(in, out, count, dtype);
  check_call(world_, stream, "all_gather", count, " per rank", dtype, method, call.shape, call.in_place);
  const AllGatherMethod m = choose_method(method, call.op, call.shape, call.in_place, limits(), *tuner_,
                                          [&](const CollectiveClass& cls) { return tune_class(call, cls, stream); });
  TDIST_NVTX_RANGE("tdist::Collectives::all_gather", "count=", count, " ", to_string(dtype), " ", to_string(m));
  const int n = world_.world_size(), me = world_.rank();
  const size_t b = count * dtype_size(dtype);
  const CollectiveShape& s = call.shape;
  char* o = static_cast<char*>(out);
  switch (m) {
    case AllGatherMethod::kNccl:
      if (nccl_avoid_symmetric_kernels(s)) {
        // Input through a stream-ordered buffer outside the window: NCCL then runs its regular
        // kernels (collective_select.hpp, nccl_avoid_symmetric_kernels).
        void* tmp = nullptr;
        TDIST_CUDA_CHECK(cudaMallocAsync(&tmp, b, stream));
        TDIST_CUDA_CHECK(cudaMemcpyAsync(tmp, in, b, cudaMemcpyDeviceToDevice, stream));
        TDIST_NCCL_CHECK(ncclAllGather(tmp, out, count, nccl_type(dtype), world_.comm(), stream));
        world_.watch_nccl(stream, "AllGather");
        TDIST_CUDA_CHECK(cudaFreeAsync(tmp, stream));
        return;
      }
      TDIST_NCCL_CHECK(ncclAllGather(in, out, count, nccl_type(dtype), world_.comm(), stream));
      world_.watch_nccl(stream, "AllGather");
      return;
    case AllGatherMethod::kLowLatency:
      launch(kernels_->get(CollKernel::kLlAllGather), blocks_for((b + 3) / 4, kernels::coll::kThreads),
             params(in, out, b, false, false), stream);
      return;
    case AllGatherMethod::kSm:
      launch(kernels_->get(CollKernel::kAgSm), blocks_for(b, 32 << 10), params(in, out, b, s.in_symmetric, s.aligned16),
             stream);
      return;
    case AllGatherMethod::kSmPush:
      launch(kernels_->get(CollKernel::kAgPush), blocks_for(b, 32 << 10), params(in, out, b, false, s.aligned16),
             stream);
      return;
    case AllGatherMethod::kCePush: {
      // Push this rank's input into every peer's output (zero copy) or workspace slot 0, then, in the
      // workspace case, copy the gathered blocks to the output. Barriers: before (peers are done with
      // the destination) and after (every push has landed).
      // This rank's own block is copied on the side stream, beside the pushes: serialised behind
      // them it would add a local copy's time (a quarter of a 256 MB AllGather at two ranks).
      char* dst = s.out_symmetric ? o : workspace_;
      ce_barrier(stream);
      const bool own_copy = o + me * b != in;
      if (own_copy) copy_beside(o + me * b, in, b, stream);
      for (int k = 1; k < n; ++k) {
        const int peer = (me + k) % n;
        TDIST_CUDA_CHECK(cudaMemcpyAsync(heap_.peer_ptr(dst + me * b, peer), in, b, cudaMemcpyDeviceToDevice, stream));
      }
      if (own_copy) side_.join(stream);
      ce_barrier(stream);
      if (!s.out_symmetric) {
        if (me > 0) TDIST_CUDA_CHECK(cudaMemcpyAsync(o, workspace_, me * b, cudaMemcpyDeviceToDevice, stream));
        if (me < n - 1)
          TDIST_CUDA_CHECK(cudaMemcpyAsync(o + (me + 1) * b, workspace_ + (me + 1) * b, (n - 1 - me) * b,
                                           cudaMemcpyDeviceToDevice, stream));
      }
      return;
    }
    case AllGatherMethod::kCePull: {
      // Every rank's input sits in its own symmetric buffer (zero copy) or workspace slot 0; each rank
      // reads the peers' copies into its output. The closing barrier keeps the source alive until
      // every peer has read it.
      // Zero copy in place (in == out + me * b): peer p's input is its own part out + p * b of the
      // symmetric output, not the translation of this rank's `in`.
      const bool in_place = o + me * b == in;
      auto peer_src = [&](int peer) -> const char* {
        if (!s.in_symmetric) return workspace_;
        return in_place ? o + peer * b : static_cast<const char*>(in);
      };
      ce_barrier(stream);  // nobody still reads this rank's workspace from an earlier call
      if (!s.in_symmetric) {
        TDIST_CUDA_CHECK(cudaMemcpyAsync(workspace_, in, b, cudaMemcpyDeviceToDevice, stream));
        ce_barrier(stream);
      }
      const bool own_copy = o + me * b != in;  // beside the pulls, as in kCePush
      if (own_copy) copy_beside(o + me * b, in, b, stream);
      for (int k = 1; k < n; ++k) {
        const int peer = (me + k) % n;
        TDIST_CUDA_CHECK(
            cudaMemcpyAsync(o + peer * b, heap_.peer_ptr(peer_src(peer), peer), b, cudaMemcpyDeviceToDevice, stream));
      }
      if (own_copy) side_.join(stream);
      ce_barrier(stream);
      return;
    }
    default: TDIST_FAIL("unreachable all_gather method ", to_string(m));
  }
}

void Collectives::reduce_scatter(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                                 ReduceScatterMethod method) {
  check_device_faults();  // NCCL's methods launch nothing of tdist's: refuse them here too
  const Call call = reduce_scatter_call(in, out, count, dtype);
  check_call(world_, stream, "reduce_scatter", count, " per rank", dtype, method, call.shape, call.in_place);
  const ReduceScatterMethod m =
      choose_method(method, call.op, call.shape, call.in_place, limits(), *tuner_,
                    [&](const CollectiveClass& cls) { return tune_class(call, cls, stream); });
  TDIST_NVTX_RANGE("tdist::Collectives::reduce_scatter", "count=", count, " ", to_string(dtype), " ", to_string(m));
  const int n = world_.world_size(), me = world_.rank();
  const size_t b = count * dtype_size(dtype);
  const CollectiveShape& s = call.shape;
  switch (m) {
    case ReduceScatterMethod::kNccl:
      if (nccl_avoid_symmetric_kernels(s)) {
        // Output through a stream-ordered buffer outside the window (see all_gather).
        void* tmp = nullptr;
        TDIST_CUDA_CHECK(cudaMallocAsync(&tmp, b, stream));
        TDIST_NCCL_CHECK(ncclReduceScatter(in, tmp, count, nccl_type(dtype), ncclSum, world_.comm(), stream));
        world_.watch_nccl(stream, "ReduceScatter");
        TDIST_CUDA_CHECK(cudaMemcpyAsync(out, tmp, b, cudaMemcpyDeviceToDevice, stream));
        TDIST_CUDA_CHECK(cudaFreeAsync(tmp, stream));
        return;
      }
      TDIST_NCCL_CHECK(ncclReduceScatter(in, out, count, nccl_type(dtype), ncclSum, world_.comm(), stream));
      world_.watch_nccl(stream, "ReduceScatter");
      return;
    case ReduceScatterMethod::kLowLatency:
      // One thread per 4-byte word of the per-rank slice (ll.cuh); no staging, no alignment needed.
      launch(kernels_->get(CollKernel::kLlReduceScatter, dtype), blocks_for((b + 3) / 4, kernels::coll::kThreads),
             params(in, out, count, false, false), stream);
      return;
    case ReduceScatterMethod::kFused:
      launch(kernels_->get(CollKernel::kRsFused, dtype), blocks_for(b, 16 << 10),
             params(in, out, count, s.in_symmetric, s.aligned16), stream);
      return;
    case ReduceScatterMethod::kCe: {
      // Scatter by copy engine, reduce on the SMs behind it: slice p of this rank's input goes to peer
      // p's workspace slot 0 at [me * b] in halving pieces (ce_piece_start, the smallest at least
      // kCePieceBytes), each followed by a flag in peer p's ce_flags_; the reduction kernel adds up
      // piece c as soon as its flags are up. The copies are enqueued before the kernel that waits
      // for them. ce_flags_ is reset before the barrier, after which peers write it (this rank's
      // previous kernel was its last reader).
      const char* src = static_cast<const char*>(in);
      const size_t sz = dtype_size(dtype);
      int pieces = 1;
      while (pieces < static_cast<int>(kCePieces) && (b >> pieces) >= kCePieceBytes) ++pieces;
      TDIST_CUDA_CHECK(cudaMemsetAsync(ce_flags_, 0, kCePieces * n * sizeof(device::u64), stream));
      ce_barrier(stream);
      side_.fork(stream);
      for (int c = 0; c < pieces; ++c) {
        const size_t lo = kernels::coll::ce_piece_start(count, pieces, c);
        const size_t len = kernels::coll::ce_piece_start(count, pieces, c + 1) - lo;
        for (int k = 1; k < n; ++k) {
          const int peer = (me + k) % n;
          if (len > 0)
            TDIST_CUDA_CHECK(cudaMemcpyAsync(heap_.peer_ptr(workspace_ + me * b + lo * sz, peer),
                                             src + peer * b + lo * sz, len * sz, cudaMemcpyDeviceToDevice,
                                             side_.get()));
          stream_write_value64(side_.get(), heap_.peer_ptr(ce_flags_ + c * n + me, peer), 1);
        }
      }
      jit::LaunchConfig cfg;
      cfg.grid = {blocks_for(b, 32 << 10)};
      cfg.block = {static_cast<unsigned>(kernels::coll::kThreads)};
      cfg.stream = stream;
      jit::launch(kernels_->get(CollKernel::kRsCePipelined, dtype), cfg,
                  jit::make_args(params(in, out, count, false, s.aligned16), static_cast<const device::u64*>(ce_flags_),
                                 pieces));
      side_.join(stream);
      return;
    }
    default: TDIST_FAIL("unreachable reduce_scatter method ", to_string(m));
  }
}

}  // namespace tdist
