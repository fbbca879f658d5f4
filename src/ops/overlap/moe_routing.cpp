// MoE routing: the host reference and checks (ops/moe.hpp), and MoeRouter, which runs the routing
// kernels of kernels/moe/routing.cuh on the GPU. The kernels' module also holds the top-k weighted
// reduce the MoE ops launch (MoeKernels, src/ops/overlap/moe_kernels.hpp).
#include <algorithm>
#include <cmath>

#include "src/ops/overlap/moe_kernels.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/ops/grouped_gemm.hpp"
#include "tdist/ops/moe.hpp"

namespace tdist {

namespace km = kernels::moe;

int64_t moe_capacity(int64_t m, int topk, int experts) {
  return static_cast<int64_t>(km::moe_capacity(static_cast<uint64_t>(std::max<int64_t>(m, 0)),
                                               static_cast<uint32_t>(std::max(topk, 0)),
                                               static_cast<uint32_t>(std::max(experts, 0))));
}
int64_t moe_max_tiles(int64_t m, int topk, int experts) { return moe_capacity(m, topk, experts) / km::kMoeTile; }

int64_t moe_expected_rows(int64_t m, int topk, int experts) {
  if (m <= 0 || topk <= 0 || experts <= 0) return 0;
  const double p = std::min(1.0, static_cast<double>(topk) / experts), mean = m * p;
  const double sd = std::sqrt(m * p * (1 - p)), tile = km::kMoeTile;
  double tiles = 1 - std::pow(1 - p, static_cast<double>(m));  // P(c >= 1)
  for (double j = 1; tile * j < mean + 8 * sd + 1; ++j)         // P(c > 128 j), continuity-corrected
    tiles += sd > 0 ? 0.5 * std::erfc((tile * j + 0.5 - mean) / (sd * std::sqrt(2.0))) : (mean > tile * j ? 1 : 0);
  const auto rows = static_cast<int64_t>(std::llround(experts * tile * tiles));
  return std::min(rows, moe_capacity(m, topk, experts));
}

void check_moe_routing_args(int64_t m, int topk, int experts, int world_size, int rank) {
  TDIST_CHECK_ARG(experts >= 1 && experts <= static_cast<int>(km::kMaxMoeExperts), "experts", "expected 1 .. ",
                  km::kMaxMoeExperts, " experts, got ", experts);
  TDIST_CHECK_ARG(topk >= 1 && topk <= experts, "topk", "expected 1 <= topk <= experts (", experts, "), got ", topk);
  TDIST_CHECK_ARG(world_size >= 1 && world_size <= static_cast<int>(km::kMaxMoeRanks), "world_size", "expected 1 .. ",
                  km::kMaxMoeRanks, " ranks, got ", world_size);
  TDIST_CHECK_ARG(rank >= 0 && rank < world_size, "rank", "expected 0 <= rank < ", world_size, ", got ", rank);
  // Rows and pairs are int32 in the routing buffers.
  TDIST_CHECK_ARG(m >= 0 && moe_capacity(m, topk, experts) < (int64_t{1} << 31), "m",
                  "expected 0 <= m with m x topk + padding < 2^31 rows, got m = ", m);
}

MoeRoutingHost moe_routing_reference(const std::vector<int>& ids, int64_t m, int topk, int experts, int world,
                                     int rank) {
  check_moe_routing_args(m, topk, experts, world, rank);
  TDIST_CHECK_ARG(ids.size() == static_cast<size_t>(m) * topk, "topk_ids", "expected m x topk = ", m * topk,
                  " ids, got ", ids.size());
  const km::RotatedPairs pairs{{static_cast<uint64_t>(m), world}, static_cast<uint32_t>(topk), rank};
  const uint64_t num_pairs = static_cast<uint64_t>(m) * topk;
  MoeRoutingHost r;
  r.counts.assign(experts, 0);
  for (uint64_t i = 0; i < num_pairs; ++i) {
    TDIST_CHECK_ARG(ids[i] >= 0 && ids[i] < experts, "topk_ids", "topk_ids[", i / topk, "][", i % topk, "] = ", ids[i],
                    " is outside [0, ", experts, ") (the number of experts)");
    ++r.counts[ids[i]];
  }
  r.offsets.assign(experts + 1, 0);
  for (int e = 0; e < experts; ++e)
    r.offsets[e + 1] = r.offsets[e] + (r.counts[e] + km::kMoeTile - 1) / km::kMoeTile * km::kMoeTile;
  r.token_of_row.assign(r.offsets[experts], -1);
  r.row_of_pair.assign(num_pairs, -1);
  std::vector<int> next(r.offsets.begin(), r.offsets.end() - 1);
  for (uint64_t q = 0; q < num_pairs; ++q) {  // stable in the rotated order
    const uint64_t t = pairs.token(q);
    const uint32_t k = pairs.slot(q);
    const int row = next[ids[t * topk + k]]++;
    r.token_of_row[row] = static_cast<int>(t);
    r.row_of_pair[t * topk + k] = row;
  }
  // The compact order: the same rows without the padding.
  r.compact_offsets.assign(experts + 1, 0);
  for (int e = 0; e < experts; ++e) r.compact_offsets[e + 1] = r.compact_offsets[e] + r.counts[e];
  r.row_of_compact.assign(num_pairs, -1);
  r.token_of_compact.assign(num_pairs, -1);
  r.pair_of_compact.assign(num_pairs, -1);
  r.compact_of_pair.assign(num_pairs, -1);
  for (int e = 0; e < experts; ++e)
    for (int i = 0; i < r.counts[e]; ++i) {
      const int c = r.compact_offsets[e] + i, row = r.offsets[e] + i;
      r.row_of_compact[c] = row;
      r.token_of_compact[c] = r.token_of_row[row];
    }
  for (uint64_t pair = 0; pair < num_pairs; ++pair) {
    const int row = r.row_of_pair[pair], e = ids[pair];
    const int c = row - r.offsets[e] + r.compact_offsets[e];
    r.pair_of_compact[c] = static_cast<int>(pair);
    r.compact_of_pair[pair] = c;
  }
  r.ag_order.assign(world, {});
  r.rs_order.assign(world, {});
  const uint32_t tiles = static_cast<uint32_t>(r.offsets[experts]) / km::kMoeTile;
  for (uint32_t tile = 0; tile < tiles; ++tile) {
    int ag_key = 0, rs_key = world - 1;
    for (uint32_t i = 0; i < km::kMoeTile; ++i) {
      const int t = r.token_of_row[tile * km::kMoeTile + i];
      if (t < 0) break;
      const int rel = pairs.rel(static_cast<uint64_t>(t));
      ag_key = std::max(ag_key, rel);
      rs_key = std::min(rs_key, km::rs_step(rel, world));
    }
    r.ag_order[ag_key].push_back(tile);
    r.rs_order[rs_key].push_back(tile);
  }
  std::vector<int64_t> tiles_per_expert(experts);
  for (int e = 0; e < experts; ++e) tiles_per_expert[e] = (r.offsets[e + 1] - r.offsets[e]) / km::kMoeTile;
  r.pair_order = grouped_pair_order(tiles_per_expert);
  return r;
}

namespace moe {

std::string MoeKernels::combine_instance(DType dtype) {
  return detail::concat("tdist::kernels::moe::moe_combine<", kernel_type_name(dtype), ">");
}

jit::CompileRequest MoeKernels::compile_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/moe/routing.cuh\"\n#include \"tdist/kernels/moe/combine.cuh\"\n";
  r.file_name = "moe_routing.cu";
  r.name_expressions = {kCount, kBuild};
  for (DType t : {DType::kBFloat16, DType::kFloat16}) r.name_expressions.push_back(combine_instance(t));
  return r;
}

MoeKernels::MoeKernels(DType dtype) : module_(jit::Module::load(jit::compile(compile_request()))) {
  num_sms_ = sm_count(current_device());
  count_ = module_->kernel(kCount);
  build_ = module_->kernel(kBuild);
  if (dtype == DType::kBFloat16 || dtype == DType::kFloat16) combine_ = module_->kernel(combine_instance(dtype));
}

void MoeKernels::route(const km::RouteParams& p, cudaStream_t stream) const {
  jit::LaunchConfig cfg;
  cfg.stream = stream;
  cfg.programmatic_dependent_launch = true;  // every kernel here waits for the one before it on the device
  cfg.block = {km::kRouteThreads};
  cfg.grid = {p.num_segments};
  if (p.num_segments > 0) jit::launch(count_, cfg, jit::make_args(p));
  cfg.grid = {std::max<unsigned>(p.num_segments, 1)};  // no tokens: one block writes empty experts and lists
  jit::launch(build_, cfg, jit::make_args(p));
}

void MoeKernels::combine(const km::CombineParams& p, cudaStream_t stream) const {
  if (p.tokens == 0 || p.n == 0) return;
  jit::LaunchConfig cfg;
  cfg.stream = stream;
  cfg.programmatic_dependent_launch = true;
  cfg.block = {km::kMoeCopyThreads};  // a warp per (token, 32 kCombineCols column vectors)
  cfg.grid = {km::combine_grid(p.tokens, p.n, static_cast<unsigned>(num_sms_))};
  jit::launch(combine_, cfg, jit::make_args(p));
}

namespace {
std::vector<jit::CompileRequest> moe_compile_requests() {
  auto r = MoeKernels::compile_request();
  r.arch.clear();  // tdist-compile sets it
  return {r};
}
}  // namespace
TDIST_JIT_REGISTER_KERNELS(moe, moe_compile_requests);

}  // namespace moe

