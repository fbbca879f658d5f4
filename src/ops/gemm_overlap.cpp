// Host side of AllGatherGemm, GemmReduceScatter and GemmAllReduce (include/tdist/ops/gemm_overlap.hpp).
// Device code: include/tdist/kernels/gemm/overlap.cuh (the GEMM's tile hooks) and overlap_kernels.cuh
// (flag wait, reduction); the GEMM: sm90_gemm.cuh (fused) or cuBLAS (chunked, sequential, baseline).
//
// Every fused or chunked call follows the same frame:
//   1. reset this rank's flags (memset, stream-ordered after this rank's previous call, which was
//      their only reader);
//   2. barrier across ranks (Collectives::barrier): every rank has reset its flags and finished the
//      previous call's reads of the buffers peers are about to write;
//   3. the copy engine moves data on a side stream forked from the caller's, each transfer followed
//      by a flag write into the receiver's memory (stream-ordered after the copy);
//   4. the GEMM (one hooked launch, or one cuBLAS call per row chunk with flag waits between) and
//      the fp32 reduction on the caller's stream; the side stream joins it at the end.
// Flags only go 0 -> 1 within a call, so a CUDA graph replays the same sequence safely.
#include "tdist/ops/gemm_overlap.hpp"

#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/gemm/overlap_params.cuh"
#include "tdist/ops/collectives.hpp"
#include "tdist/ops/cublas.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/runtime/stream.hpp"
#include "src/ops/nccl_dtype.hpp"

namespace tdist {

namespace kg = kernels::gemm;
using detail::nccl_type;
using device::u64;

namespace {

constexpr const char* kNs = "tdist::kernels::gemm::";
// The largest buffer the sequential method hands to Collectives (its workspace is twice this).
constexpr size_t kSequentialMaxBytes = size_t{32} << 20;

// Heap sizes, shared by the contexts' constructors and the *_heap_bytes functions that report them.
// The Collectives of a context serves the sequential method's largest collective, capped.
size_t collectives_bytes(size_t sequential_bytes) {
  return std::max<size_t>(std::min(sequential_bytes, kSequentialMaxBytes), 256);
}
size_t all_gather_sequential_bytes(const AllGatherGemmConfig& c) {
  return static_cast<size_t>(std::max<int64_t>(c.max_m, 1)) * c.k * dtype_size(c.dtype);
}
size_t gathered_bytes(const AllGatherGemmConfig& c) { return static_cast<size_t>(c.max_m) * c.k * dtype_size(c.dtype); }
size_t reduce_scatter_sequential_bytes(const GemmReduceScatterConfig& c) {
  return static_cast<size_t>(std::max<int64_t>(c.max_m, 1)) * std::max<int64_t>(c.max_n, 8) * dtype_size(c.dtype);
}
// Rows of one slot of the ReduceScatter receive buffer: the largest chunk.
int64_t recv_slot_rows(const GemmReduceScatterConfig& c, int world_size) {
  return (c.max_m + world_size - 1) / world_size;
}
size_t recv_bytes(const GemmReduceScatterConfig& c, int world_size) {
  return static_cast<size_t>(world_size) * recv_slot_rows(c, world_size) * c.max_n * dtype_size(c.dtype);
}
// A max_m x max_n matrix: the ReduceScatter core's staging, GemmAllReduce's reduced rows.
size_t output_bytes(const GemmReduceScatterConfig& c) {
  return static_cast<size_t>(c.max_m) * c.max_n * dtype_size(c.dtype);
}
size_t flag_bytes(int world_size) { return static_cast<size_t>(world_size) * sizeof(u64); }
// One flag per (piece, rank): the ReduceScatter and AllReduce exchanges (overlap_row_pieces).
size_t piece_flag_bytes(int world_size) { return kMaxOverlapPieces * flag_bytes(world_size); }
size_t heap_rounded(size_t bytes) {
  const size_t a = SymmetricHeap::kDefaultAlignment;
  return (bytes + a - 1) / a * a;
}

const char* ptr_at(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }
char* ptr_at(void* base, size_t bytes) { return static_cast<char*>(base) + bytes; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_overlap_dtype(DType dtype) {
  TDIST_CHECK_ARG(dtype == DType::kBFloat16 || dtype == DType::kFloat16, "dtype",
                  "the overlap ops take bf16 or fp16, got ", to_string(dtype));
}

void check_operand(const void* p, const char* what, bool needed) {
  if (!needed) return;
  TDIST_CHECK(p != nullptr, "invalid argument '", what, "': null pointer");
  TDIST_CHECK(aligned16(p), "invalid argument '", what, "': must be 16-byte aligned, got ", p);
}

jit::CompileRequest overlap_kernels_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/gemm/overlap_kernels.cuh\"\n";
  r.file_name = "gemm_overlap.cu";
  r.name_expressions = {"tdist_overlap_wait_flags", detail::concat(kNs, "overlap_reduce<__nv_bfloat16>"),
                        detail::concat(kNs, "overlap_reduce<__half>")};
  return r;
}

// A GEMM instance whose tiles run the overlap hooks `hooks` (a type of overlap.cuh).
jit::CompileRequest hooked_gemm_request(const GemmTile& tile, const char* hooks) {
  jit::CompileRequest r = gemm_compile_request(tile, detail::concat(kNs, hooks));
  r.source += "#include \"tdist/kernels/gemm/overlap.cuh\"\n";
  r.file_name = detail::concat("gemm_overlap_", hooks, "_", tile.name(), ".cu");
  return r;
}

constexpr const char* kAllGatherHooks = "AllGatherWaitHooks";
constexpr const char* kPublishHooks = "ChunkPublishHooks";

std::vector<jit::CompileRequest> overlap_compile_requests() {
  std::vector<jit::CompileRequest> v = {overlap_kernels_request()};
  for (const GemmTile& t : gemm_tiles())
    for (const char* hooks : {kAllGatherHooks, kPublishHooks}) v.push_back(hooked_gemm_request(t, hooks));
  for (auto& r : v) r.arch.clear();  // tdist-compile sets it
  return v;
}

TDIST_JIT_REGISTER_KERNELS(gemm_overlap, overlap_compile_requests);

// What the three ops share: the communicator, the collectives (barrier, sequential method), cuBLAS,
// the side stream of the copy engine, the overlap kernels and the hooked GEMM instances.
class OverlapRuntime {
 public:
  // `with_addend`: cuBLAS's D = A x B^T + C too (the ReduceScatter ops' chunked pieces).
  OverlapRuntime(World& world, SymmetricHeap& heap, DType dtype, size_t sequential_bytes, bool with_addend)
      : world_(world), heap_(heap), dtype_(dtype) {
    check_overlap_dtype(dtype);
    TDIST_CHECK(world.world_size() <= kg::kMaxOverlapRanks, "the overlap ops support up to ", kg::kMaxOverlapRanks,
                " ranks, the world has ", world.world_size());
    TDIST_CHECK(world.lsa_size() == world.world_size(),
                "the overlap ops need every rank in one NVLink (LSA) domain; the LSA team has ", world.lsa_size(),
                " of ", world.world_size(), " ranks");
    TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, world.device()));
    coll_ = std::make_unique<Collectives>(world, heap, collectives_bytes(sequential_bytes));
    // cuBLAS now, not at the first chunked or baseline call: creating a handle inside a CUDA-graph
    // capture would fail.
    cublas_ = std::make_unique<CublasGemm>(with_addend);
    module_ = jit::Module::load(jit::compile(overlap_kernels_request()));
    wait_flags_ = module_->kernel("tdist_overlap_wait_flags");
    reduce_bf16_ = module_->kernel(detail::concat(kNs, "overlap_reduce<__nv_bfloat16>"));
    reduce_f16_ = module_->kernel(detail::concat(kNs, "overlap_reduce<__half>"));
  }
  ~OverlapRuntime() { cudaDeviceSynchronize(); }

