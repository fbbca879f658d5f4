// The MoE tensor-parallel ops of ops/moe.hpp: AllGather + grouped GEMM (MoeAgGroupGemm) and grouped
// GEMM + top-k weighted reduce + ReduceScatter / AllReduce (MoeGroupGemmRs). docs/moe.md.
//
// Chunked AllGather + grouped GEMM, per call:
//   1. begin_call (flags reset, barrier); the copy engine pushes this rank's tokens to every peer's
//      `gathered`, nearest rank first, each push followed by flags[rank] = 1 on the receiver;
//   2. meanwhile, on the caller's stream, the routing (MoeRouter) sorts the pairs by expert and lists
//      the tiles per source chunk (ag order);
//   3. for j = 0 .. world - 1: wait for chunk (rank + j) (j > 0), grouped GEMM over list j's tiles
//      only, its A rows read from the tokens through the routing's token_of_row (gathered-A grouped
//      GEMM: this rank's tokens from a_local, the others from `gathered`; padding rows zeros).
// List j's tiles need chunks rank .. rank + j only, so list 0 (this rank's tokens) runs while the
// first transfer is under way.
//
// Fused AllGather + grouped GEMM: steps 1 and 2 as chunked, then one persistent grouped GEMM over
// every list in turn (GroupedScheduler's listed walk), whose producer waits before each tile of list
// j > 0 for the chunks of the sources its rows come from (MoeGatherWaitHooks, kernels/gemm/overlap.cuh):
// no launch or flag kernel between lists, and a tile waits for its own sources only. FP8 runs the
// FP8 kernel with the same hooks, which copies a tile's rows and their scales after the waits.
//
// Chunked grouped GEMM + ReduceScatter, per call: begin_call; for step s = 0 .. world - 1 (owner
// rank + s + 1, own tokens last): grouped GEMM over rs list s, then the owner's tokens reduced over
// top-k (weights in fp32) into `staging` and pushed to the owner's `recv` slot by copy engine with a
// flag, beside the next step's GEMM; the last step waits for every peer's flag and sums the
// received partials into its own tokens' reduction (fp32, one pass).
#include <algorithm>

#include "src/ops/nccl_dtype.hpp"
#include "src/ops/overlap/baselines.hpp"
#include "src/ops/overlap/moe_kernels.hpp"
#include "src/ops/overlap/runtime.hpp"
#include "tdist/common/alignment.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/ops/detail/gemm_runtime.hpp"
#include "tdist/ops/detail/overlap_model.hpp"
#include "tdist/ops/grouped_gemm.hpp"
#include "tdist/ops/moe.hpp"
#include "tdist/runtime/symmetric_layout.hpp"