// Buffers of one router, ordinary device memory, sized for max_m tokens (layouts in routing.cuh).
struct MoeRouter::Impl {
  int64_t max_m;
  int topk, experts, world, rank;
  int64_t capacity, max_tiles;
  uint64_t max_segments;
  moe::MoeKernels kernels;
  DeviceBuffer segment_counts;  // u32[max_segments][E]
  DeviceBuffer offsets, counts, token_of_row, row_of_pair;
  DeviceBuffer ag_order, ag_count, rs_order, rs_count, pair_order;
  DeviceBuffer bad = DeviceBuffer::zeroed(sizeof(km::BadIdRecord));  // routing.cuh
  MoeRouting view;

  // After a synchronisation: throws naming topk_ids when a routing since the last report met an id
  // outside [0, experts), clearing the record for the next one.
  void report_bad_id() {
    km::BadIdRecord r{};
    TDIST_CUDA_CHECK(cudaMemcpy(&r, bad.get(), sizeof(r), cudaMemcpyDeviceToHost));
    if (r.owner == 0) return;
    DeviceBuffer::zero_now(bad.get(), sizeof(r));
    TDIST_CHECK_ARG(false, "topk_ids", "a routing on the device met topk_ids[", r.token, "][", r.slot, "] = ", r.id,
                    ", outside [0, ", experts, ") (the number of experts); its pair was routed to expert 0, so ",
                    "that call's outputs are wrong (the first such id since the last check is reported)");
  }

