// Host side of tdist::GroupedGemm (include/tdist/ops/grouped_gemm.hpp): argument checks, schedule,
// JIT instances (GemmRuntime over GroupedScheduler), launch. Kernel: kernels/gemm/sm90_gemm.cuh with
// kernels/gemm/grouped_scheduler.cuh; design: docs/gemm.md.
#include "tdist/ops/grouped_gemm.hpp"

#include <algorithm>

#include "tdist/common/alignment.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/gemm/grouped_pair_order.cuh"
#include "tdist/ops/detail/gemm_runtime.hpp"

namespace tdist {

namespace kg = kernels::gemm;

namespace {

using GroupedRuntime = detail::GemmRuntime<kg::GroupedScheduler, kg::NoTileHooks>;
using GatherRuntime = detail::GemmRuntime<kg::GatherGroupedScheduler, kg::NoTileHooks>;

const std::string kPairOrderKernel =
    detail::concat("tdist::kernels::gemm::grouped_pair_order<", kg::kPairOrderThreads, ">");

jit::CompileRequest pair_order_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/gemm/grouped_pair_order.cuh\"\n";
  r.file_name = "grouped_pair_order.cu";
  r.name_expressions = {kPairOrderKernel};
  return r;
}

}  // namespace

// The pair-order kernel (kernels/gemm/grouped_pair_order.cuh): one block before a clustered walk.
class detail::PairOrderKernel {
 public:
  PairOrderKernel() : module_(jit::Module::load(jit::compile(pair_order_request()))) {
    kernel_ = module_->kernel(kPairOrderKernel);
  }
  void launch(const kg::GroupedScheduler& plain_walk, uint32_t* order, cudaStream_t stream) const {
    jit::LaunchConfig cfg;
    cfg.grid = {1};
    cfg.block = {kg::kPairOrderThreads};
    cfg.stream = stream;
    jit::launch(kernel_, cfg, jit::make_args(plain_walk, order));
  }

 private:
  std::shared_ptr<jit::Module> module_;
  jit::Kernel kernel_;
};

std::vector<uint32_t> grouped_pair_order(const std::vector<int64_t>& tiles_per_group) {
  std::vector<uint32_t> pairs, lone;
  uint32_t first = 0;
  for (size_t g = 0; g < tiles_per_group.size(); ++g) {
    TDIST_CHECK_ARG(tiles_per_group[g] >= 0, "tiles_per_group", "group ", g, " has ", tiles_per_group[g], " tiles");
    const auto count = static_cast<uint32_t>(tiles_per_group[g]);
    for (uint32_t i = 0; i + 1 < count; i += 2) pairs.insert(pairs.end(), {first + i, first + i + 1});
    if (count % 2 == 1) lone.push_back(first + count - 1);
    first += count;
  }
  pairs.insert(pairs.end(), lone.begin(), lone.end());
  return pairs;
}

GroupedGemmArgs check_grouped_gemm_args(const GroupedGemmArgs& in) {
  GroupedGemmArgs a = in;
  if (a.a_gather) {
    // A is read through the index: `a` and lda only shape the (unread) A tensor map.
    const kg::RowGather& g = *a.a_gather;
    a.a = g.gathered;
    a.lda = a.k;
    if (a.m > 0 && a.n > 0) detail::check_row_gather(g, a.k * static_cast<int64_t>(dtype_size(a.dtype)));
  }
  // The group count first (a scalar), so that it is named whatever the pointers are.
  TDIST_CHECK_ARG(a.num_groups >= 1, "num_groups", "expected at least one group, got ", a.num_groups);
  // The dense GEMM's checks of the fields both share (M is M_total), leading dimensions filled in.
  const GemmArgs dense = check_gemm_args(grouped_gemm_problem(a));
  a.lda = dense.lda;
  a.ldb = dense.ldb;
  a.ldd = dense.ldd;
  detail::check_grouped_offsets(a.num_groups, a.m, a.n, a.offsets, a.offsets_type);
  return a;
}

void detail::check_row_gather(const kg::RowGather& g, int64_t row_bytes) {
  TDIST_CHECK_ARG(g.token_of_row != nullptr && is_aligned(g.token_of_row, 4), "a_gather.token_of_row",
                  "expected a 4-byte aligned device pointer to int32 [m], got ",
                  static_cast<const void*>(g.token_of_row));
  TDIST_CHECK_ARG(g.gathered != nullptr && is_aligned(g.gathered, 16), "a_gather.gathered",
                  "expected a 16-byte aligned device pointer, got ", g.gathered);
  TDIST_CHECK_ARG(g.local_rows == 0 || (g.local != nullptr && is_aligned(g.local, 16)), "a_gather.local",
                  "expected a 16-byte aligned device pointer for ", g.local_rows, " local rows, got ", g.local);
  TDIST_CHECK_ARG(g.ld_bytes % 16 == 0 && static_cast<int64_t>(g.ld_bytes) >= row_bytes, "a_gather.ld_bytes",
                  "expected a multiple of 16 bytes of at least k elements (", row_bytes, " bytes), got ", g.ld_bytes);
}