  World& world() const { return world_; }
  SymmetricHeap& heap() const { return heap_; }
  Collectives& coll() const { return *coll_; }
  int rank() const { return world_.rank(); }
  int size() const { return world_.world_size(); }
  // The copy engine's stream beside the caller's (fork / join within one call).
  SideStream& side() { return side_; }
  size_t sequential_max_bytes() const { return coll_->max_bytes(); }

  CublasGemm& cublas() { return *cublas_; }

  // Waits (one GPU thread, with the device API's timeout) until flags[i] >= 1 for i in
  // [first, first + count), except i == skip (-1: none).
  void wait_flags(const u64* flags, int first, int count, int skip, cudaStream_t stream) {
    jit::LaunchConfig cfg;
    cfg.grid = {1};
    cfg.block = {32};
    cfg.stream = stream;
    jit::launch(wait_flags_, cfg, jit::make_args(flags, first, count, skip));
  }

  void reduce(const kg::ReduceParams& p, cudaStream_t stream) {
    if (p.rows == 0 || p.n == 0) return;  // nothing to receive: the flags are reset by the next call
    const u64 work = p.rows * p.n / 8 + 1;
    jit::LaunchConfig cfg;
    cfg.grid = {static_cast<unsigned>(std::min<u64>((work + 511) / 512, static_cast<u64>(num_sms_) * 2))};
    cfg.block = {512};
    cfg.stream = stream;
    jit::launch(dtype_ == DType::kBFloat16 ? reduce_bf16_ : reduce_f16_, cfg, jit::make_args(p));
  }

  // The persistent GEMM with overlap hooks `hooks_type` whose parameter block is `params`.
  template <typename Params>
  void hooked_gemm(const GemmArgs& args, const GemmTile& tile, const char* hooks_type, const Params& params,
                   int64_t first_row, int max_ctas, cudaStream_t stream) {
    const jit::Kernel& k = hooked_kernel(tile, hooks_type);
    const GemmArgs checked = check_gemm_args(args);
    const kg::TileScheduler sched = gemm_schedule(checked, tile, 8, first_row);
    const jit::LaunchConfig cfg = gemm_launch_config(checked, tile, num_sms_, max_ctas, stream);
    jit::KernelArgs kargs = gemm_kernel_args(checked, tile, sched);
    kargs.add(params);  // the hooks, sm90_gemm_tn's last parameter
    jit::launch(k, cfg, kargs);
  }

  GemmTile tile_for(int64_t m, int64_t n, int64_t k) const { return choose_gemm_tile(m, n, k, num_sms_); }
  int num_sms() const { return num_sms_; }