namespace tdist {

using namespace overlap;
namespace km = kernels::moe;

namespace {

// The type of the ops' outputs (and of their runtimes' kernels): FP8 inputs give bf16.
DType moe_out_dtype(const MoeConfig& c) { return c.dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : c.dtype; }

void check_moe_config(const MoeConfig& c, bool by_k, int world_size) {
  if (c.dtype == DType::kFloat8E4M3) {  // the FP8 instances
    if (by_k) TDIST_CHECK_ARG(c.k % 16 == 0, "config.k", "FP8 needs k a multiple of 16 (16-byte e4m3 rows), got ", c.k);
  } else {
    check_overlap_dtype(c.dtype);
  }
  TDIST_CHECK_ARG(c.max_m > 0 && c.max_m < (int64_t{1} << 31), "config.max_m", "expected 0 < max_m < 2^31, got ",
                  c.max_m);
  if (by_k)
    TDIST_CHECK_ARG(c.k > 0 && c.k % 8 == 0 && c.k < (int64_t{1} << 31), "config.k",
                    "expected 0 < k < 2^31 and a multiple of 8, got ", c.k);
  else
    TDIST_CHECK_ARG(c.max_n > 0 && c.max_n % 8 == 0 && c.max_n < (int64_t{1} << 31), "config.max_n",
                    "expected 0 < max_n < 2^31 and a multiple of 8, got ", c.max_n);
  check_moe_routing_args(c.max_m, c.topk, c.experts, world_size, 0);
}

// The grouped GEMM's tile for `tokens` tokens and B = `b` (experts x n x k), chosen for the rows a
// uniform routing gives on average (moe_expected_rows: the routing's own rows are on the device):
// the routing's tiles are kMoeTile rows, so BLOCK_M is 128; bf16 and fp16 with the cluster
// with_b_multicast gives that B, in a walk that keeps each expert's tiles in pairs (the routing's
// pair order) or not (`pair_walk`). `gathered_a`: the GEMM gathers its tokens through the routing
// (the first projection), which narrow tiles wait for (choose_gemm_tile).
GemmTile moe_tile(const MoeConfig& c, int64_t tokens, int64_t n, int64_t k, int num_sms, const void* b, bool pair_walk,
                  bool gathered_a) {
  const int64_t m = std::max<int64_t>(moe_expected_rows(tokens, c.topk, c.experts), km::kMoeTile);
  if (c.dtype == DType::kFloat8E4M3) {
    const GemmTile t = choose_fp8_gemm_tile(m, n, num_sms);
    return t.block_m == static_cast<int>(km::kMoeTile) ? t : GemmTile{128, 128, 128, 6, 1};
  }
  return with_b_multicast(choose_gemm_tile(m, n, k, num_sms, gathered_a, static_cast<int>(km::kMoeTile)), m, b, k,
                          c.dtype, c.experts, pair_walk);
}

// The run options of a grouped GEMM over every tile of routing `r`: in its pair order for a 2-CTA
// cluster.
GroupedGemmRunOptions whole_walk(const GemmTile& tile, const MoeRouting& r) {
  return GroupedGemmRunOptions{.tile = tile, .m_tile_order = tile.cluster_m == 2 ? r.pair_order : nullptr};
}

// FP8 tokens carry one f32 scale per 128 columns.
int64_t moe_scale_blocks(const MoeConfig& c) { return (c.k + 127) / 128; }
size_t moe_token_scale_bytes(const MoeConfig& c) {
  return c.dtype == DType::kFloat8E4M3 ? static_cast<size_t>(moe_scale_blocks(c)) * sizeof(float) : 0;
}

// AllGather + grouped GEMM's symmetric buffers.
struct MoeAgLayout {
  SymmetricLayout layout;
  SymmetricLayout::Region<char> gathered;  // T[max_m][k]: rank r's tokens at RowChunks{m, world}.begin(r)
  SymmetricLayout::Region<char> scales;    // FP8: f32[max_m][KB], the tokens' scales as `gathered` (else
                                           // 16 unused bytes)
  SymmetricLayout::Region<u64> flags;      // u64[world]: flags[r] = 1 once rank r's tokens (and scales)
                                           // have landed
  MoeAgLayout(const MoeConfig& c, int world_size)
      : gathered(layout.add<char>(static_cast<size_t>(c.max_m) * c.k * dtype_size(c.dtype), "moe gathered tokens")),
        scales(layout.add<char>(std::max<size_t>(static_cast<size_t>(c.max_m) * moe_token_scale_bytes(c), 16),
                                "moe gathered token scales")),
        flags(layout.add<u64>(static_cast<size_t>(world_size), "moe gather flags")) {}
};

// Grouped GEMM + ReduceScatter's symmetric buffers.
struct MoeRsLayout {
  SymmetricLayout layout;
  SymmetricLayout::Region<char> recv;  // T[world][ceil(max_m / world)][max_n]: slot s = rank s's partial
                                       // of this rank's tokens
  SymmetricLayout::Region<u64> flags;  // u64[world]: flags[s] = 1 once slot s has landed
  static int64_t slot_rows(const MoeConfig& c, int world_size) { return (c.max_m + world_size - 1) / world_size; }
  MoeRsLayout(const MoeConfig& c, int world_size)
      : recv(layout.add<char>(
            static_cast<size_t>(world_size) * slot_rows(c, world_size) * c.max_n * dtype_size(moe_out_dtype(c)),
            "moe reduce-scatter slots")),
        flags(layout.add<u64>(static_cast<size_t>(world_size), "moe reduce-scatter flags")) {}
};

constexpr size_t kMoeCollectiveBytes = size_t{8} << 20;  // run_all_reduce's tdist AllReduce, NCCL past it

// The FP8 grouped GEMM of the problem `g` describes (its A and B then e4m3, its D bf16), with these
// scales (ops/grouped_gemm.hpp; A's strides 0, 0: row-major).
GroupedGemmFp8Args fp8_problem(const GroupedGemmArgs& g, const float* a_scales, const float* a_scales_local,
                               const float* b_scales, int64_t a_scales_row_stride = 0,
                               int64_t a_scales_kb_stride = 0) {
  return GroupedGemmFp8Args{.a = g.a,
                            .a_scales = a_scales,
                            .a_scales_row_stride = a_scales_row_stride,
                            .a_scales_kb_stride = a_scales_kb_stride,
                            .b = g.b,
                            .b_scales = b_scales,
                            .d = g.d,
                            .offsets = g.offsets,
                            .offsets_type = g.offsets_type,
                            .m = g.m,
                            .n = g.n,
                            .k = g.k,
                            .num_groups = g.num_groups,
                            .a_gather = g.a_gather,
                            .a_scales_local = a_scales_local};
}

// The fused AllGather + grouped GEMM's kernel: the gathered-A grouped GEMM whose tiles wait for
// their sources (bf16 / fp16, and FP8's Fp8GroupedKernel::kGatheredAWaiting). Its instances are the
// shipped tiles of BLOCK_M kMoeTile (moe_tile's), with and without the 2-CTA cluster.
using MoeFusedGemm = detail::GemmRuntime<kg::GatherGroupedScheduler, kg::MoeGatherWaitParams>;

std::vector<jit::CompileRequest> moe_fused_compile_requests() {
  std::vector<jit::CompileRequest> v;
  for (const GemmTile& t : MoeFusedGemm::instance_tiles())
    if (t.block_m == static_cast<int>(km::kMoeTile)) v.push_back(MoeFusedGemm::compile_request(t));
  for (const GemmTile& t : fp8_gemm_tiles())
    if (t.block_m == static_cast<int>(km::kMoeTile))
      v.push_back(grouped_gemm_fp8_compile_request(t, Fp8GroupedKernel::kGatheredAWaiting));
  for (jit::CompileRequest& r : v) r.arch.clear();  // tdist-compile sets it
  return v;
}

TDIST_JIT_REGISTER_KERNELS(moe_fused_gemm, moe_fused_compile_requests);

}  // namespace

OverlapMethod choose_moe_method(int64_t m, int world_size) {
  constexpr int64_t kMinRowsPerRank = 256;
  return world_size > 1 && m / world_size >= kMinRowsPerRank ? OverlapMethod::kChunked : OverlapMethod::kBaseline;
}

namespace {

// The methods an op runs besides auto: chunked and baseline, and fused for AllGather + grouped GEMM
// (`fused_ok`).
bool moe_runs(OverlapMethod m, bool fused_ok) {
  return m == OverlapMethod::kChunked || m == OverlapMethod::kBaseline || (fused_ok && m == OverlapMethod::kFused);
}

// `requested`, or for kAuto TDIST_OVERLAP_METHOD where it names a method the op runs (the dense ops'
// sequential is theirs only), else choose_moe_method.
OverlapMethod resolve_moe_method(OverlapMethod requested, int64_t m, int world_size, const char* op, bool fused_ok) {
  if (requested == OverlapMethod::kAuto) {
    if (auto v = env::get("TDIST_OVERLAP_METHOD")) {
      const OverlapMethod e = parse_overlap_method(*v, "TDIST_OVERLAP_METHOD");
      if (moe_runs(e, fused_ok)) return e;
    }
    return choose_moe_method(m, world_size);
  }
  TDIST_CHECK_ARG(moe_runs(requested, fused_ok), "method", op, " runs auto, ", fused_ok ? "fused, " : "",
                  "chunked or baseline, got ", to_string(requested));
  return requested;
}

// The method a call runs: `resolved` (the requested method, checked), or under auto the winner that
// OverlapRuntime::tune_methods timed for the call's shape class, chunked (and fused where `fused_ok`)
// only where there are peers to overlap. The class holds the sizes that set a MoE call's speed; the
// routing's skew is left out (it varies call to call).
OverlapMethod moe_call_method(OverlapRuntime& rt, const char* op, OverlapMethod requested, OverlapMethod resolved,
                              int64_t m, int64_t n, int64_t k, const MoeConfig& c, bool fused_ok, cudaStream_t stream,
                              const OverlapRuntime::MethodRunner& execute) {
  if (requested != OverlapMethod::kAuto || m == 0 || n == 0) return resolved;
  const int world = rt.size();
  std::vector<OverlapMethod> candidates{OverlapMethod::kBaseline};
  if (world >= 2) candidates.insert(candidates.begin(), OverlapMethod::kChunked);
  if (world >= 2 && fused_ok) candidates.insert(candidates.begin(), OverlapMethod::kFused);
  const std::string shape = detail::concat(op, ",m<=", overlap_m_bucket(m), ",n=", n, ",k=", k, ",experts=", c.experts,
                                           ",topk=", c.topk, ",", to_string(c.dtype), ",ranks=", world);
  return rt.tune_methods(shape, candidates, resolved, stream, execute);
}

}  // namespace

size_t moe_ag_group_gemm_heap_bytes(const MoeConfig& c, int world_size, int num_sms) {
  check_moe_config(c, true, world_size);
  return MoeAgLayout(c, world_size).layout.bytes() + OverlapRuntime::collectives_heap_bytes(1, world_size, num_sms);
}

size_t moe_group_gemm_rs_heap_bytes(const MoeConfig& c, int world_size, int num_sms) {
  check_moe_config(c, false, world_size);
  return MoeRsLayout(c, world_size).layout.bytes() +
         OverlapRuntime::collectives_heap_bytes(kMoeCollectiveBytes, world_size, num_sms);
}

// ---------------------------------------------------------------------------------------------
// AllGather + grouped GEMM

struct MoeAgGroupGemm::Impl {
  static constexpr const char* kOwner = "tdist's MoE AllGather + grouped GEMM";  // fault messages name it
  MoeConfig config;
  MoeAgLayout layout;
  OverlapRuntime rt;
  SymmetricBlock block;
  char* gathered = nullptr;
  float* gathered_scales = nullptr;  // FP8
  u64* flags = nullptr;
  MoeRouter router;
  GroupedGemm gemm;
  MoeFusedGemm fused_gemm;
  detail::Fp8GroupedRuntime fused_fp8_gemm;
  DeviceBuffer plain;         // T[max_m][k]: the baseline's NCCL AllGather output
  DeviceBuffer plain_scales;  // FP8: f32[max_m][KB], the same for the tokens' scales