  // TDIST_MOE_ROUTE_SEGMENT: pairs per segment in place of the model's (route_segment_size), a
  // multiple of kRouteThreads; for measuring the model (bench/moe_routing_segments.py). A router made
  // while it is set sizes its count table for the shortest segments.
  static int64_t forced_segment() {
    const int64_t v = env::integer("TDIST_MOE_ROUTE_SEGMENT", 0, 0, int64_t{1} << 30);
    TDIST_CHECK_ARG(v % km::kRouteThreads == 0, "TDIST_MOE_ROUTE_SEGMENT", "expected a multiple of ", km::kRouteThreads,
                    " (0: the model's size), got ", v);
    return v;
  }

  Impl(int64_t m, int k, int e, int w, int r)
      : max_m(m),
        topk(k),
        experts(e),
        world(w),
        rank(r),
        capacity((check_moe_routing_args(m, k, e, w, r), moe_capacity(m, k, e))),
        max_tiles(std::max<int64_t>(moe_max_tiles(m, k, e), 1)),
        max_segments(forced_segment() > 0
                         ? static_cast<uint64_t>(m) * k / km::kRouteThreads + 1 + w
                         : km::route_max_segments(static_cast<uint64_t>(m) * k, static_cast<uint32_t>(e), w)),
        kernels(DType::kBFloat16),
        segment_counts(static_cast<size_t>(e) * max_segments * 4),
        offsets((e + 1) * sizeof(int)),
        counts(e * sizeof(int)),
        token_of_row(std::max<int64_t>(capacity, 1) * sizeof(int)),
        row_of_pair(std::max<int64_t>(m * k, 1) * sizeof(int)),
        ag_order(static_cast<size_t>(w) * max_tiles * 4),
        ag_count(static_cast<size_t>(w) * 4),
        rs_order(static_cast<size_t>(w) * max_tiles * 4),
        rs_count(static_cast<size_t>(w) * 4),
        pair_order(static_cast<size_t>(max_tiles) * 4) {}
};

MoeRouter::MoeRouter(int64_t max_m, int topk, int experts, int world_size, int rank)
    : impl_(std::make_unique<Impl>(max_m, topk, experts, world_size, rank)) {}
MoeRouter::~MoeRouter() = default;

const MoeRouting& MoeRouter::routing() const { return impl_->view; }

void MoeRouter::check_errors() {
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  impl_->report_bad_id();
}

namespace {
void check_int_array(const int* a, const char* name) {
  if (a == nullptr || reinterpret_cast<uintptr_t>(a) % alignof(int) != 0)
    TDIST_FAIL("invalid argument '", name,
               "': expected a 4-byte aligned device pointer to int32, got ", static_cast<const void*>(a));
}
}  // namespace

