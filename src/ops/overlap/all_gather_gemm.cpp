// AllGatherGemm (ops/gemm_overlap.hpp): D = allgather(A) x B^T. Device code: the GEMM's tile hooks
// AllGatherWaitHooks (kernels/gemm/overlap.cuh); the frame of a call: overlap/runtime.hpp.
#include <cuda_runtime_api.h>

#include "src/ops/overlap/baselines.hpp"
#include "src/ops/overlap/runtime.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/ops/detail/overlap_model.hpp"
#include "tdist/ops/detail/overlap_registry.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/symmetric_layout.hpp"

namespace tdist {

using namespace overlap;

namespace {

// The symmetric buffers of one context:
//   gathered  T[max_m][K]  rank r's rows at RowChunks{m, world}.begin(r)
//   flags     u64[world]   flags[r] = 1 once rank r's rows have landed in gathered
struct AllGatherGemmLayout {
  SymmetricLayout layout;
  SymmetricLayout::Region<char> gathered;
  SymmetricLayout::Region<u64> flags;
  AllGatherGemmLayout(const AllGatherGemmConfig& c, int world_size)
      : gathered(layout.add<char>(checked_rows_bytes(c), "gathered A")),
        flags(layout.add<u64>(static_cast<size_t>(world_size), "flags")) {}
  static size_t checked_rows_bytes(const AllGatherGemmConfig& c) {
    TDIST_CHECK_ARG(c.max_m > 0 && c.max_m < (int64_t{1} << 31), "config.max_m", "expected 0 < max_m < 2^31, got ",
                    c.max_m);
    TDIST_CHECK_ARG(c.k > 0 && c.k % 8 == 0 && c.k < (int64_t{1} << 31), "config.k",
                    "expected 0 < k < 2^31 and a multiple of 8, got ", c.k);
    return static_cast<size_t>(c.max_m) * static_cast<size_t>(c.k) * dtype_size(c.dtype);
  }
};

// The largest collective of the sequential method: the gathered A.
size_t sequential_bytes(const AllGatherGemmConfig& c) {
  return static_cast<size_t>(std::max<int64_t>(c.max_m, 1)) * c.k * dtype_size(c.dtype);
}

}  // namespace

size_t all_gather_gemm_heap_bytes(const AllGatherGemmConfig& c, int world_size, int num_sms) {
  return AllGatherGemmLayout(c, world_size).layout.bytes() +
         OverlapRuntime::collectives_heap_bytes(sequential_bytes(c), world_size, num_sms);
}

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

struct AllGatherGemm::Impl {
  static constexpr const char* kOwner = "tdist's AllGather-GEMM";  // fault messages name it
  AllGatherGemmConfig config;
  AllGatherGemmLayout layout;
  OverlapRuntime rt;
  SymmetricBlock block;
  char* gathered = nullptr;
  u64* flags = nullptr;
  DeviceBuffer plain;  // T[max_m][K], ordinary memory: the baseline's NCCL output (as a user has it)

  Impl(World& world, SymmetricHeap& heap, const AllGatherGemmConfig& c)
      : config(c),
        layout(c, world.world_size()),
        rt(world, heap, c.dtype, sequential_bytes(c), /*with_addend=*/false, kOwner),
        block(heap, layout.layout, kOwner),
        gathered(block[layout.gathered]),
        flags(block[layout.flags]),
        plain(layout.gathered.bytes()) {}
  ~Impl() { cudaDeviceSynchronize(); }

  kg::RowChunks split(int64_t m) const { return {static_cast<u64>(m), rt.size()}; }
  size_t row_bytes() const { return static_cast<size_t>(config.k) * dtype_size(config.dtype); }

  bool sequential_ok(const AllGatherGemmArgs& a) const {
    return a.m % rt.size() == 0 && static_cast<size_t>(a.m) * row_bytes() <= rt.sequential_max_bytes();
  }

  OverlapMethod method(const AllGatherGemmArgs& a, OverlapMethod requested) const {
    check_all_gather_gemm_args(a, config, rt.size(), rt.rank());
    return rt.resolve(requested, OverlapComm::kGatherA, a.m, a.n, config.k, sequential_ok(a));
  }

  void run(const AllGatherGemmArgs& a, cudaStream_t stream, OverlapMethod requested) {
    check_all_gather_gemm_args(a, config, rt.size(), rt.rank());
    rt.run_call(requested, OverlapComm::kGatherA, a.m, a.n, config.k, sequential_ok(a), stream,
                [&](OverlapMethod m, cudaStream_t s) { execute(a, s, m); });
  }

