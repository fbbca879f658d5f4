#include "src/ops/overlap/runtime.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_set>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/log.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/ops/detail/overlap_model.hpp"

namespace tdist::overlap {

namespace {

// The largest buffer the sequential method hands to Collectives (its workspace is twice this).
constexpr size_t kSequentialMaxBytes = size_t{32} << 20;

std::string reduce_instance(DType dtype) {
  return detail::concat("tdist::kernels::gemm::overlap_reduce<", kernel_type_name(dtype), ">");
}
constexpr const char* kWaitFlags = "tdist_overlap_wait_flags";

}  // namespace

void check_overlap_dtype(DType dtype) {
  TDIST_CHECK_ARG(dtype == DType::kBFloat16 || dtype == DType::kFloat16, "dtype",
                  "the overlap ops take bf16 or fp16, got ", to_string(dtype));
}

void check_operand(const void* p, const char* what, bool needed) {
  if (!needed) return;
  TDIST_CHECK(p != nullptr, "invalid argument '", what, "': null pointer");
  TDIST_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "invalid argument '", what, "': must be 16-byte aligned, got ",
              p);
}

// ---------------------------------------------------------------------------------------------
// OverlapKernels

jit::CompileRequest OverlapKernels::compile_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/gemm/overlap_kernels.cuh\"\n";
  r.file_name = "gemm_overlap.cu";
  r.name_expressions = {kWaitFlags, reduce_instance(DType::kBFloat16), reduce_instance(DType::kFloat16)};
  return r;
}

OverlapKernels::OverlapKernels(DType dtype) {
  check_overlap_dtype(dtype);
  module_ = jit::Module::load(jit::compile(compile_request()));
  wait_flags_ = module_->kernel(kWaitFlags);
  reduce_ = module_->kernel(reduce_instance(dtype));
}

void OverlapKernels::wait_flags(const u64* flags, int first, int count, int skip, cudaStream_t stream) const {
  jit::LaunchConfig cfg;
  cfg.grid = {1};
  cfg.block = {32};
  cfg.stream = stream;
  jit::launch(wait_flags_, cfg, jit::make_args(flags, first, count, skip));
}

void OverlapKernels::reduce(const kg::ReduceParams& p, int num_sms, cudaStream_t stream) const {
  if (p.rows == 0 || p.n == 0) return;  // nothing to receive: the flags are reset by the next call
  const u64 work = p.rows * p.n / 8 + 1;
  jit::LaunchConfig cfg;
  cfg.grid = {static_cast<unsigned>(std::min<u64>((work + 511) / 512, static_cast<u64>(num_sms) * 2))};
  cfg.block = {512};
  cfg.stream = stream;
  jit::launch(reduce_, cfg, jit::make_args(p));
}

namespace {

std::vector<jit::CompileRequest> overlap_compile_requests() {
  std::vector<jit::CompileRequest> v = {OverlapKernels::compile_request()};
  v.back().arch.clear();  // tdist-compile sets it
  for (auto requests : {detail::HookedGemm<kg::AllGatherWaitParams>::compile_requests(),
                        detail::HookedGemm<kg::ChunkPublishParams>::compile_requests()})
    v.insert(v.end(), requests.begin(), requests.end());
  return v;
}

TDIST_JIT_REGISTER_KERNELS(gemm_overlap, overlap_compile_requests);

}  // namespace

// ---------------------------------------------------------------------------------------------
// OverlapRuntime

size_t OverlapRuntime::collectives_bytes(size_t sequential_bytes) {
  return std::max<size_t>(std::min(sequential_bytes, kSequentialMaxBytes), 256);
}

size_t OverlapRuntime::collectives_heap_bytes(size_t sequential_bytes, int world_size, int num_sms) {
  return Collectives::heap_bytes(world_size, collectives_bytes(sequential_bytes), num_sms);
}