  Impl(World& world, SymmetricHeap& heap, const MoeConfig& c)
      : config((check_moe_config(c, true, world.world_size()), c)),
        layout(c, world.world_size()),
        // FP8's runtime serves its bf16 output (its own kernels take bf16 or fp16).
        rt(world, heap, moe_out_dtype(c), 1, /*with_addend=*/false, kOwner),
        block(heap, layout.layout, kOwner),
        gathered(block[layout.gathered]),
        gathered_scales(reinterpret_cast<float*>(block[layout.scales])),
        flags(block[layout.flags]),
        router(c.max_m, c.topk, c.experts, world.world_size(), world.rank()),
        fused_gemm(rt.num_sms()),
        fused_fp8_gemm(rt.num_sms()),
        plain(layout.gathered.bytes()),
        plain_scales(layout.scales.bytes()) {}
  ~Impl() { cudaDeviceSynchronize(); }

  bool fp8() const { return config.dtype == DType::kFloat8E4M3; }
  size_t row_bytes() const { return static_cast<size_t>(config.k) * dtype_size(config.dtype); }
  size_t scale_row_bytes() const { return moe_token_scale_bytes(config); }

  void check(const MoeAgGroupGemmArgs& a) const {
    TDIST_CHECK_ARG(a.m >= 0 && a.m <= config.max_m, "m", "expected 0 <= m <= max_m (", config.max_m, "), got ", a.m);
    TDIST_CHECK_ARG(a.n >= 0 && a.n % 8 == 0 && static_cast<int64_t>(config.experts) * a.n < (int64_t{1} << 31), "n",
                    "expected 0 <= n, a multiple of 8 (16-byte rows of d), experts x n < 2^31, got ", a.n);
    if (a.m == 0 || a.n == 0) return;
    const int64_t rows = static_cast<int64_t>(kg::RowChunks{static_cast<u64>(a.m), rt.size()}.rows(rt.rank()));
    check_operand(a.a_local, "a_local", rows > 0);
    TDIST_CHECK_ARG(a.topk_ids != nullptr && is_aligned(a.topk_ids, 4), "topk_ids",
                    "expected a 4-byte aligned device pointer to int32 [m][topk], got ",
                    static_cast<const void*>(a.topk_ids));
    check_operand(a.b, "b", true);
    check_operand(a.d, "d", true);
    if (!fp8()) return;
    TDIST_CHECK_ARG(rows == 0 || (a.a_local_scales != nullptr && is_aligned(a.a_local_scales, 4)), "a_local_scales",
                    "FP8 needs a 4-byte aligned device pointer to f32 [rows][ceil(k / 128)], got ",
                    static_cast<const void*>(a.a_local_scales));
    TDIST_CHECK_ARG(a.b_scales != nullptr && is_aligned(a.b_scales, 4), "b_scales",
                    "FP8 needs a 4-byte aligned device pointer to f32 [experts][ceil(n / 128)][ceil(k / 128)], got ",
                    static_cast<const void*>(a.b_scales));
  }