  // The method a call runs: `requested`, or for kAuto TDIST_OVERLAP_METHOD, else the model's choice;
  // checks that it is possible (`sequential_ok`: equal per-rank counts and small enough).
  OverlapMethod resolve(OverlapMethod requested, const OverlapShape& shape, bool sequential_ok) const {
    OverlapMethod m = requested;
    if (m == OverlapMethod::kAuto) {
      if (auto v = env::get("TDIST_OVERLAP_METHOD")) m = parse_overlap_method(*v, "TDIST_OVERLAP_METHOD");
    }
    if (m == OverlapMethod::kAuto) {
      m = choose_overlap_method(shape);
      if (m == OverlapMethod::kSequential && !sequential_ok) m = OverlapMethod::kBaseline;
      if (m == OverlapMethod::kFused && !fused_ok_) m = OverlapMethod::kChunked;
      return m;
    }
    TDIST_CHECK_ARG(m != OverlapMethod::kSequential || sequential_ok, "method",
                    "'sequential' needs m divisible by the world size (AllGather / ReduceScatter) and at most ",
                    sequential_max_bytes(), " bytes per collective; use auto, chunked or baseline");
    TDIST_CHECK_ARG(m != OverlapMethod::kFused || fused_ok_, "method",
                    "'fused' needs a Hopper GPU (sm_90a) for tdist's GEMM; use auto, chunked or baseline");
    return m;
  }

 private:
  const jit::Kernel& hooked_kernel(const GemmTile& tile, const char* hooks_type) {
    const std::string name = gemm_kernel_name(dtype_, tile, detail::concat(kNs, hooks_type));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = hooked_.find(name);
    if (it != hooked_.end()) return it->second.second;
    auto module = jit::Module::load(jit::compile(hooked_gemm_request(tile, hooks_type)));
    jit::Kernel k = module->kernel(name);
    return hooked_.emplace(name, std::make_pair(module, k)).first->second.second;
  }

  World& world_;
  SymmetricHeap& heap_;
  DType dtype_;
  int num_sms_ = 0;
  bool fused_ok_ = compute_capability(world_.device()) == kGemmComputeCapability;
  std::unique_ptr<Collectives> coll_;
  std::unique_ptr<CublasGemm> cublas_;
  SideStream side_;
  std::shared_ptr<jit::Module> module_;
  jit::Kernel wait_flags_, reduce_bf16_, reduce_f16_;
  std::mutex mu_;
  std::map<std::string, std::pair<std::shared_ptr<jit::Module>, jit::Kernel>> hooked_;
};


// D = A x B^T, dense (leading dimensions = K, K, N).
GemmArgs gemm_problem(const void* a, const void* b, void* d, int64_t m, int64_t n, int64_t k, DType dtype) {
  return GemmArgs{.a = a, .b = b, .d = d, .m = m, .n = n, .k = k, .dtype = dtype};
}

}  // namespace

// ============================================================================================
// Heap footprints (the same sizes the constructors allocate)

size_t all_gather_gemm_heap_bytes(const AllGatherGemmConfig& c, int world_size, int num_sms) {
  return heap_rounded(gathered_bytes(c)) + heap_rounded(flag_bytes(world_size)) +
         Collectives::heap_bytes(world_size, collectives_bytes(all_gather_sequential_bytes(c)), num_sms);
}

size_t gemm_reduce_scatter_heap_bytes(const GemmReduceScatterConfig& c, int world_size, int num_sms) {
  return heap_rounded(recv_bytes(c, world_size)) + heap_rounded(piece_flag_bytes(world_size)) +
         Collectives::heap_bytes(world_size, collectives_bytes(reduce_scatter_sequential_bytes(c)), num_sms);
}

size_t gemm_all_reduce_heap_bytes(const GemmAllReduceConfig& c, int world_size, int num_sms) {
  return gemm_reduce_scatter_heap_bytes(c, world_size, num_sms) + heap_rounded(output_bytes(c)) +
         heap_rounded(piece_flag_bytes(world_size));
}

// ============================================================================================
// Argument checks

void check_all_gather_gemm_args(const AllGatherGemmArgs& a, const AllGatherGemmConfig& c, int world_size, int rank) {
  check_overlap_dtype(c.dtype);
  TDIST_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size, "rank", "expected 0 <= rank < ", world_size,
                  ", got ", rank);
  TDIST_CHECK_ARG(a.m >= 0 && a.m <= c.max_m, "m", "expected 0 <= m <= max_m (", c.max_m, "), got ", a.m);
  TDIST_CHECK_ARG(a.n >= 0 && a.n % 8 == 0 && a.n < (int64_t{1} << 31), "n",
                  "expected 0 <= n < 2^31 and a multiple of 8 (16-byte rows of D), got ", a.n);
  if (a.m == 0 || a.n == 0) return;
  const int64_t rows = static_cast<int64_t>(kg::RowChunks{static_cast<u64>(a.m), world_size}.rows(rank));
  check_operand(a.a_local, "a_local", rows > 0);
  check_operand(a.b, "b", true);
  check_operand(a.d, "d", true);
  if (a.a_gathered) check_operand(a.a_gathered, "a_gathered", true);
}

void check_gemm_reduce_scatter_args(const GemmReduceScatterArgs& a, const GemmReduceScatterConfig& c) {
  check_overlap_dtype(c.dtype);
  TDIST_CHECK_ARG(a.m >= 0 && a.m <= c.max_m, "m", "expected 0 <= m <= max_m (", c.max_m, "), got ", a.m);
  TDIST_CHECK_ARG(a.n >= 0 && a.n <= c.max_n && a.n % 8 == 0, "n", "expected 0 <= n <= max_n (", c.max_n,
                  ") and a multiple of 8 (16-byte rows), got ", a.n);
  TDIST_CHECK_ARG(a.k > 0 && a.k % 8 == 0 && a.k < (int64_t{1} << 31), "k",
                  "expected 0 < k < 2^31 and a multiple of 8 (16-byte TMA rows), got ", a.k);
  if (a.m == 0 || a.n == 0) return;
  check_operand(a.a, "a", true);
  check_operand(a.b, "b", true);
}