const MoeRouting& MoeRouter::route(const int* topk_ids, int64_t m, cudaStream_t stream) {
  Impl& s = *impl_;
  const MoeRoutingArrays own{.offsets = s.offsets.get<int>(), .counts = s.counts.get<int>(),
                             .token_of_row = s.token_of_row.get<int>(), .row_of_pair = s.row_of_pair.get<int>()};
  launch(topk_ids, m, own, stream, /*all_rows=*/false);
  MoeRouting& v = s.view;
  v.offsets = own.offsets;
  v.counts = own.counts;
  v.token_of_row = own.token_of_row;
  v.row_of_pair = own.row_of_pair;
  v.ag_order = s.ag_order.get<uint32_t>();
  v.ag_count = s.ag_count.get<uint32_t>();
  v.rs_order = s.rs_order.get<uint32_t>();
  v.rs_count = s.rs_count.get<uint32_t>();
  v.pair_order = s.pair_order.get<uint32_t>();
  v.m = m;
  v.capacity = moe_capacity(m, s.topk, s.experts);
  v.max_tiles = s.max_tiles;
  v.topk = s.topk;
  v.experts = s.experts;
  v.world_size = s.world;
  v.rank = s.rank;
  return v;
}

void MoeRouter::route_into(const int* topk_ids, int64_t m, const MoeRoutingArrays& out, cudaStream_t stream) {
  // Arrays of no element (no pairs: m = 0) may be null, as empty tensors' pointers are.
  const bool pairs = m > 0;
  check_int_array(out.offsets, "offsets");
  check_int_array(out.counts, "counts");
  if (pairs) {
    check_int_array(out.token_of_row, "token_of_row");
    check_int_array(out.row_of_pair, "row_of_pair");
  }
  if (out.compact_offsets != nullptr) {
    check_int_array(out.compact_offsets, "compact_offsets");
    if (pairs) {
      check_int_array(out.row_of_compact, "row_of_compact");
      check_int_array(out.token_of_compact, "token_of_compact");
      check_int_array(out.pair_of_compact, "pair_of_compact");
      check_int_array(out.compact_of_pair, "compact_of_pair");
    }
  }
  launch(topk_ids, m, out, stream, /*all_rows=*/pairs);
}

void MoeRouter::launch(const int* topk_ids, int64_t m, const MoeRoutingArrays& out, cudaStream_t stream,
                       bool all_rows) {
  Impl& s = *impl_;
  TDIST_CHECK_ARG(m >= 0 && m <= s.max_m, "m", "expected 0 <= m <= max_m (", s.max_m, "), got ", m);
  TDIST_CHECK_ARG(m == 0 || (topk_ids != nullptr && reinterpret_cast<uintptr_t>(topk_ids) % 4 == 0), "topk_ids",
                  "expected a 4-byte aligned device pointer to int32 [m][topk], got ",
                  static_cast<const void*>(topk_ids));
  // The kernels write the padding rows up to offsets[E]; all_rows: the rows past it read -1 too.
  if (all_rows)
    TDIST_CUDA_CHECK(
        cudaMemsetAsync(out.token_of_row, 0xFF, moe_capacity(m, s.topk, s.experts) * sizeof(int), stream));
  km::RouteParams p{};
  p.topk_ids = topk_ids;
  p.bad = s.bad.get<km::BadIdRecord>();
  const km::RotatedPairs pairs{{static_cast<uint64_t>(m), s.world}, static_cast<uint32_t>(s.topk), s.rank};
  const int64_t forced = Impl::forced_segment();
  p.segments = km::RouteSegments{
      pairs, forced > 0 ? static_cast<uint32_t>(forced)
                        : km::route_segment_size(static_cast<uint64_t>(m) * s.topk, static_cast<uint32_t>(s.experts))};
  p.experts = static_cast<uint32_t>(s.experts);
  p.num_segments = p.segments.count();
  TDIST_CHECK_ARG(forced == 0 || p.num_segments <= s.max_segments, "TDIST_MOE_ROUTE_SEGMENT", forced,
                  " pairs per segment make ", p.num_segments, " segments, more than this router's bound ",
                  s.max_segments, " (set the variable before the router is made)");
  TDIST_CHECK(p.num_segments <= s.max_segments, "moe routing: ", p.num_segments, " segments exceed the bound ",
              s.max_segments);
  p.segment_counts = s.segment_counts.get<uint32_t>();
  p.offsets = out.offsets;
  p.counts = out.counts;
  p.token_of_row = out.token_of_row;
  p.row_of_pair = out.row_of_pair;
  p.compact_offsets = out.compact_offsets;
  p.row_of_compact = out.row_of_compact;
  p.token_of_compact = out.token_of_compact;
  p.pair_of_compact = out.pair_of_compact;
  p.compact_of_pair = out.compact_of_pair;
  p.ag_order = s.ag_order.get<uint32_t>();
  p.ag_count = s.ag_count.get<uint32_t>();
  p.rs_order = s.rs_order.get<uint32_t>();
  p.pair_order = s.pair_order.get<uint32_t>();
  p.rs_count = s.rs_count.get<uint32_t>();
  p.max_tiles = static_cast<uint32_t>(s.max_tiles);
  s.kernels.route(p, stream);
}

}  // namespace tdist
