// Host side of the FP8 grouped GEMM (include/tdist/ops/grouped_gemm.hpp, GroupedGemmFp8Args):
// argument checks, tiles, JIT instances, launch. Kernel: kernels/gemm/sm90_fp8_gemm.cuh with the
// grouped walk of kernels/gemm/grouped_scheduler.cuh; design: docs/gemm.md ("FP8").
#include <algorithm>

#include "tdist/common/alignment.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/gemm/config.cuh"
#include "tdist/ops/detail/gemm_instance.hpp"
#include "tdist/ops/detail/gemm_runtime.hpp"
#include "tdist/ops/grouped_gemm.hpp"

namespace tdist {

namespace kg = kernels::gemm;

namespace {

constexpr int64_t kScaleBlock = kg::kFp8BlockK;

int64_t blocks_of(int64_t x) { return (x + kScaleBlock - 1) / kScaleBlock; }

}  // namespace

GroupedGemmFp8Args check_grouped_gemm_fp8_args(const GroupedGemmFp8Args& in) {
  GroupedGemmFp8Args a = in;
  TDIST_CHECK_ARG(a.num_groups >= 1, "num_groups", "expected at least one group, got ", a.num_groups);
  check_gemm_dims(a.m, a.n, a.k);
  TDIST_CHECK_ARG(a.k % 16 == 0, "k", "must be a multiple of 16 (16-byte e4m3 rows), got ", a.k);
  if (a.a_gather) {
    // A is read through the index: `a` and lda only shape the (unread) A tensor map.
    a.a = a.a_gather->gathered;
    a.lda = a.k;
    if (a.m > 0 && a.n > 0) {
      detail::check_row_gather(*a.a_gather, a.k);
      TDIST_CHECK_ARG(a.a_gather->local_rows == 0 || (a.a_scales_local != nullptr && is_aligned(a.a_scales_local, 4)),
                      "a_scales_local", "expected a 4-byte aligned device pointer to the scales of ",
                      a.a_gather->local_rows, " local tokens, got ", static_cast<const void*>(a.a_scales_local));
    }
  }
  if (a.lda == 0) a.lda = a.k;
  if (a.ldb == 0) a.ldb = a.k;
  if (a.ldd == 0) a.ldd = a.n;
  TDIST_CHECK_ARG(a.lda >= a.k && a.lda % 16 == 0, "lda", "must be >= k (", a.k, ") and a multiple of 16, got ", a.lda);
  TDIST_CHECK_ARG(a.ldb >= a.k && a.ldb % 16 == 0, "ldb", "must be >= k (", a.k, ") and a multiple of 16, got ", a.ldb);
  TDIST_CHECK_ARG(a.ldd >= a.n && a.ldd % 8 == 0, "ldd", "must be >= n (", a.n,
                  ") and a multiple of 8 (16 bytes of bf16), got ", a.ldd);
  TDIST_CHECK_ARG(a.a_scales_row_stride >= 0, "a_scales_row_stride", "expected >= 0, got ", a.a_scales_row_stride);
  TDIST_CHECK_ARG(a.a_scales_kb_stride >= 0, "a_scales_kb_stride", "expected >= 0, got ", a.a_scales_kb_stride);
  if (a.a_scales_row_stride == 0 && a.a_scales_kb_stride == 0) {
    a.a_scales_row_stride = blocks_of(a.k);  // row-major [M_total][KB]
    a.a_scales_kb_stride = 1;
  }
  if (a.m > 0 && a.n > 0) {  // else nothing to compute; pointers may be anything
    TDIST_CHECK_ARG(a.a != nullptr && is_aligned(a.a, 16), "a", "expected a 16-byte aligned device pointer, got ", a.a);
    TDIST_CHECK_ARG(a.b != nullptr && is_aligned(a.b, 16), "b", "expected a 16-byte aligned device pointer, got ", a.b);
    TDIST_CHECK_ARG(a.d != nullptr && is_aligned(a.d, 16), "d", "expected a 16-byte aligned device pointer, got ", a.d);
    TDIST_CHECK_ARG(a.a_scales != nullptr && is_aligned(a.a_scales, 4), "a_scales",
                    "expected a 4-byte aligned device pointer to f32 scales, got ",
                    static_cast<const void*>(a.a_scales));
    TDIST_CHECK_ARG(a.b_scales != nullptr && is_aligned(a.b_scales, 4), "b_scales",
                    "expected a 4-byte aligned device pointer to f32 [num_groups][ceil(n / 128)][ceil(k / 128)], got ",
                    static_cast<const void*>(a.b_scales));
  }
  detail::check_grouped_offsets(a.num_groups, a.m, a.n, a.offsets, a.offsets_type);
  return a;
}

const std::vector<GemmTile>& fp8_gemm_tiles() {
  static const std::vector<GemmTile> tiles = {
      {128, 128, 128, 6, 1},  // 195 KiB ring (operands and scales) + 16 KiB of D chunks: the large-problem tile
      {128, 64, 128, 8, 1},   // narrow N (or a partly empty last wave)
      {64, 128, 128, 8, 1},   // small problems: more tiles to spread over the SMs
  };
  return tiles;
}

size_t fp8_gemm_shared_bytes(const GemmTile& t) {
  return kg::gemm_smem_bytes_mixed(t.block_m, t.block_n, t.block_k, t.stages, 1, 2,
                                   kg::fp8_scale_stage_bytes(static_cast<unsigned>(t.block_m)));
}

void check_fp8_gemm_tile(const GemmTile& t) {
  TDIST_CHECK_ARG(t.block_m == 64 || t.block_m == 128, "tile", "block_m must be 64 or 128, got ", t.block_m);
  TDIST_CHECK_ARG(t.block_n >= 16 && t.block_n % 16 == 0 && kScaleBlock % t.block_n == 0, "tile",
                  "block_n must be a multiple of 16 dividing 128 (one B scale per tile), got ", t.block_n);
  TDIST_CHECK_ARG(t.block_k == kScaleBlock, "tile", "block_k must be 128 (one scale block), got ", t.block_k);
  TDIST_CHECK_ARG(t.stages >= 2, "tile", "at least 2 stages, got ", t.stages);
  TDIST_CHECK_ARG(t.cluster_m == 1, "tile", "cluster_m must be 1, got ", t.cluster_m);
  const size_t smem = fp8_gemm_shared_bytes(t);
  TDIST_CHECK_ARG(smem <= kg::kMaxSmemBytes, "tile", t.name(), " needs ", smem, " bytes of shared memory, more than ",
                  kg::kMaxSmemBytes);
}

GemmTile choose_fp8_gemm_tile(int64_t m, int64_t n, int num_sms) {
  if (const auto forced = detail::forced_tile("TDIST_GEMM_FP8_TILE", fp8_gemm_tiles())) return *forced;
  return detail::choose_tile_among(fp8_gemm_tiles(), m, n, num_sms);
}

std::string grouped_gemm_fp8_kernel_name(const GemmTile& t, Fp8GroupedKernel kind) {
  const char* tail = kind == Fp8GroupedKernel::kTma         ? "GroupedScheduler>"
                     : kind == Fp8GroupedKernel::kGatheredA ? "GatherGroupedScheduler>"
                                                            : "GatherGroupedScheduler, tdist::kernels::gemm::"
                                                              "MoeGatherWaitHooks>";
  return detail::concat("tdist::kernels::gemm::sm90_fp8_gemm_tn<", t.block_m, ", ", t.block_n, ", ", t.stages,
                        ", tdist::kernels::gemm::", tail);
}

jit::CompileRequest grouped_gemm_fp8_compile_request(const GemmTile& tile, Fp8GroupedKernel kind) {
  check_fp8_gemm_tile(tile);
  const bool waits = kind == Fp8GroupedKernel::kGatheredAWaiting;
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/gemm/sm90_fp8_gemm.cuh\"\n";
  if (waits) r.source += "#include \"tdist/kernels/gemm/overlap.cuh\"\n";
  r.file_name = detail::concat("gemm_sm90_fp8_", tile.name(),
                               kind == Fp8GroupedKernel::kTma ? "_grouped.cu"
                               : waits                        ? "_grouped_gather_MoeGatherWaitHooks.cu"
                                                              : "_grouped_gather.cu");
  r.name_expressions = {grouped_gemm_fp8_kernel_name(tile, kind)};
  r.arch = "sm_90a";
  if (env::flag("TDIST_GEMM_DEBUG")) r.defines.push_back("TDIST_GEMM_DEBUG");
  return r;
}

namespace {

// GemmModules' name and request functions of one instance kind.
template <Fp8GroupedKernel kKind>
std::string fp8_name(DType, const GemmTile& tile) {
  return grouped_gemm_fp8_kernel_name(tile, kKind);
}
template <Fp8GroupedKernel kKind>
jit::CompileRequest fp8_request(const GemmTile& tile) {
  return grouped_gemm_fp8_compile_request(tile, kKind);
}

}  // namespace

std::vector<jit::CompileRequest> grouped_gemm_fp8_compile_requests() {
  std::vector<jit::CompileRequest> v;
  for (const GemmTile& t : fp8_gemm_tiles())
    for (Fp8GroupedKernel kind : {Fp8GroupedKernel::kTma, Fp8GroupedKernel::kGatheredA}) {
      v.push_back(grouped_gemm_fp8_compile_request(t, kind));
      v.back().arch.clear();  // tdist-compile sets it
    }
  return v;
}

TDIST_JIT_REGISTER_KERNELS(grouped_gemm_fp8, grouped_gemm_fp8_compile_requests);

void detail::Fp8GroupedRuntime::launch(const GroupedGemmFp8Args& a, const GemmTile& tile,
                                       const kg::GroupedScheduler& sched, int max_ctas, cudaStream_t stream,
                                       const kg::MoeGatherWaitParams* source_waits) {
  using K = Fp8GroupedKernel;
  TDIST_CHECK(source_waits == nullptr || a.a_gather, "FP8 source waits need a gathered A");
  // By Fp8GroupedKernel, as modules_.
  static constexpr GemmModules::NameFn kNames[] = {&fp8_name<K::kTma>, &fp8_name<K::kGatheredA>,
                                                   &fp8_name<K::kGatheredAWaiting>};
  static constexpr GemmModules::RequestFn kRequests[] = {&fp8_request<K::kTma>, &fp8_request<K::kGatheredA>,
                                                         &fp8_request<K::kGatheredAWaiting>};
  const int kind = static_cast<int>(source_waits ? K::kGatheredAWaiting : a.a_gather ? K::kGatheredA : K::kTma);
  const jit::Kernel& kernel = modules_[kind].load(DType::kFloat8E4M3, tile, kNames[kind], kRequests[kind]);
  const GemmArgs in = grouped_operands(a, DType::kFloat8E4M3), out = grouped_operands(a, DType::kBFloat16);
  const int64_t b_rows = static_cast<int64_t>(a.num_groups) * a.n;
  const GemmTensorMap map_a = encode_gemm_tensor_map(gemm_tensor_map_a(in, tile), DType::kFloat8E4M3);
  const GemmTensorMap map_b = encode_gemm_tensor_map(gemm_tensor_map_b_rows(in, tile, b_rows), DType::kFloat8E4M3);
  const GemmTensorMap map_d = encode_gemm_tensor_map(gemm_tensor_map_d(out, tile), DType::kBFloat16);
  kg::Fp8BlockScales scales;
  scales.a = a.a_scales;
  scales.a_local = a.a_scales_local;
  scales.a_row_stride = static_cast<uint64_t>(a.a_scales_row_stride);
  scales.a_kb_stride = static_cast<uint64_t>(a.a_scales_kb_stride);
  scales.b = a.b_scales;
  scales.a_rows_contiguous = !a.a_gather && a.a_scales_row_stride == 1 && a.a_scales_kb_stride % 4 == 0 &&
                             is_aligned(a.a_scales, 16) && a.m % 4 == 0;
  scales.n_blocks = static_cast<unsigned>(blocks_of(a.n));
  scales.k_blocks = static_cast<unsigned>(blocks_of(a.k));
  jit::KernelArgs kargs;
  kargs.add(map_a).add(map_b).add(map_d).add(a.d).add(static_cast<unsigned long long>(a.ldd));
  kargs.add(static_cast<unsigned>(a.m)).add(static_cast<unsigned>(a.n)).add(static_cast<unsigned>(a.k));
  kargs.add(scales);
  if (a.a_gather)
    kargs.add(kg::GatherGroupedScheduler{sched, *a.a_gather});
  else
    kargs.add(sched);
  if (source_waits)
    kargs.add(*source_waits);
  else
    kargs.add(kg::NoTileHooks{});
  // The grid is sized for M_total (the offsets are on the device); CTAs past the real tiles exit.
  const int64_t tiles = ((a.m + tile.block_m - 1) / tile.block_m) * ((a.n + tile.block_n - 1) / tile.block_n);
  jit::LaunchConfig cfg;
  cfg.grid = {static_cast<unsigned>(std::min<int64_t>(tiles, max_ctas > 0 ? std::min(max_ctas, num_sms_) : num_sms_))};
  cfg.block = {kg::gemm_threads(static_cast<unsigned>(tile.block_m))};
  cfg.shared_bytes = fp8_gemm_shared_bytes(tile);
  cfg.stream = stream;
  jit::launch(kernel, cfg, kargs);
}

GemmTile GroupedGemm::tile_for(const GroupedGemmFp8Args& args, const GroupedGemmRunOptions& options) const {
  return options.tile ? *options.tile : choose_fp8_gemm_tile(args.m, args.n, num_sms_);
}

void GroupedGemm::run(const GroupedGemmFp8Args& raw, cudaStream_t stream, const GroupedGemmRunOptions& options) {
  TDIST_NVTX_RANGE("tdist::GroupedGemm::run", "m=", raw.m, " n=", raw.n, " k=", raw.k, " groups=", raw.num_groups,
                   " e4m3");
  const GroupedGemmFp8Args args = check_grouped_gemm_fp8_args(raw);
  if (args.m == 0 || args.n == 0) return;
  TDIST_CHECK_ARG(options.max_ctas >= 0, "max_ctas", "expected >= 0, got ", options.max_ctas);
  const GemmTile tile = tile_for(args, options);
  check_fp8_gemm_tile(tile);  // BLOCK_M 64 or 128: divides the group alignment
  const kg::GroupedScheduler sched =
      detail::grouped_walk(args.offsets, args.offsets_type, args.num_groups, args.m, args.n, tile, options);
  fp8_->launch(args, tile, sched, options.max_ctas, stream);
}

}  // namespace tdist