void check_gemm_all_reduce_args(const GemmAllReduceArgs& a, const GemmAllReduceConfig& c) {
  GemmReduceScatterArgs rs{a.a, a.b, a.d, a.m, a.n, a.k};
  check_gemm_reduce_scatter_args(rs, c);
  if (a.m > 0 && a.n > 0) check_operand(a.d, "d", true);
}

// ============================================================================================
// AllGatherGemm
//
// Buffers (per context):
//   gathered_   T[max_m][K]   symmetric: the gathered A; rank r's rows at RowChunks{m, world}.begin(r)
//   flags_      u64[world]    symmetric: flags_[r] = 1 once rank r's rows have landed in gathered_
//   plain_      T[max_m][K]   ordinary memory: the baseline's NCCL AllGather output (as a user has it)

struct AllGatherGemm::Impl {
  AllGatherGemmConfig config;
  OverlapRuntime rt;
  char* gathered_ = nullptr;
  u64* flags_ = nullptr;
  DeviceBuffer plain_;

  Impl(World& world, SymmetricHeap& heap, const AllGatherGemmConfig& c)
      : config(c), rt(world, heap, c.dtype, all_gather_sequential_bytes(c), /*with_addend=*/false) {
    TDIST_CHECK_ARG(c.max_m > 0 && c.max_m < (int64_t{1} << 31), "config.max_m", "expected 0 < max_m < 2^31, got ",
                    c.max_m);
    TDIST_CHECK_ARG(c.k > 0 && c.k % 8 == 0 && c.k < (int64_t{1} << 31), "config.k",
                    "expected 0 < k < 2^31 and a multiple of 8, got ", c.k);
    gathered_ = static_cast<char*>(heap.allocate(gathered_bytes(c)));
    flags_ = static_cast<u64*>(heap.allocate(flag_bytes(world.world_size())));
    plain_ = DeviceBuffer(gathered_bytes(c));
  }
  ~Impl() {
    cudaDeviceSynchronize();
    rt.heap().free(flags_);
    rt.heap().free(gathered_);
  }

  kg::RowChunks split(int64_t m) const { return {static_cast<u64>(m), rt.size()}; }
  size_t row_bytes() const { return static_cast<size_t>(config.k) * dtype_size(config.dtype); }

  OverlapMethod method(const AllGatherGemmArgs& a, OverlapMethod requested) const {
    check_all_gather_gemm_args(a, config, rt.size(), rt.rank());
    const bool seq_ok = a.m % rt.size() == 0 && static_cast<size_t>(a.m) * row_bytes() <= rt.sequential_max_bytes();
    return rt.resolve(requested, {OverlapOp::kAllGatherGemm, a.m, a.n, config.k, rt.size(), config.dtype}, seq_ok);
  }

  void run(const AllGatherGemmArgs& a, cudaStream_t stream, OverlapMethod requested) {
    const OverlapMethod method = this->method(a, requested);
    if (a.m == 0 || a.n == 0) return;
    const int rank = rt.rank(), world = rt.size();
    const kg::RowChunks rows = split(a.m);
    const size_t local_bytes = rows.rows(rank) * row_bytes();
    char* local = gathered_ + rows.begin(rank) * row_bytes();
    const DType t = config.dtype;
    const char* source = gathered_;  // the gathered A the GEMM reads

    switch (method) {
      case OverlapMethod::kBaseline: {
        ncclComm_t comm = rt.world().comm();
        if (a.m % world == 0) {
          TDIST_NCCL_CHECK(
              ncclAllGather(a.a_local, plain_.get(), rows.rows(rank) * config.k, nccl_type(t), comm, stream));
        } else {  // unequal rows per rank: one broadcast per root
          TDIST_NCCL_CHECK(ncclGroupStart());
          for (int r = 0; r < world; ++r)
            TDIST_NCCL_CHECK(ncclBroadcast(r == rank ? a.a_local : nullptr,
                                           plain_.get<char>() + rows.begin(r) * row_bytes(), rows.rows(r) * config.k,
                                           nccl_type(t), r, comm, stream));
          TDIST_NCCL_CHECK(ncclGroupEnd());
        }
        rt.cublas().run(gemm_problem(plain_.get(), a.b, a.d, a.m, a.n, config.k, t), stream);
        source = plain_.get<char>();
        break;
      }
      case OverlapMethod::kSequential:
        rt.coll().all_gather(a.a_local, gathered_, rows.rows(rank) * config.k, t, stream);
        rt.cublas().run(gemm_problem(gathered_, a.b, a.d, a.m, a.n, config.k, t), stream);
        break;
      case OverlapMethod::kFused:
      case OverlapMethod::kChunked: {
        // The fused GEMM reads every row from gathered_, so this rank's rows go there first; the
        // chunked GEMMs read them from a_local, and the pushes take them from there too.
        const bool fused = method == OverlapMethod::kFused;
        const void* own = a.a_local;
        if (a.a_local != local && local_bytes > 0 && (fused || a.a_gathered)) {
          TDIST_CUDA_CHECK(cudaMemcpyAsync(local, a.a_local, local_bytes, cudaMemcpyDeviceToDevice, stream));
          own = local;
        }
        TDIST_CUDA_CHECK(cudaMemsetAsync(flags_, 0, world * sizeof(u64), stream));
        rt.coll().barrier(stream);
        // Copy engine: this rank's rows to every peer, nearest rank first, each with its flag.
        rt.side().fork(stream);
        for (int i = 1; i < world; ++i)
          put_signal_async(rt.heap(), local, own, local_bytes, flags_ + rank, 1, (rank + i) % world, rt.side().get());
        if (method == OverlapMethod::kFused) {
          const GemmArgs g = gemm_problem(gathered_, a.b, a.d, a.m, a.n, config.k, t);
          const kg::AllGatherWaitParams p{flags_, rows, rank};
          // The walk starts at this rank's rows (no wait) and wraps through the peers' in rank order.
          rt.hooked_gemm(g, rt.tile_for(a.m, a.n, config.k), kAllGatherHooks, p, static_cast<int64_t>(rows.begin(rank)),
                         0, stream);
        } else {
          for (int i = 0; i < world; ++i) {
            const int r = (rank + i) % world;
            if (i > 0) rt.wait_flags(flags_, r, 1, -1, stream);
            if (rows.rows(r) == 0) continue;
            rt.cublas().run(gemm_problem(r == rank ? own : gathered_ + rows.begin(r) * row_bytes(), a.b,
                                      ptr_at(a.d, rows.begin(r) * a.n * dtype_size(t)), static_cast<int64_t>(rows.rows(r)),
                                      a.n, config.k, t),
                            stream);
          }
        }
        rt.side().join(stream);
        break;
      }
      case OverlapMethod::kAuto: TDIST_FAIL("unresolved method");
    }
    if (a.a_gathered)
      TDIST_CUDA_CHECK(cudaMemcpyAsync(a.a_gathered, source, a.m * row_bytes(), cudaMemcpyDeviceToDevice, stream));
  }
};