OverlapRuntime::OverlapRuntime(World& world, SymmetricHeap& heap, DType dtype, size_t sequential_bytes,
                               bool with_addend, const std::string& op)
    : world_(world),
      heap_(heap),
      dtype_(dtype),
      num_sms_([&] {
        check_overlap_dtype(dtype);
        return sm_count(world.device());
      }()),
      fused_ok_(compute_capability(world.device()) == kGemmComputeCapability),
      kernels_(dtype),
      gather_gemm_(num_sms_),
      publish_gemm_(num_sms_),
      tune_(env::flag("TDIST_OVERLAP_TUNE", true)) {
  TDIST_CHECK(world.world_size() <= kg::kMaxOverlapRanks, "the overlap ops support up to ", kg::kMaxOverlapRanks,
              " ranks, the world has ", world.world_size());
  TDIST_CHECK(world.lsa_size() == world.world_size(),
              "the overlap ops need every rank in one NVLink (LSA) domain; the LSA team has ", world.lsa_size(), " of ",
              world.world_size(), " ranks");
  CollectivesOptions coll_options;
  coll_options.owner = "the barrier and collectives of " + op;
  coll_ = std::make_unique<Collectives>(world, heap, collectives_bytes(sequential_bytes), coll_options);
  // cuBLAS now, not at the first chunked or baseline call: creating a handle inside a CUDA-graph
  // capture would fail.
  cublas_ = std::make_unique<CublasGemm>(with_addend);
}

OverlapRuntime::~OverlapRuntime() { cudaDeviceSynchronize(); }

void OverlapRuntime::begin_call(std::initializer_list<std::pair<void*, size_t>> flags, cudaStream_t stream) {
  for (const auto& [p, bytes] : flags)
    if (p && bytes) TDIST_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
  coll_->barrier(stream);
}

namespace {

// TDIST_DEBUG=INFO (subsystem TUNE): one line per method that `auto` picks for a new shape class of
// a process: the comm, N, K, dtype, world size and M's power-of-two bucket, and the method picked,
// so that a varying M prints a line per bucket and per change of method, not per call.
void log_auto_choice(OverlapComm comm, int64_t m, int64_t n, int64_t k, DType dtype, int world, OverlapMethod method,
                     const char* source) {
  if (!log::enabled(log::Level::kInfo, "TUNE")) return;
  int m_bucket = 0;
  while (m_bucket < 63 && (int64_t{1} << m_bucket) < m) ++m_bucket;
  const std::string key = detail::concat(to_string(comm), ",", n, ",", k, ",", to_string(dtype), ",", world, ",",
                                         m_bucket, ",", to_string(method), ",", source);
  static std::mutex mu;
  static std::unordered_set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(key).second) return;
  }
  TDIST_INFO(TUNE, "overlap ", to_string(comm), " m=", m, " n=", n, " k=", k, " ", to_string(dtype), " ranks=", world,
             ": method ", to_string(method), " (auto, from ", source, ")");
}

}  // namespace

std::string OverlapRuntime::shape_class(OverlapComm comm, int64_t m, int64_t n, int64_t k) const {
  return detail::concat(to_string(comm), ",m<=", overlap_m_bucket(m), ",n=", n, ",k=", k, ",", to_string(dtype_),
                        ",ranks=", size());
}

bool OverlapRuntime::tuned_winner(const std::string& shape, OverlapMethod& method) const {
  std::lock_guard<std::mutex> lock(tuned_mu_);
  auto it = tuned_.find(shape);
  if (it == tuned_.end()) return false;
  method = it->second;
  return true;
}

OverlapMethod OverlapRuntime::choose(OverlapMethod requested, OverlapComm comm, int64_t m, int64_t n, int64_t k,
                                     bool sequential_ok, cudaStream_t stream, const MethodRunner& run) {
  if (requested != OverlapMethod::kAuto || m == 0 || n == 0 || !tune_ || env::get("TDIST_OVERLAP_METHOD"))
    return resolve(requested, comm, m, n, k, sequential_ok);
  // Every call after a class's first: one shape string and one lookup.
  const std::string shape = shape_class(comm, m, n, k);
  OverlapMethod winner;
  if (tuned_winner(shape, winner)) return winner;
  std::vector<OverlapMethod> candidates;
  if (fused_ok_) candidates.push_back(OverlapMethod::kFused);
  candidates.push_back(OverlapMethod::kChunked);
  if (sequential_ok) candidates.push_back(OverlapMethod::kSequential);
  candidates.push_back(OverlapMethod::kBaseline);
  return tune_methods(shape, candidates, resolve(requested, comm, m, n, k, sequential_ok), stream, run);
}

