// GemmReduceScatter (ops/gemm_overlap.hpp): D = this rank's rows of sum_r (A_r x B_r^T). The
// exchange: overlap/reduce_scatter_core.hpp.
#include "src/ops/overlap/baselines.hpp"
#include "src/ops/overlap/reduce_scatter_core.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/ops/detail/overlap_model.hpp"
#include "tdist/ops/detail/overlap_registry.hpp"
#include "tdist/ops/gemm_overlap.hpp"

namespace tdist {

using namespace overlap;

size_t gemm_reduce_scatter_heap_bytes(const GemmReduceScatterConfig& c, int world_size, int num_sms) {
  return ReduceScatterLayout(c, world_size).layout.bytes() +
         OverlapRuntime::collectives_heap_bytes(reduce_sequential_bytes(c), world_size, num_sms);
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

struct GemmReduceScatter::Impl {
  ReduceScatterCore core;
  Impl(World& world, SymmetricHeap& heap, const GemmReduceScatterConfig& c)
      : core(world, heap, c, "tdist's GEMM-ReduceScatter") {}

  bool sequential_ok(const GemmReduceScatterArgs& a) const {
    const OverlapRuntime& rt = core.rt;
    return a.m % rt.size() == 0 && static_cast<size_t>(a.m) * a.n * core.elem() <= rt.sequential_max_bytes();
  }

  OverlapMethod method(const GemmReduceScatterArgs& a, OverlapMethod requested) const {
    check_gemm_reduce_scatter_args(a, core.config);
    return core.rt.resolve(requested, OverlapComm::kScatterD, a.m, a.n, a.k, sequential_ok(a));
  }

  void run(const GemmReduceScatterArgs& a, cudaStream_t stream, OverlapMethod requested) {
    check_gemm_reduce_scatter_args(a, core.config);
    core.rt.run_call(requested, OverlapComm::kScatterD, a.m, a.n, a.k, sequential_ok(a), stream,
                     [&](OverlapMethod m, cudaStream_t s) { execute(a, s, m); });
  }

  void execute(const GemmReduceScatterArgs& a, cudaStream_t stream, OverlapMethod method) {
    TDIST_NVTX_RANGE("tdist::GemmReduceScatter::run", "m=", a.m, " n=", a.n, " k=", a.k, " ",
                     to_string(core.config.dtype), " ", to_string(method));
    if (a.m == 0 || a.n == 0) return;
    OverlapRuntime& rt = core.rt;
    const int rank = rt.rank();
    const kg::RowChunks rows = core.split(a.m);
    check_operand(a.d, "d", rows.rows(rank) > 0);
    const DType t = core.config.dtype;
    switch (method) {
      case OverlapMethod::kBaseline:
        rt.cublas().run(gemm_problem(a.a, a.b, core.staging(), a.m, a.n, a.k, t), stream);
        nccl_reduce_scatter_rows(core.staging(), a.d, rows, a.n, t, rt.world(), stream);
        break;
      case OverlapMethod::kSequential:
        rt.cublas().run(gemm_problem(a.a, a.b, core.staging(), a.m, a.n, a.k, t), stream);
        rt.coll().reduce_scatter(core.staging(), a.d, rows.rows(rank) * a.n, t, stream);
        break;
      case OverlapMethod::kFused:
      case OverlapMethod::kChunked:
        core.run(
            a.a, a.b, a.m, a.n, a.k, method, core.pieces_of(OverlapComm::kScatterD, method, a.m, a.n, a.k), a.d,
            nullptr, 0, [](int, u64, u64) {}, stream);
        break;
      case OverlapMethod::kAuto: TDIST_FAIL("unresolved method");
    }
  }

  // The catalogue's operands (a, b, d) as the typed arguments.
  static GemmReduceScatterArgs args_of(const OverlapCall& c) {
    return GemmReduceScatterArgs{c.operands[0], c.operands[1], c.operands[2], c.m, c.n, c.k};
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
OverlapContextConfig GemmReduceScatter::context_config() const {
  const auto& c = impl_->core.config;
  return {.dtype = c.dtype, .max_m = c.max_m, .max_n = c.max_n};
}
OverlapMethod GemmReduceScatter::method(const OverlapCall& call, OverlapMethod requested) const {
  return impl_->method(Impl::args_of(call), requested);
}
void GemmReduceScatter::run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) {
  impl_->run(Impl::args_of(call), stream, method);
}

namespace {

const OverlapOpTraits& gemm_rs_traits() {
  static const OverlapOpTraits traits{
      .name = "gemm_rs",
      .summary = "D = this rank's rows of sum over ranks of (A x B^T), each rank holding a K slice",
      .operands = {{"a", Extent::kM, Extent::kK, OperandRole::kInput},
                   {"b", Extent::kN, Extent::kK, OperandRole::kInput},
                   {"d", Extent::kRows, Extent::kN, OperandRole::kOutput}},
      .comm = OverlapComm::kScatterD,
      .n_multiple = 8,
      .context_by_k = false,
      .context_by_n = true,
      .heap_bytes =
          [](const OverlapContextConfig& c, int world_size, int num_sms) {
            return gemm_reduce_scatter_heap_bytes({.max_m = c.max_m, .max_n = c.max_n, .dtype = c.dtype}, world_size,
                                                  num_sms);
          },
      .create = [](World& world, SymmetricHeap& heap,
                   const OverlapContextConfig& c) -> std::unique_ptr<OverlapContext> {
        return std::make_unique<GemmReduceScatter>(world, heap, GemmReduceScatterConfig{c.max_m, c.max_n, c.dtype});
      }};
  return traits;
}

TDIST_REGISTER_OVERLAP_OP(gemm_rs, gemm_rs_traits);

}  // namespace

}  // namespace tdist
