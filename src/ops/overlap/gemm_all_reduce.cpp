// GemmAllReduce (ops/gemm_overlap.hpp): D = sum_r (A_r x B_r^T) on every rank. The ReduceScatter
// core (overlap/reduce_scatter_core.hpp) reduces each owner's rows into the symmetric `reduced`
// piece by piece; as each piece is done the owner raises its flag on every peer and copies it into
// its own D (copy engine), and each peer, done with the same piece of its own rows, pulls it (copy
// engine) while its next piece computes.
#include "src/ops/overlap/reduce_scatter_core.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/ops/detail/overlap_model.hpp"
#include "tdist/ops/detail/overlap_registry.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/stream.hpp"

namespace tdist {

using namespace overlap;

namespace {

// The symmetric buffers GemmAllReduce adds to its core's (P and the pieces as in the core):
//   reduced   T[max_m][max_n]  this rank's reduced rows at RowChunks{m, world}.begin(rank)
//   ar_flags  u64[P][world]    ar_flags[p * world + r] = 1 once piece p of rank r's reduced rows is
//                              readable
struct AllReduceLayout {
  SymmetricLayout layout;
  SymmetricLayout::Region<char> reduced;
  SymmetricLayout::Region<u64> ar_flags;
  AllReduceLayout(const GemmAllReduceConfig& c, int world_size)
      : reduced(layout.add<char>(static_cast<size_t>(c.max_m) * c.max_n * dtype_size(c.dtype), "reduced")),
        ar_flags(layout.add<u64>(static_cast<size_t>(kMaxOverlapPieces) * world_size, "all-reduce flags")) {}
};

}  // namespace

size_t gemm_all_reduce_heap_bytes(const GemmAllReduceConfig& c, int world_size, int num_sms) {
  return gemm_reduce_scatter_heap_bytes(c, world_size, num_sms) + AllReduceLayout(c, world_size).layout.bytes();
}

void check_gemm_all_reduce_args(const GemmAllReduceArgs& a, const GemmAllReduceConfig& c) {
  check_gemm_reduce_scatter_args({a.a, a.b, a.d, a.m, a.n, a.k}, c);
  if (a.m > 0 && a.n > 0) check_operand(a.d, "d", true);
}

struct GemmAllReduce::Impl {
  static constexpr const char* kOwner = "tdist's GEMM-AllReduce";  // fault messages name it
  ReduceScatterCore core;
  AllReduceLayout layout;
  SymmetricBlock block;
  char* reduced = nullptr;
  u64* ar_flags = nullptr;
  SideStream pulls;  // the peers' pieces, beside the core's side stream (sends, local copies)

  Impl(World& world, SymmetricHeap& heap, const GemmAllReduceConfig& c)
      : core(world, heap, c, kOwner),
        layout(c, world.world_size()),
        block(heap, layout.layout, kOwner),
        reduced(block[layout.reduced]),
        ar_flags(block[layout.ar_flags]) {}
  ~Impl() { cudaDeviceSynchronize(); }

  bool sequential_ok(const GemmAllReduceArgs& a) const {
    return static_cast<size_t>(a.m) * a.n * core.elem() <= core.rt.sequential_max_bytes();
  }

  OverlapMethod method(const GemmAllReduceArgs& a, OverlapMethod requested) const {
    check_gemm_all_reduce_args(a, core.config);
    return core.rt.resolve(requested, OverlapComm::kAllReduceD, a.m, a.n, a.k, sequential_ok(a));
  }

  void run(const GemmAllReduceArgs& a, cudaStream_t stream, OverlapMethod requested) {
    check_gemm_all_reduce_args(a, core.config);
    core.rt.run_call(requested, OverlapComm::kAllReduceD, a.m, a.n, a.k, sequential_ok(a), stream,
                     [&](OverlapMethod m, cudaStream_t s) { execute(a, s, m); });
  }