AllGatherGemm::AllGatherGemm(World& world, SymmetricHeap& heap, const AllGatherGemmConfig& config)
    : impl_(std::make_unique<Impl>(world, heap, config)) {
  world.barrier("tdist AllGatherGemm ready");
}
AllGatherGemm::~AllGatherGemm() = default;
void AllGatherGemm::run(const AllGatherGemmArgs& args, cudaStream_t stream, OverlapMethod method) {
  impl_->run(args, stream, method);
}
OverlapMethod AllGatherGemm::method(const AllGatherGemmArgs& args, OverlapMethod method) const {
  return impl_->method(args, method);
}
void* AllGatherGemm::local_rows(int64_t m) const {
  TDIST_CHECK_ARG(m >= 0 && m <= impl_->config.max_m, "m", "expected 0 <= m <= max_m (", impl_->config.max_m,
                  "), got ", m);
  return impl_->gathered_ + impl_->split(m).begin(impl_->rt.rank()) * impl_->row_bytes();
}
const AllGatherGemmConfig& AllGatherGemm::config() const { return impl_->config; }

// ============================================================================================
// ReduceScatter core, shared by GemmReduceScatter and GemmAllReduce
//
// Buffers (per context; P = overlap_row_pieces of the call, each owner's rows cut as
// RowChunks{rows(owner), P}):
//   recv_     T[world][cap][N]  symmetric: slot s holds source rank s's partial of this rank's rows
//                               (cap = ceil(max_m / world) rows, row stride N of the call)
//   flags_    u64[P][world]     symmetric: flags_[p * world + s] = 1 once piece p of slot s has landed
//   staging_  T[max_m][max_n]   ordinary: this rank's partial products of the peers' rows (and, with
//                               one piece and the fused method, of its own)
//   counts_   u64[world] chunk_ready, then u32[world] chunk_tiles_done: the fused GEMM's hooks

class ReduceScatterCore {
 public:
  ReduceScatterCore(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& c)
      : config(c), rt(world, heap, c.dtype, reduce_scatter_sequential_bytes(c), /*with_addend=*/true) {
    TDIST_CHECK_ARG(c.max_m > 0 && c.max_m < (int64_t{1} << 31), "config.max_m", "expected 0 < max_m < 2^31, got ",
                    c.max_m);
    TDIST_CHECK_ARG(c.max_n > 0 && c.max_n % 8 == 0 && c.max_n < (int64_t{1} << 31), "config.max_n",
                    "expected 0 < max_n < 2^31 and a multiple of 8, got ", c.max_n);
    const int w = world.world_size();
    cap_rows_ = recv_slot_rows(c, w);
    recv_ = static_cast<char*>(heap.allocate(recv_bytes(c, w)));
    flags_ = static_cast<u64*>(heap.allocate(piece_flag_bytes(w)));
    staging_ = DeviceBuffer(output_bytes(c));
    counts_ = DeviceBuffer(counts_bytes());
  }
  ~ReduceScatterCore() {
    cudaDeviceSynchronize();
    rt.heap().free(flags_);
    rt.heap().free(recv_);
  }

  GemmReduceScatterConfig config;
  OverlapRuntime rt;

  size_t elem() const { return dtype_size(config.dtype); }
  kg::RowChunks split(int64_t m) const { return {static_cast<u64>(m), rt.size()}; }
  char* staging() const { return staging_.get<char>(); }
  char* slot(int source, int64_t n) const { return recv_ + static_cast<size_t>(source) * cap_rows_ * n * elem(); }

  // Called once rows [first, first + count) of this rank's chunk, piece `piece`, are reduced in `out`
  // (stream order on the caller's stream).
  using RowsDone = std::function<void(int piece, u64 first, u64 count)>;