  OverlapMethod method(const MoeAgGroupGemmArgs& a, OverlapMethod requested) const {
    check(a);
    return resolve_moe_method(requested, a.m, rt.size(),
                              fp8() ? "MoE AllGather + grouped GEMM in FP8" : "MoE AllGather + grouped GEMM",
                              /*fused_ok=*/true);
  }

  // The grouped GEMM over the expert-ordered rows, read from the tokens through the routing's index
  // (`gather`: where the tokens are) rather than from a copy in expert order.
  GroupedGemmArgs gemm_args(const MoeAgGroupGemmArgs& a, const MoeRouting& r, const kg::RowGather& gather) const {
    return GroupedGemmArgs{.b = a.b,
                           .d = a.d,
                           .offsets = r.offsets,
                           .offsets_type = IndexType::kInt32,
                           .m = r.capacity,
                           .n = a.n,
                           .k = config.k,
                           .num_groups = config.experts,
                           .dtype = config.dtype,
                           .a_gather = gather};
  }

  // The grouped GEMM of the rows `g` gathers (FP8: their scales from `scales`, this rank's from
  // `local_scales`) over the tiles `options` lists.
  void run_gemm(const MoeAgGroupGemmArgs& a, const MoeRouting& r, const kg::RowGather& g, const float* scales,
                const float* local_scales, const GroupedGemmRunOptions& options, cudaStream_t stream) {
    if (fp8())
      gemm.run(fp8_problem(gemm_args(a, r, g), scales, local_scales, a.b_scales), stream, options);
    else
      gemm.run(gemm_args(a, r, g), stream, options);
  }