  void execute(const GemmAllReduceArgs& a, cudaStream_t stream, OverlapMethod method) {
    TDIST_NVTX_RANGE("tdist::GemmAllReduce::run", "m=", a.m, " n=", a.n, " k=", a.k, " ", to_string(core.config.dtype),
                     " ", to_string(method));
    if (a.m == 0 || a.n == 0) return;
    OverlapRuntime& rt = core.rt;
    const int rank = rt.rank(), world = rt.size();
    const DType t = core.config.dtype;
    const size_t count = static_cast<size_t>(a.m) * a.n;
    switch (method) {
      case OverlapMethod::kBaseline:
        rt.cublas().run(gemm_problem(a.a, a.b, a.d, a.m, a.n, a.k, t), stream);
        rt.coll().all_reduce(a.d, a.d, count, t, stream, AllReduceMethod::kNccl);
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
        const int pieces = core.pieces_of(OverlapComm::kAllReduceD, method, a.m, a.n, a.k);
        // Piece p of every peer's reduced rows into d: waited for on the caller's stream right after
        // this rank's own piece p (the peers finish theirs about then; a waiting kernel beside the
        // GEMMs would find no free SM), pulled on `pulls` while this rank's next piece runs.
        auto pull = [&](int piece) {
          rt.wait_flags(ar_flags, piece * world, world, piece * world + rank, stream);
          pulls.fork(stream);
          for (int i = 1; i < world; ++i) {
            const int r = (rank + i) % world;
            const kg::RowChunks sub{rows.rows(r), pieces};
            const size_t at = (rows.begin(r) + sub.begin(piece)) * row_bytes;
            if (sub.rows(piece) > 0)
              get_async(rt.heap(), byte_at(a.d, at), reduced + at, sub.rows(piece) * row_bytes, r, pulls.get());
          }
        };
        auto share = [&](int piece, u64 first, u64 n_rows) {
          for (int i = 1; i < world; ++i)
            stream_write_value64(stream, rt.heap().peer_ptr(ar_flags + piece * world + rank, (rank + i) % world), 1);
          if (n_rows > 0) {
            rt.side().fork(stream);
            TDIST_CUDA_CHECK(cudaMemcpyAsync(byte_at(a.d, own + first * row_bytes), reduced + own + first * row_bytes,
                                             n_rows * row_bytes, cudaMemcpyDeviceToDevice, rt.side().get()));
          }
          pull(piece);
        };
        core.run(a.a, a.b, a.m, a.n, a.k, method, pieces, reduced + own, ar_flags, layout.ar_flags.bytes(), share,
                 stream);
        pulls.join(stream);
        break;
      }
      case OverlapMethod::kAuto: TDIST_FAIL("unresolved method");
    }
  }

  static GemmAllReduceArgs args_of(const OverlapCall& c) {
    return GemmAllReduceArgs{c.operands[0], c.operands[1], c.operands[2], c.m, c.n, c.k};
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
OverlapContextConfig GemmAllReduce::context_config() const {
  const auto& c = impl_->core.config;
  return {.dtype = c.dtype, .max_m = c.max_m, .max_n = c.max_n};
}
OverlapMethod GemmAllReduce::method(const OverlapCall& call, OverlapMethod requested) const {
  return impl_->method(Impl::args_of(call), requested);
}
void GemmAllReduce::run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) {
  impl_->run(Impl::args_of(call), stream, method);
}

namespace {

const OverlapOpTraits& gemm_ar_traits() {
  static const OverlapOpTraits traits{
      .name = "gemm_ar",
      .summary = "D = sum over ranks of (A x B^T) on every rank, each rank holding a K slice",
      .operands = {{"a", Extent::kM, Extent::kK, OperandRole::kInput},
                   {"b", Extent::kN, Extent::kK, OperandRole::kInput},
                   {"d", Extent::kM, Extent::kN, OperandRole::kOutput}},
      .comm = OverlapComm::kAllReduceD,
      .n_multiple = 8,
      .context_by_k = false,
      .context_by_n = true,
      .heap_bytes =
          [](const OverlapContextConfig& c, int world_size, int num_sms) {
            return gemm_all_reduce_heap_bytes({.max_m = c.max_m, .max_n = c.max_n, .dtype = c.dtype}, world_size,
                                              num_sms);
          },
      .create = [](World& world, SymmetricHeap& heap,
                   const OverlapContextConfig& c) -> std::unique_ptr<OverlapContext> {
        return std::make_unique<GemmAllReduce>(world, heap, GemmAllReduceConfig{c.max_m, c.max_n, c.dtype});
      }};
  return traits;
}

TDIST_REGISTER_OVERLAP_OP(gemm_ar, gemm_ar_traits);

}  // namespace

}  // namespace tdist