OverlapMethod OverlapRuntime::tune_methods(const std::string& shape, const std::vector<OverlapMethod>& candidates,
                                           OverlapMethod fallback, cudaStream_t stream, const MethodRunner& run) {
  if (!tune_ || candidates.size() < 2 || env::get("TDIST_OVERLAP_METHOD")) return fallback;
  OverlapMethod winner;
  if (tuned_winner(shape, winner)) return winner;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TDIST_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return fallback;

  jit::TuneRequest req;
  req.kernel = "tdist.overlap_method.v1";
  req.shape_class = shape;
  for (OverlapMethod c : candidates) req.configs.push_back({to_string(c), {{"method", static_cast<int64_t>(c)}}});
  req.launch = [&](const jit::TuneConfig& c, int, cudaStream_t s) {
    run(static_cast<OverlapMethod>(c.params.at("method")), s);
  };
  req.stream = stream;
  req.warmup = 2;
  req.repeat = 7;
  if (!tuner_)
    tuner_ = std::make_unique<jit::Autotuner>(
        "", jit::Autotuner::Timer{},
        [this](const std::vector<double>& v) { return world_.max_across_ranks("tdist overlap method tuning", v); });
  {
    // The candidates' nested collective calls (sequential) are not compared one by one while timed.
    const ScopedCallCheckMode checks_off(world_, CallCheckMode::kOff);
    winner = static_cast<OverlapMethod>(tuner_->tune(req).params.at("method"));
  }
  TDIST_INFO(TUNE, "overlap ", shape, ": method ", to_string(winner), " (auto, timed on this machine; untimed it is ",
             to_string(fallback), ")");
  std::lock_guard<std::mutex> lock(tuned_mu_);
  tuned_[shape] = winner;
  return winner;
}

void OverlapRuntime::check_call(OverlapComm comm, int64_t m, int64_t n, int64_t k, OverlapMethod method,
                                cudaStream_t stream) const {
  // The method asked for, not the one chosen: choosing may time candidates with the other ranks,
  // which must not start on mismatched calls (auto's choice follows from the compared fields, the
  // settings Collectives and the tuner agree on, and the timed winners the ranks agree on).
  const uint64_t key = CallKey("overlap")
                           .add(static_cast<int>(comm))
                           .add(m)
                           .add(n)
                           .add(k)
                           .add(static_cast<int>(dtype_))
                           .add(static_cast<int>(method))
                           .value();
  world_.check_same_call(key, stream, [&] {
    return detail::concat("overlap ", to_string(comm), "(m=", m, ", n=", n, ", k=", k, ", ", to_string(dtype_),
                          ", method ", to_string(method), ")");
  });
}

OverlapMethod OverlapRuntime::resolve(OverlapMethod requested, OverlapComm comm, int64_t m, int64_t n, int64_t k,
                                      bool sequential_ok) const {
  OverlapMethod method = requested;
  if (method == OverlapMethod::kAuto) {
    if (auto v = env::get("TDIST_OVERLAP_METHOD")) method = parse_overlap_method(*v, "TDIST_OVERLAP_METHOD");
    if (method != OverlapMethod::kAuto) log_auto_choice(comm, m, n, k, dtype_, size(), method, "TDIST_OVERLAP_METHOD");
  }
  if (method == OverlapMethod::kAuto && tune_ && tuned_winner(shape_class(comm, m, n, k), method)) return method;
  if (method == OverlapMethod::kAuto) {
    method = choose_overlap_method({comm, m, n, k, size(), dtype_});
    const char* source = "the performance model";
    if (method == OverlapMethod::kSequential && !sequential_ok) {
      method = OverlapMethod::kBaseline;
      source = "the performance model; sequential does not fit here";
    }
    if (method == OverlapMethod::kFused && !fused_ok_) {
      method = OverlapMethod::kChunked;
      source = "the performance model; fused needs sm_90a";
    }
    log_auto_choice(comm, m, n, k, dtype_, size(), method, source);
    return method;
  }
  TDIST_CHECK_ARG(method != OverlapMethod::kSequential || sequential_ok, "method",
                  "'sequential' needs m divisible by the world size (AllGather / ReduceScatter) and at most ",
                  sequential_max_bytes(), " bytes per collective; use auto, chunked or baseline");
  TDIST_CHECK_ARG(method != OverlapMethod::kFused || fused_ok_, "method",
                  "'fused' needs a Hopper GPU (sm_90a) for tdist's GEMM; use auto, chunked or baseline");
  return method;
}

}  // namespace tdist::overlap