  void run(const MoeAgGroupGemmArgs& a, cudaStream_t stream, OverlapMethod requested) {
    execute(a, stream,
            moe_call_method(rt, "moe_ag_group_gemm", requested, method(a, requested), a.m, a.n, config.k, config,
                            /*fused_ok=*/true, stream, [&](OverlapMethod m, cudaStream_t s) { execute(a, s, m); }));
  }

  void execute(const MoeAgGroupGemmArgs& a, cudaStream_t stream, OverlapMethod method) {
    TDIST_NVTX_RANGE("tdist::MoeAgGroupGemm::run", "m=", a.m, " n=", a.n, " k=", config.k, " experts=", config.experts,
                     " topk=", config.topk, " ", to_string(method));
    const int rank = rt.rank(), world = rt.size();
    const kg::RowChunks rows{static_cast<u64>(a.m), world};
    if (a.m == 0 || a.n == 0) {
      router.route(a.topk_ids, a.m, stream);  // the routing of these (no) tokens, for the second projection
      return;
    }
    const GemmTile tile =
        moe_tile(config, a.m, a.n, config.k, rt.num_sms(), a.b, /*pair_walk=*/method == OverlapMethod::kBaseline,
                 /*gathered_a=*/true);
    kg::RowGather g;
    g.ld_bytes = row_bytes();

    if (method == OverlapMethod::kBaseline) {
      // One rank: the GEMM reads a_local itself (every token is local), no copy through NCCL.
      if (world > 1) {
        nccl_all_gather_rows(a.a_local, plain.get(), rows, config.k, config.dtype, rt.world(), stream);
        if (fp8())
          nccl_all_gather_rows(a.a_local_scales, plain_scales.get(), rows, moe_scale_blocks(config), DType::kFloat32,
                               rt.world(), stream);
      }
      const MoeRouting& r = router.route(a.topk_ids, a.m, stream);
      g.token_of_row = r.token_of_row;
      g.gathered = world > 1 ? plain.get() : a.a_local;
      run_gemm(a, r, g, world > 1 ? static_cast<const float*>(plain_scales.get()) : a.a_local_scales, nullptr,
               whole_walk(tile, r), stream);
      return;
    }

    // Chunked and fused. FP8: each token's scales go first, its rows with the flag after them.
    const size_t local_bytes = rows.rows(rank) * row_bytes();
    char* local = gathered + rows.begin(rank) * row_bytes();
    float* local_scales = gathered_scales + rows.begin(rank) * moe_scale_blocks(config);
    rt.begin_call({{flags, layout.flags.bytes()}}, stream);
    rt.side().fork(stream);
    for (int i = 1; i < world; ++i) {
      const int peer = (rank + i) % world;
      if (fp8() && local_bytes > 0)
        put_async(rt.heap(), local_scales, a.a_local_scales, rows.rows(rank) * scale_row_bytes(), peer,
                  rt.side().get());
      put_signal_async(rt.heap(), local, a.a_local, local_bytes, flags + rank, 1, peer, rt.side().get());
    }
    const MoeRouting& r = router.route(a.topk_ids, a.m, stream);
    g.token_of_row = r.token_of_row;
    g.gathered = gathered;
    g.local = a.a_local;  // this rank's tokens from the caller's rows, not from the pushed copy
    g.local_begin = rows.begin(rank);
    g.local_rows = rows.rows(rank);
    if (method == OverlapMethod::kFused) {
      // Every list in one launch, list 0 (no wait) first; GroupedGemm::run's steps with the hooks.
      const GroupedGemmRunOptions order{.tile = tile,
                                        .m_tile_order = r.ag_order,
                                        .m_tile_count = r.ag_count,
                                        .tile_lists = world,
                                        .tile_list_stride = r.max_tiles};
      const kg::MoeGatherWaitParams wait{flags, r.token_of_row, rows, rank};
      if (fp8()) {
        const GroupedGemmFp8Args args =
            check_grouped_gemm_fp8_args(fp8_problem(gemm_args(a, r, g), gathered_scales, a.a_local_scales, a.b_scales));
        check_fp8_gemm_tile(tile);
        fused_fp8_gemm.launch(
            args, tile,
            detail::grouped_walk(args.offsets, args.offsets_type, args.num_groups, args.m, args.n, tile, order), 0,
            stream, &wait);
      } else {
        const GroupedGemmArgs args = check_grouped_gemm_args(gemm_args(a, r, g));
        fused_gemm.launch(grouped_gemm_problem(args), tile, static_cast<int64_t>(config.experts) * a.n,
                          kg::GatherGroupedScheduler{grouped_gemm_schedule(args, tile, order), g}, wait, 0, stream);
      }
      rt.side().join(stream);
      return;
    }
    for (int j = 0; j < world; ++j) {
      const int source = (rank + j) % world;
      if (j > 0) rt.wait_flags(flags, source, 1, -1, stream);
      run_gemm(a, r, g, gathered_scales, a.a_local_scales,
               GroupedGemmRunOptions{.tile = tile,
                                     .m_tile_order = r.ag_order + static_cast<size_t>(j) * r.max_tiles,
                                     .m_tile_count = r.ag_count + j},
               stream);
    }
    rt.side().join(stream);
  }
};

MoeAgGroupGemm::MoeAgGroupGemm(World& world, SymmetricHeap& heap, const MoeConfig& config)
    : impl_(std::make_unique<Impl>(world, heap, config)) {
  world.barrier("tdist MoeAgGroupGemm ready");
}
MoeAgGroupGemm::~MoeAgGroupGemm() = default;
OverlapMethod MoeAgGroupGemm::method(const MoeAgGroupGemmArgs& args, OverlapMethod requested) const {
  return impl_->method(args, requested);
}
void MoeAgGroupGemm::run(const MoeAgGroupGemmArgs& args, cudaStream_t stream, OverlapMethod method) {
  impl_->run(args, stream, method);
}
const MoeRouting& MoeAgGroupGemm::routing() const { return impl_->router.routing(); }
void MoeAgGroupGemm::check_errors() { impl_->router.check_errors(); }
const MoeConfig& MoeAgGroupGemm::config() const { return impl_->config; }

// ---------------------------------------------------------------------------------------------
// Grouped GEMM + ReduceScatter / AllReduce

struct MoeGroupGemmRs::Impl {
  static constexpr const char* kOwner = "tdist's MoE grouped GEMM + ReduceScatter";  // fault messages name it
  MoeConfig config;
  MoeRsLayout layout;
  OverlapRuntime rt;
  SymmetricBlock block;
  char* recv = nullptr;
  u64* flags = nullptr;
  moe::MoeKernels kernels;
  GroupedGemm gemm;
  // Outputs, reductions and transfers are of type O = moe_out_dtype(config) (bf16 for FP8 inputs).
  DeviceBuffer d_rows;   // O[moe_capacity(max_m)][max_n]: the GEMM's products, expert order
  DeviceBuffer staging;  // O[max_m][max_n]: reduced rows of the peers' tokens (chunked: at their
                         // RowChunks place; baseline and run_all_reduce: every token, the collective's input)