  void execute(const AllGatherGemmArgs& a, cudaStream_t stream, OverlapMethod method) {
    TDIST_NVTX_RANGE("tdist::AllGatherGemm::run", "m=", a.m, " n=", a.n, " k=", config.k, " ", to_string(config.dtype),
                     " ", to_string(method));
    if (a.m == 0 || a.n == 0) return;
    const int rank = rt.rank(), world = rt.size();
    const kg::RowChunks rows = split(a.m);
    const size_t local_bytes = rows.rows(rank) * row_bytes();
    char* local = gathered + rows.begin(rank) * row_bytes();
    const DType t = config.dtype;
    const char* source = gathered;  // the gathered A the GEMM reads

    switch (method) {
      case OverlapMethod::kBaseline:
        nccl_all_gather_rows(a.a_local, plain.get(), rows, config.k, t, rt.world(), stream);
        rt.cublas().run(gemm_problem(plain.get(), a.b, a.d, a.m, a.n, config.k, t), stream);
        source = plain.get<char>();
        break;
      case OverlapMethod::kSequential:
        rt.coll().all_gather(a.a_local, gathered, rows.rows(rank) * config.k, t, stream);
        rt.cublas().run(gemm_problem(gathered, a.b, a.d, a.m, a.n, config.k, t), stream);
        break;
      case OverlapMethod::kFused:
      case OverlapMethod::kChunked: {
        // The fused GEMM reads every row from gathered, so this rank's rows go there first; the
        // chunked GEMMs read them from a_local, and the pushes take them from there too.
        const bool fused = method == OverlapMethod::kFused;
        const void* own = a.a_local;
        if (a.a_local != local && local_bytes > 0 && (fused || a.a_gathered)) {
          TDIST_CUDA_CHECK(cudaMemcpyAsync(local, a.a_local, local_bytes, cudaMemcpyDeviceToDevice, stream));
          own = local;
        }
        rt.begin_call({{flags, layout.flags.bytes()}}, stream);
        // Copy engine: this rank's rows to every peer, nearest rank first, each with its flag.
        rt.side().fork(stream);
        for (int i = 1; i < world; ++i)
          put_signal_async(rt.heap(), local, own, local_bytes, flags + rank, 1, (rank + i) % world, rt.side().get());
        if (fused) {
          const kg::AllGatherWaitParams p{flags, rows, rank};
          // The walk starts at this rank's rows (no wait) and wraps through the peers' in rank order.
          rt.hooked_gemm(gemm_problem(gathered, a.b, a.d, a.m, a.n, config.k, t), rt.tile_for(a.m, a.n, config.k), p,
                         static_cast<int64_t>(rows.begin(rank)), 0, stream);
        } else {
          for (int i = 0; i < world; ++i) {
            const int r = (rank + i) % world;
            if (i > 0) rt.wait_flags(flags, r, 1, -1, stream);
            if (rows.rows(r) == 0) continue;
            rt.cublas().run(gemm_problem(r == rank ? own : gathered + rows.begin(r) * row_bytes(), a.b,
                                         byte_at(a.d, rows.begin(r) * a.n * dtype_size(t)),
                                         static_cast<int64_t>(rows.rows(r)), a.n, config.k, t),
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

  // The catalogue's operands (a_local, b, d, gathered) as the typed arguments.
  static AllGatherGemmArgs args_of(const OverlapCall& c) {
    return AllGatherGemmArgs{c.operands[0], c.operands[1], c.operands[2], c.operands[3], c.m, c.n};
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
  TDIST_CHECK_ARG(m >= 0 && m <= impl_->config.max_m, "m", "expected 0 <= m <= max_m (", impl_->config.max_m, "), got ",
                  m);
  return impl_->gathered + impl_->split(m).begin(impl_->rt.rank()) * impl_->row_bytes();
}
const AllGatherGemmConfig& AllGatherGemm::config() const { return impl_->config; }

OverlapContextConfig AllGatherGemm::context_config() const {
  return {.dtype = impl_->config.dtype, .max_m = impl_->config.max_m, .k = impl_->config.k};
}
OverlapMethod AllGatherGemm::method(const OverlapCall& call, OverlapMethod requested) const {
  TDIST_CHECK_ARG(call.k == impl_->config.k, "k", "this context serves K = ", impl_->config.k, ", got ", call.k);
  return impl_->method(Impl::args_of(call), requested);
}
void AllGatherGemm::run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) {
  TDIST_CHECK_ARG(call.k == impl_->config.k, "k", "this context serves K = ", impl_->config.k, ", got ", call.k);
  impl_->run(Impl::args_of(call), stream, method);
}

// ---------------------------------------------------------------------------------------------
// Catalogue entry

namespace {

const OverlapOpTraits& ag_gemm_traits() {
  static const OverlapOpTraits traits{
      .name = "ag_gemm",
      .summary = "D = allgather(A) x B^T: every rank's rows of A gathered behind the GEMM",
      .operands = {{"a_local", Extent::kRows, Extent::kK, OperandRole::kInput},
                   {"b", Extent::kN, Extent::kK, OperandRole::kInput},
                   {"d", Extent::kM, Extent::kN, OperandRole::kOutput},
                   {"gathered", Extent::kM, Extent::kK, OperandRole::kOptionalOutput}},
      .comm = OverlapComm::kGatherA,
      .n_multiple = 8,
      .context_by_k = true,
      .context_by_n = false,
      .heap_bytes =
          [](const OverlapContextConfig& c, int world_size, int num_sms) {
            return all_gather_gemm_heap_bytes({.max_m = c.max_m, .k = c.k, .dtype = c.dtype}, world_size, num_sms);
          },
      .create = [](World& world, SymmetricHeap& heap,
                   const OverlapContextConfig& c) -> std::unique_ptr<OverlapContext> {
        return std::make_unique<AllGatherGemm>(world, heap, AllGatherGemmConfig{c.max_m, c.k, c.dtype});
      }};
  return traits;
}

TDIST_REGISTER_OVERLAP_OP(ag_gemm, ag_gemm_traits);

}  // namespace

}  // namespace tdist