  // Pieces of each rank's rows in a call of `op` (the fused GEMM's chunks are not cut).
  int pieces_of(OverlapOp op, OverlapMethod method, int64_t m, int64_t n, int64_t k) const {
    if (method != OverlapMethod::kChunked) return 1;
    return overlap_row_pieces({op, m, n, k, rt.size(), config.dtype});
  }

  // Fused or chunked: this rank's reduced rows into `out` (row stride n), in `pieces` pieces (the
  // caller's pieces_of). `extra_flags` (count `extra_count`, may be null) are reset with the others
  // before the barrier.
  void run(const void* a, const void* b, int64_t m, int64_t n, int64_t k, OverlapMethod method, int pieces,
           void* out, u64* extra_flags, int extra_count, const RowsDone& rows_done, cudaStream_t stream) {
    const int rank = rt.rank(), world = rt.size();
    const DType t = config.dtype;
    const kg::RowChunks rows = split(m);
    auto* ready = counts_.get<u64>();
    auto* tiles_done = reinterpret_cast<device::u32*>(ready + world);
    TDIST_CUDA_CHECK(cudaMemsetAsync(flags_, 0, pieces * world * sizeof(u64), stream));
    if (extra_flags) TDIST_CUDA_CHECK(cudaMemsetAsync(extra_flags, 0, extra_count * sizeof(u64), stream));
    if (method == OverlapMethod::kFused)
      TDIST_CUDA_CHECK(cudaMemsetAsync(counts_.get(), 0, counts_bytes(), stream));
    rt.coll().barrier(stream);

    auto piece_rows = [&](int owner) { return kg::RowChunks{rows.rows(owner), pieces}; };
    auto row_ptr = [&](auto* base, u64 row) { return ptr_at(base, row * n * elem()); };
    auto rows_gemm = [&](u64 first, u64 count, void* d) {  // rows [first, first + count) of A
      return gemm_problem(ptr_at(a, first * k * elem()), b, d, static_cast<int64_t>(count), n, k, t);
    };
    // This rank's partial of piece p of owner's rows (in staging_) -> owner's slot[rank], then its flag.
    auto send = [&](int owner, int p, cudaStream_t s) {
      const kg::RowChunks sub = piece_rows(owner);
      put_signal_async(rt.heap(), row_ptr(slot(rank, n), sub.begin(p)),
                       row_ptr(staging(), rows.begin(owner) + sub.begin(p)), sub.rows(p) * n * elem(),
                       flags_ + p * world + rank, 1, owner, s);
    };
    kg::ReduceParams rp{};
    rp.n = static_cast<u64>(n);

    if (pieces > 1) {
      // Peers' rows first, piece by piece, each sent as soon as it is computed; then this rank's own
      // pieces, each adding the previous rank's partial (the first to arrive: that rank computes
      // these rows first) in the GEMM's epilogue, and with more than two ranks the other partials
      // in place after it.
      for (int i = 1; i < world; ++i) {
        const int owner = (rank + i) % world;
        const kg::RowChunks sub = piece_rows(owner);
        for (int p = 0; p < pieces; ++p) {
          const u64 first = rows.begin(owner) + sub.begin(p);
          rt.cublas().run(rows_gemm(first, sub.rows(p), row_ptr(staging(), first)), stream);
          rt.side().fork(stream);  // the send waits for this piece's GEMM only
          send(owner, p, rt.side().get());
        }
      }
      const int prev = (rank + world - 1) % world;
      const kg::RowChunks sub = piece_rows(rank);
      for (int p = 0; p < pieces; ++p) {
        rt.wait_flags(flags_, p * world + prev, 1, -1, stream);
        const u64 first = sub.begin(p), count = sub.rows(p);
        void* d = row_ptr(out, first);
        rt.cublas().run_add(rows_gemm(rows.begin(rank) + first, count, d), row_ptr(slot(prev, n), first), stream);
        if (world > 2) {
          rt.wait_flags(flags_, p * world, world, p * world + rank, stream);
          rp.num_sources = 0;
          rp.src[rp.num_sources++] = d;
          for (int s = 0; s < world; ++s)
            if (s != rank && s != prev) rp.src[rp.num_sources++] = row_ptr(slot(s, n), first);
          rp.skip_wait = -1;
          rp.flags = nullptr;
          rp.out = d;
          rp.rows = count;
          rt.reduce(rp, stream);
        }
        rows_done(p, first, count);
      }
      rt.side().join(stream);
      return;
    }

    // One piece: the whole chunk per GEMM, then one fp32 reduction of every source.
    rp.num_sources = world;
    rp.skip_wait = rank;
    rp.flags = flags_;
    for (int s = 0; s < world; ++s) rp.src[s] = slot(s, n);
    if (method == OverlapMethod::kFused) {
      const GemmTile tile = rt.tile_for(m, n, k);
      const kg::ChunkPublishParams hp{tiles_done, ready, rows, static_cast<device::u32>(tile.block_m),
                                      static_cast<device::u32>((n + tile.block_n - 1) / tile.block_n)};
      // The GEMM walks the next rank's rows first and this rank's own last, on every SM but one:
      // there the side stream's flag waits run (a one-thread kernel with the device timeout) and
      // release each peer's rows to the copy engine as soon as their chunk is stored. The GEMM is
      // enqueued first so that nothing of the side stream can sit ahead of it in a shared hardware
      // queue; the side stream still starts from the barrier.
      rt.side().mark(stream);
      rt.hooked_gemm(gemm_problem(a, b, staging(), m, n, k, t), tile, kPublishHooks, hp,
                     static_cast<int64_t>(rows.begin((rank + 1) % world)), std::max(rt.num_sms() - 1, 1), stream);
      rt.side().fork_from_mark();
      for (int i = 1; i < world; ++i) {
        const int owner = (rank + i) % world;
        if (rows.rows(owner) > 0) rt.wait_flags(ready, owner, 1, -1, rt.side().get());
        send(owner, 0, rt.side().get());
      }
      rp.src[rank] = row_ptr(staging(), rows.begin(rank));
    } else {
      for (int i = 1; i <= world; ++i) {
        const int owner = (rank + i) % world;
        void* d = owner == rank ? slot(rank, n) : row_ptr(staging(), rows.begin(owner));
        if (rows.rows(owner) > 0) rt.cublas().run(rows_gemm(rows.begin(owner), rows.rows(owner), d), stream);
        if (owner != rank) {
          rt.side().fork(stream);  // the send waits for this chunk's GEMM only
          send(owner, 0, rt.side().get());
        }
      }
    }
    rp.out = out;
    rp.rows = rows.rows(rank);
    rt.reduce(rp, stream);
    rows_done(0, 0, rows.rows(rank));
    rt.side().join(stream);
  }