  Impl(World& world, SymmetricHeap& heap, const MoeConfig& c)
      : config((check_moe_config(c, false, world.world_size()), c)),
        layout(c, world.world_size()),
        rt(world, heap, moe_out_dtype(c), kMoeCollectiveBytes, /*with_addend=*/false, kOwner),
        block(heap, layout.layout, kOwner),
        recv(block[layout.recv]),
        flags(block[layout.flags]),
        kernels(moe_out_dtype(c)),
        d_rows(static_cast<size_t>(moe_capacity(c.max_m, c.topk, c.experts)) * c.max_n * dtype_size(moe_out_dtype(c))),
        staging(static_cast<size_t>(c.max_m) * c.max_n * dtype_size(moe_out_dtype(c))) {}
  ~Impl() { cudaDeviceSynchronize(); }

  bool fp8() const { return config.dtype == DType::kFloat8E4M3; }
  DType out() const { return moe_out_dtype(config); }

  void check(const MoeGroupGemmRsArgs& a, bool all_rows) const {
    TDIST_CHECK_ARG(a.m >= 0 && a.m <= config.max_m, "m", "expected 0 <= m <= max_m (", config.max_m, "), got ", a.m);
    TDIST_CHECK_ARG(a.n >= 0 && a.n % 8 == 0 && a.n <= config.max_n, "n", "expected 0 <= n <= max_n (", config.max_n,
                    ") and a multiple of 8, got ", a.n);
    TDIST_CHECK_ARG(a.k > 0 && a.k % 8 == 0 && a.k < (int64_t{1} << 31), "k",
                    "expected 0 < k < 2^31 and a multiple of 8, got ", a.k);
    TDIST_CHECK_ARG(a.routing != nullptr, "routing",
                    "null (expected the routing of these tokens, e.g. "
                    "MoeAgGroupGemm::routing())");
    const MoeRouting& r = *a.routing;
    TDIST_CHECK_ARG(r.m == a.m && r.topk == config.topk && r.experts == config.experts && r.world_size == rt.size() &&
                        r.rank == rt.rank(),
                    "routing", "routes m = ", r.m, ", topk = ", r.topk, ", experts = ", r.experts, " on rank ", r.rank,
                    " of ", r.world_size, "; expected m = ", a.m, ", topk = ", config.topk,
                    ", experts = ", config.experts, " on rank ", rt.rank(), " of ", rt.size());
    if (a.m == 0 || a.n == 0) return;
    const int64_t rows = static_cast<int64_t>(kg::RowChunks{static_cast<u64>(a.m), rt.size()}.rows(rt.rank()));
    check_operand(a.h, "h", true);
    check_operand(a.b, "b", true);
    TDIST_CHECK_ARG(a.topk_weights != nullptr && is_aligned(a.topk_weights, 4), "topk_weights",
                    "expected a 4-byte aligned device pointer to fp32 [m][topk], got ",
                    static_cast<const void*>(a.topk_weights));
    check_operand(a.d, "d", all_rows || rows > 0);
    if (!fp8()) return;
    TDIST_CHECK_ARG(a.k % 16 == 0, "k", "FP8 needs k a multiple of 16 (16-byte e4m3 rows), got ", a.k);
    TDIST_CHECK_ARG(a.h_scales != nullptr && is_aligned(a.h_scales, 4), "h_scales",
                    "FP8 needs a 4-byte aligned device pointer to f32 scales [capacity][ceil(k / 128)], got ",
                    static_cast<const void*>(a.h_scales));
    TDIST_CHECK_ARG(a.b_scales != nullptr && is_aligned(a.b_scales, 4), "b_scales",
                    "FP8 needs a 4-byte aligned device pointer to f32 [experts][ceil(n / 128)][ceil(k / 128)], got ",
                    static_cast<const void*>(a.b_scales));
  }