void detail::check_grouped_offsets(int num_groups, int64_t m, int64_t n, const void* offsets, IndexType offsets_type) {
  // B is a (G N) x K matrix addressed with 32-bit row coordinates.
  TDIST_CHECK_ARG(static_cast<int64_t>(num_groups) * std::max<int64_t>(n, 1) <= kGemmMaxDim, "num_groups",
                  "num_groups x n must be < 2^31 (rows of B), got ", num_groups, " x ", n);
  TDIST_CHECK_ARG(offsets_type == IndexType::kInt32 || offsets_type == IndexType::kInt64, "offsets_type",
                  "expected kInt32 or kInt64");
  if (m == 0 || n == 0) return;  // nothing to compute; pointers may be anything
  TDIST_CHECK_ARG(offsets != nullptr, "offsets", "null pointer (expected num_groups + 1 row offsets in device memory)");
  const size_t offset_bytes = offsets_type == IndexType::kInt64 ? 8 : 4;
  TDIST_CHECK_ARG(is_aligned(offsets, offset_bytes), "offsets", "must be aligned to its ", offset_bytes,
                  "-byte elements, got ", offsets);
}

GemmArgs grouped_gemm_problem(const GroupedGemmArgs& a) { return detail::grouped_operands(a, a.dtype); }

kg::GroupedScheduler detail::grouped_walk(const void* offsets, IndexType offsets_type, int num_groups, int64_t m,
                                          int64_t n, const GemmTile& tile, const GroupedGemmRunOptions& options) {
  TDIST_CHECK_ARG(options.group_m >= 1, "group_m", "expected >= 1, got ", options.group_m);
  TDIST_CHECK_ARG(options.first_row >= 0, "first_row", "expected >= 0, got ", options.first_row);
  TDIST_CHECK_ARG(is_aligned(options.m_tile_order, 4), "m_tile_order", "must be 4-byte aligned, got ",
                  static_cast<const void*>(options.m_tile_order));
  TDIST_CHECK_ARG(options.tile_lists >= 1 && options.tile_lists <= static_cast<int>(kg::GroupedScheduler::kMaxLists),
                  "tile_lists", "expected 1 to ", kg::GroupedScheduler::kMaxLists, " lists, got ", options.tile_lists);
  if (options.tile_lists > 1) {
    TDIST_CHECK_ARG(options.m_tile_order != nullptr && options.m_tile_count != nullptr, "m_tile_order",
                    "tile_lists > 1 needs both m_tile_order (the lists) and m_tile_count (one count per list)");
    TDIST_CHECK_ARG(options.tile_list_stride > 0 && options.tile_list_stride < (int64_t{1} << 32), "tile_list_stride",
                    "expected 0 < stride < 2^32 entries with tile_lists > 1, got ", options.tile_list_stride);
    TDIST_CHECK_ARG(is_aligned(options.m_tile_count, 4), "m_tile_count", "must be 4-byte aligned, got ",
                    static_cast<const void*>(options.m_tile_count));
  }
  return kg::GroupedScheduler::make(
      offsets, offsets_type == IndexType::kInt64 ? 8 : 4, static_cast<unsigned>(num_groups), static_cast<uint64_t>(m),
      static_cast<uint64_t>(n), static_cast<unsigned>(tile.block_m), static_cast<unsigned>(tile.block_n),
      static_cast<unsigned>(options.group_m), static_cast<unsigned>(options.first_row / tile.block_m),
      options.m_tile_order, options.m_tile_count, static_cast<unsigned>(options.tile_lists),
      static_cast<unsigned>(options.tile_list_stride));
}

kg::GroupedScheduler grouped_gemm_schedule(const GroupedGemmArgs& a, const GemmTile& tile,
                                           const GroupedGemmRunOptions& options) {
  check_gemm_tile(tile);
  TDIST_CHECK_ARG(grouped_gemm_alignment() % tile.block_m == 0, "tile", "block_m ", tile.block_m,
                  " must divide the group alignment ", grouped_gemm_alignment());
  return detail::grouped_walk(a.offsets, a.offsets_type, a.num_groups, a.m, a.n, tile, options);
}

std::vector<int64_t> grouped_gemm_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  const int64_t align = grouped_gemm_alignment();
  for (size_t g = 0; g < counts.size(); ++g) {
    TDIST_CHECK_ARG(counts[g] >= 0, "counts", "group ", g, " has a negative row count ", counts[g]);
    offsets[g + 1] = offsets[g] + (counts[g] + align - 1) / align * align;
  }
  return offsets;
}