 private:
  int64_t cap_rows_ = 0;
  char* recv_ = nullptr;
  u64* flags_ = nullptr;
  DeviceBuffer staging_;
  DeviceBuffer counts_;
  size_t counts_bytes() const { return rt.size() * (sizeof(u64) + sizeof(device::u32)); }
};

// ============================================================================================
// GemmReduceScatter

struct GemmReduceScatter::Impl {
  ReduceScatterCore core;
  Impl(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& c) : core(world, heap, c) {}

  OverlapMethod method(const GemmReduceScatterArgs& a, OverlapMethod requested) const {
    check_gemm_reduce_scatter_args(a, core.config);
    const OverlapRuntime& rt = core.rt;
    const bool seq_ok = a.m % rt.size() == 0 && static_cast<size_t>(a.m) * a.n * core.elem() <= rt.sequential_max_bytes();
    return rt.resolve(requested, {OverlapOp::kGemmReduceScatter, a.m, a.n, a.k, rt.size(), core.config.dtype}, seq_ok);
  }

  void run(const GemmReduceScatterArgs& a, cudaStream_t stream, OverlapMethod requested) {
    const OverlapMethod method = this->method(a, requested);
    if (a.m == 0 || a.n == 0) return;
    OverlapRuntime& rt = core.rt;
    const int rank = rt.rank(), world = rt.size();
    const kg::RowChunks rows = core.split(a.m);
    check_operand(a.d, "d", rows.rows(rank) > 0);
    const DType t = core.config.dtype;
    switch (method) {
      case OverlapMethod::kBaseline: {
        rt.cublas().run(gemm_problem(a.a, a.b, core.staging(), a.m, a.n, a.k, t), stream);
        ncclComm_t comm = rt.world().comm();
        if (a.m % world == 0) {
          TDIST_NCCL_CHECK(
              ncclReduceScatter(core.staging(), a.d, rows.rows(rank) * a.n, nccl_type(t), ncclSum, comm, stream));
        } else {  // unequal rows per rank: one reduce per owner
          TDIST_NCCL_CHECK(ncclGroupStart());
          for (int r = 0; r < world; ++r)
            TDIST_NCCL_CHECK(ncclReduce(core.staging() + rows.begin(r) * a.n * core.elem(), r == rank ? a.d : nullptr,
                                        rows.rows(r) * a.n, nccl_type(t), ncclSum, r, comm, stream));
          TDIST_NCCL_CHECK(ncclGroupEnd());
        }
        break;
      }
      case OverlapMethod::kSequential:
        rt.cublas().run(gemm_problem(a.a, a.b, core.staging(), a.m, a.n, a.k, t), stream);
        rt.coll().reduce_scatter(core.staging(), a.d, rows.rows(rank) * a.n, t, stream);
        break;
      case OverlapMethod::kFused:
      case OverlapMethod::kChunked:
        core.run(a.a, a.b, a.m, a.n, a.k, method,
                 core.pieces_of(OverlapOp::kGemmReduceScatter, method, a.m, a.n, a.k), a.d, nullptr, 0,
                 [](int, u64, u64) {}, stream);
        break;
      case OverlapMethod::kAuto: TDIST_FAIL("unresolved method");
    }
  }
};

GemmReduceScatter::GemmReduceScatter(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& config)
    : impl_(std::make_unique<Impl>(world, heap, config)) {
  world.barrier("tdist GemmReduceScatter ready");
}
GemmReduceScatter::~GemmReduceScatter() = default;
void GemmReduceScatter::run(const GemmReduceScatterArgs& args, cudaStream_t stream, OverlapMethod method) {
  impl_->run(args, stream, method);
}
OverlapMethod GemmReduceScatter::method(const GemmReduceScatterArgs& args, OverlapMethod method) const {
  return impl_->method(args, method);
}
const GemmReduceScatterConfig& GemmReduceScatter::config() const { return impl_->core.config; }