  OverlapMethod method(const MoeGroupGemmRsArgs& a, OverlapMethod requested) const {
    check(a, false);
    return resolve_moe_method(requested, a.m, rt.size(), "MoE grouped GEMM + ReduceScatter", /*fused_ok=*/false);
  }

  // The grouped GEMM of h's rows into d_rows over the tiles `options` lists (FP8: h and b e4m3 with
  // their scales).
  void run_gemm(const MoeGroupGemmRsArgs& a, const GroupedGemmRunOptions& options, cudaStream_t stream) {
    const GroupedGemmArgs g{.a = a.h,
                            .b = a.b,
                            .d = d_rows.get(),
                            .offsets = a.routing->offsets,
                            .offsets_type = IndexType::kInt32,
                            .m = a.routing->capacity,
                            .n = a.n,
                            .k = a.k,
                            .num_groups = config.experts,
                            .dtype = config.dtype};
    if (fp8())
      gemm.run(fp8_problem(g, a.h_scales, nullptr, a.b_scales, a.h_scales_row_stride, a.h_scales_kb_stride), stream,
               options);
    else
      gemm.run(g, stream, options);
  }

  km::CombineParams combine_params(const MoeGroupGemmRsArgs& a, u64 first_token, u64 tokens, void* out) const {
    km::CombineParams p{};
    p.d_rows = d_rows.get();
    p.row_of_pair = a.routing->row_of_pair;
    p.weights = a.topk_weights;
    p.num_extra = 0;
    p.out = out;
    p.first_token = first_token;
    p.tokens = tokens;
    p.topk = static_cast<u32>(config.topk);
    p.n = static_cast<u32>(a.n);
    return p;
  }

  size_t elem() const { return dtype_size(out()); }

  void run(const MoeGroupGemmRsArgs& a, cudaStream_t stream, OverlapMethod requested) {
    execute(a, stream,
            moe_call_method(rt, "moe_group_gemm_rs", requested, method(a, requested), a.m, a.n, a.k, config,
                            /*fused_ok=*/false, stream, [&](OverlapMethod m, cudaStream_t s) { execute(a, s, m); }));
  }