void check_grouped_gemm_offsets(const std::vector<int64_t>& offsets, int64_t m_total) {
  TDIST_CHECK_ARG(offsets.size() >= 2, "offsets", "expected num_groups + 1 >= 2 entries, got ", offsets.size());
  TDIST_CHECK_ARG(offsets[0] == 0, "offsets", "offsets[0] must be 0, got ", offsets[0]);
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    TDIST_CHECK_ARG(offsets[g + 1] >= offsets[g], "offsets", "must be non-decreasing: offsets[", g, "] = ", offsets[g],
                    " > offsets[", g + 1, "] = ", offsets[g + 1]);
    TDIST_CHECK_ARG(offsets[g + 1] % grouped_gemm_alignment() == 0, "offsets", "offsets[", g + 1,
                    "] = ", offsets[g + 1], " is not a multiple of ", grouped_gemm_alignment(),
                    " (pad each group's rows; grouped_gemm_offsets)");
  }
  TDIST_CHECK_ARG(offsets.back() <= m_total, "offsets", "offsets[G] = ", offsets.back(),
                  " exceeds m (M_total) = ", m_total);
}

std::vector<jit::CompileRequest> grouped_gemm_compile_requests() {
  std::vector<jit::CompileRequest> v = GroupedRuntime::compile_requests();
  for (auto& r : GatherRuntime::compile_requests()) v.push_back(std::move(r));
  return v;
}

std::string grouped_gemm_kernel_name(DType dtype, const GemmTile& tile, bool gathered_a) {
  return gathered_a ? GatherRuntime::kernel_name(dtype, tile) : GroupedRuntime::kernel_name(dtype, tile);
}

TDIST_JIT_REGISTER_KERNELS(grouped_gemm, grouped_gemm_compile_requests);

namespace {
std::vector<jit::CompileRequest> pair_order_requests() { return {pair_order_request()}; }
}  // namespace
TDIST_JIT_REGISTER_KERNELS(grouped_pair_order, pair_order_requests);

GroupedGemm::GroupedGemm() {
  const int device = current_device();
  num_sms_ = sm_count(device);
  const int cc = compute_capability(device);
  TDIST_CHECK(cc == kGemmComputeCapability, "tdist::GroupedGemm needs a Hopper GPU (sm_90a); device ", device,
              " is sm_", cc);
  runtime_ = std::make_unique<GroupedRuntime>(num_sms_);
  gather_ = std::make_unique<GatherRuntime>(num_sms_);
  fp8_ = std::make_unique<detail::Fp8GroupedRuntime>(num_sms_);
}

GroupedGemm::~GroupedGemm() = default;

namespace {
// Whether run() walks a 2-CTA cluster's tiles in pair order (GroupedGemmRunOptions::order_scratch).
bool pair_order_walk(const GroupedGemmRunOptions& o) {
  return o.order_scratch != nullptr && o.m_tile_order == nullptr && o.first_row == 0;
}
}  // namespace

GemmTile GroupedGemm::tile_for(const GroupedGemmArgs& args, const GroupedGemmRunOptions& options) const {
  if (options.tile) return *options.tile;
  return with_b_multicast(choose_gemm_tile(args.m, args.n, args.k, num_sms_, args.a_gather.has_value()), args.m, args.b,
                          args.ldb > 0 ? args.ldb : args.k, args.dtype, args.num_groups,
                          args.num_groups == 1 || pair_order_walk(options));
}

void GroupedGemm::run(const GroupedGemmArgs& raw, cudaStream_t stream, const GroupedGemmRunOptions& options) {
  TDIST_NVTX_RANGE("tdist::GroupedGemm::run", "m=", raw.m, " n=", raw.n, " k=", raw.k, " groups=", raw.num_groups, " ",
                   to_string(raw.dtype));
  const GroupedGemmArgs args = check_grouped_gemm_args(raw);
  if (args.m == 0 || args.n == 0) return;
  const GemmTile tile = tile_for(args, options);
  kg::GroupedScheduler sched = grouped_gemm_schedule(args, tile, options);
  if (tile.cluster_m == 2 && pair_order_walk(options) && args.num_groups > 1) {
    TDIST_CHECK_ARG(is_aligned(options.order_scratch, 4), "order_scratch", "must be 4-byte aligned, got ",
                    static_cast<const void*>(options.order_scratch));
    std::call_once(pair_order_once_, [&] { pair_order_ = std::make_unique<detail::PairOrderKernel>(); });
    pair_order_->launch(sched, options.order_scratch, stream);  // the plain walk's order, rearranged
    sched.m_tile_order = options.order_scratch;
  }
  // The grid is sized for M_total (the offsets are on the device); CTAs past the real tiles exit.
  const int64_t b_rows = static_cast<int64_t>(args.num_groups) * args.n;
  if (args.a_gather)
    gather_->launch(grouped_gemm_problem(args), tile, b_rows, kg::GatherGroupedScheduler{sched, *args.a_gather},
                    kg::NoTileHooks{}, options.max_ctas, stream);
  else
    runtime_->launch(grouped_gemm_problem(args), tile, b_rows, sched, kg::NoTileHooks{}, options.max_ctas, stream);
}

}  // namespace tdist