// ============================================================================================
// GemmAllReduce: the ReduceScatter core, whose owner reduces its rows into the symmetric `reduced_`
// piece by piece; as each piece is done the owner raises its flag on every peer and copies it into
// its own D (copy engine), and each peer, done with the same piece of its own rows, pulls it (copy
// engine) while its next piece computes.
//
//   reduced_   T[max_m][max_n]  symmetric: this rank's reduced rows at RowChunks{m, world}.begin(rank)
//   ar_flags_  u64[P][world]    symmetric: ar_flags_[p * world + r] = 1 once piece p of rank r's
//                               reduced rows is readable (P and the pieces as in the core)

struct GemmAllReduce::Impl {
  ReduceScatterCore core;
  char* reduced_ = nullptr;
  u64* ar_flags_ = nullptr;
  SideStream pulls_;  // the peers' pieces, beside the core's side stream (sends, local copies)

  Impl(World& world, SymmetricHeap& heap, const GemmAllReduceConfig& c) : core(world, heap, c) {
    reduced_ = static_cast<char*>(heap.allocate(output_bytes(c)));
    ar_flags_ = static_cast<u64*>(heap.allocate(piece_flag_bytes(world.world_size())));
  }
  ~Impl() {
    cudaDeviceSynchronize();
    core.rt.heap().free(ar_flags_);
    core.rt.heap().free(reduced_);
  }

  OverlapMethod method(const GemmAllReduceArgs& a, OverlapMethod requested) const {
    check_gemm_all_reduce_args(a, core.config);
    const OverlapRuntime& rt = core.rt;
    const bool seq_ok = static_cast<size_t>(a.m) * a.n * core.elem() <= rt.sequential_max_bytes();
    return rt.resolve(requested, {OverlapOp::kGemmAllReduce, a.m, a.n, a.k, rt.size(), core.config.dtype}, seq_ok);
  }

  void run(const GemmAllReduceArgs& a, cudaStream_t stream, OverlapMethod requested) {
    const OverlapMethod method = this->method(a, requested);
    if (a.m == 0 || a.n == 0) return;
    OverlapRuntime& rt = core.rt;
    const int rank = rt.rank(), world = rt.size();
    const DType t = core.config.dtype;
    const size_t count = static_cast<size_t>(a.m) * a.n;
    switch (method) {
      case OverlapMethod::kBaseline:
        rt.cublas().run(gemm_problem(a.a, a.b, a.d, a.m, a.n, a.k, t), stream);
        TDIST_NCCL_CHECK(ncclAllReduce(a.d, a.d, count, nccl_type(t), ncclSum, rt.world().comm(), stream));
        break;
      case OverlapMethod::kSequential:
        rt.cublas().run(gemm_problem(a.a, a.b, core.staging(), a.m, a.n, a.k, t), stream);
        rt.coll().all_reduce(core.staging(), a.d, count, t, stream);
        break;
      case OverlapMethod::kFused:
      case OverlapMethod::kChunked: {
        const kg::RowChunks rows = core.split(a.m);
        const size_t row_bytes = static_cast<size_t>(a.n) * core.elem();
        const size_t own = rows.begin(rank) * row_bytes;
        const int pieces = core.pieces_of(OverlapOp::kGemmAllReduce, method, a.m, a.n, a.k);
        // Piece p of every peer's reduced rows into d: waited for on the caller's stream right after
        // this rank's own piece p (the peers finish theirs about then; a waiting kernel beside the
        // GEMMs would find no free SM), pulled on pulls_ while this rank's next piece runs.
        auto pull = [&](int piece) {
          rt.wait_flags(ar_flags_, piece * world, world, piece * world + rank, stream);
          pulls_.fork(stream);
          for (int i = 1; i < world; ++i) {
            const int r = (rank + i) % world;
            const kg::RowChunks sub{rows.rows(r), pieces};
            const size_t at = (rows.begin(r) + sub.begin(piece)) * row_bytes;
            if (sub.rows(piece) > 0)
              get_async(rt.heap(), ptr_at(a.d, at), reduced_ + at, sub.rows(piece) * row_bytes, r, pulls_.get());
          }
        };
        auto share = [&](int piece, u64 first, u64 n_rows) {
          for (int i = 1; i < world; ++i)
            stream_write_value64(stream, rt.heap().peer_ptr(ar_flags_ + piece * world + rank, (rank + i) % world), 1);
          if (n_rows > 0) {
            rt.side().fork(stream);
            TDIST_CUDA_CHECK(cudaMemcpyAsync(ptr_at(a.d, own + first * row_bytes), reduced_ + own + first * row_bytes,
                                             n_rows * row_bytes, cudaMemcpyDeviceToDevice, rt.side().get()));
          }
          pull(piece);
        };
        core.run(a.a, a.b, a.m, a.n, a.k, method, pieces, reduced_ + own, ar_flags_, kMaxOverlapPieces * world,
                 share, stream);
        pulls_.join(stream);
        break;
      }
      case OverlapMethod::kAuto: TDIST_FAIL("unresolved method");
    }
  }
};

GemmAllReduce::GemmAllReduce(World& world, SymmetricHeap& heap, const GemmAllReduceConfig& config)
    : impl_(std::make_unique<Impl>(world, heap, config)) {
  world.barrier("tdist GemmAllReduce ready");
}
GemmAllReduce::~GemmAllReduce() = default;
void GemmAllReduce::run(const GemmAllReduceArgs& args, cudaStream_t stream, OverlapMethod method) {
  impl_->run(args, stream, method);
}
OverlapMethod GemmAllReduce::method(const GemmAllReduceArgs& args, OverlapMethod method) const {
  return impl_->method(args, method);
}
const GemmAllReduceConfig& GemmAllReduce::config() const { return impl_->core.config; }

}  // namespace tdist