  void execute(const MoeGroupGemmRsArgs& a, cudaStream_t stream, OverlapMethod method) {
    TDIST_NVTX_RANGE("tdist::MoeGroupGemmRs::run", "m=", a.m, " n=", a.n, " k=", a.k, " experts=", config.experts,
                     " topk=", config.topk, " ", to_string(method));
    if (a.m == 0 || a.n == 0) return;
    const int rank = rt.rank(), world = rt.size();
    const MoeRouting& r = *a.routing;
    const kg::RowChunks rows{static_cast<u64>(a.m), world};
    const GemmTile tile =
        moe_tile(config, a.m, a.n, a.k, rt.num_sms(), a.b, /*pair_walk=*/method == OverlapMethod::kBaseline,
                 /*gathered_a=*/false);

    if (method == OverlapMethod::kBaseline) {
      run_gemm(a, whole_walk(tile, r), stream);
      if (world == 1) {  // one rank: the reduction is the output, no copy through NCCL
        kernels.combine(combine_params(a, 0, static_cast<u64>(a.m), a.d), stream);
        return;
      }
      kernels.combine(combine_params(a, 0, static_cast<u64>(a.m), staging.get()), stream);
      nccl_reduce_scatter_rows(staging.get(), a.d, rows, a.n, out(), rt.world(), stream);
      return;
    }

    // Chunked.
    const size_t slot_bytes = static_cast<size_t>(MoeRsLayout::slot_rows(config, world)) * a.n * elem();
    rt.begin_call({{flags, layout.flags.bytes()}}, stream);
    for (int s = 0; s < world; ++s) {
      const int owner = (rank + s + 1) % world;
      run_gemm(a,
               GroupedGemmRunOptions{.tile = tile,
                                     .m_tile_order = r.rs_order + static_cast<size_t>(s) * r.max_tiles,
                                     .m_tile_count = r.rs_count + s},
               stream);
      if (owner != rank) {
        void* out = byte_at(staging.get(), rows.begin(owner) * a.n * elem());
        kernels.combine(combine_params(a, rows.begin(owner), rows.rows(owner), out), stream);
        rt.side().fork(stream);  // the send waits for this owner's reduction only
        put_signal_async(rt.heap(), recv + static_cast<size_t>(rank) * slot_bytes, out, rows.rows(owner) * a.n * elem(),
                         flags + rank, 1, owner, rt.side().get());
      } else {
        if (world > 1) rt.wait_flags(flags, 0, world, rank, stream);
        km::CombineParams p = combine_params(a, rows.begin(rank), rows.rows(rank), a.d);
        for (int src = 0; src < world; ++src)
          if (src != rank) p.extra[p.num_extra++] = recv + static_cast<size_t>(src) * slot_bytes;
        kernels.combine(p, stream);
      }
    }
    if (world > 1) rt.side().join(stream);
  }

  void run_all_reduce(const MoeGroupGemmRsArgs& a, cudaStream_t stream) {
    check(a, true);
    TDIST_NVTX_RANGE("tdist::MoeGroupGemmRs::run_all_reduce", "m=", a.m, " n=", a.n, " k=", a.k);
    if (a.m == 0 || a.n == 0) return;
    const MoeRouting& r = *a.routing;
    const GemmTile tile = moe_tile(config, a.m, a.n, a.k, rt.num_sms(), a.b, /*pair_walk=*/true, /*gathered_a=*/false);
    run_gemm(a, whole_walk(tile, r), stream);
    if (rt.size() == 1) {
      kernels.combine(combine_params(a, 0, static_cast<u64>(a.m), a.d), stream);
      return;
    }
    kernels.combine(combine_params(a, 0, static_cast<u64>(a.m), staging.get()), stream);
    const size_t count = static_cast<size_t>(a.m) * a.n;
    if (count * elem() <= rt.sequential_max_bytes())
      rt.coll().all_reduce(staging.get(), a.d, count, out(), stream);
    else
      rt.coll().all_reduce(staging.get(), a.d, count, out(), stream, AllReduceMethod::kNccl);
  }
};

MoeGroupGemmRs::MoeGroupGemmRs(World& world, SymmetricHeap& heap, const MoeConfig& config)
    : impl_(std::make_unique<Impl>(world, heap, config)) {
  world.barrier("tdist MoeGroupGemmRs ready");
}
MoeGroupGemmRs::~MoeGroupGemmRs() = default;
OverlapMethod MoeGroupGemmRs::method(const MoeGroupGemmRsArgs& args, OverlapMethod requested) const {
  return impl_->method(args, requested);
}
void MoeGroupGemmRs::run(const MoeGroupGemmRsArgs& args, cudaStream_t stream, OverlapMethod method) {
  impl_->run(args, stream, method);
}
void MoeGroupGemmRs::run_all_reduce(const MoeGroupGemmRsArgs& args, cudaStream_t stream) {
  impl_->run_all_reduce(args, stream);
}
const MoeConfig& MoeGroupGemmRs::config() const { return impl_->config; }

}  // namespace tdist
