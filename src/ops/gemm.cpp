// Host side of tdist::Gemm: argument checks, tensor maps, instance choice, JIT loading, launch.
// Kernel: include/tdist/kernels/gemm/sm90_gemm.cuh; design: docs/gemm.md.
#include "tdist/ops/gemm.hpp"

#include "tdist/ops/detail/gemm_runtime.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "tdist/common/alignment.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/jit/autotune.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/gemm/config.cuh"

namespace tdist {

namespace kg = kernels::gemm;

static_assert(sizeof(GemmTensorMap) == sizeof(CUtensorMap) && alignof(GemmTensorMap) == alignof(CUtensorMap),
              "GemmTensorMap mirrors CUtensorMap");

namespace {

size_t element_bytes(DType dtype) { return dtype_size(dtype); }

// Whether every row of a K-major operand starts 32-byte aligned (an L2 sector): the base and the row
// stride. Rows that are not read slower (docs/gemm.md, "Rows that are not 32-byte aligned").
bool rows_32_byte_aligned(const void* base, uint64_t row_stride_bytes) {
  return is_aligned(base, 32) && row_stride_bytes % 32 == 0;
}

void check_gemm_dtype(DType dtype) {
  TDIST_CHECK_ARG(dtype == DType::kBFloat16 || dtype == DType::kFloat16, "dtype",
                  "the GEMM takes bf16 or fp16 inputs, got ", to_string(dtype));
}

// Relative throughput of a tile when every SM is busy (bigger tiles reuse more of each load).
double tile_efficiency(const GemmTile& t) {
  const double area = static_cast<double>(t.block_m) * t.block_n;
  return area / (area + 48.0 * (t.block_m + t.block_n));  // operand traffic per output element
}

}  // namespace

std::string GemmTile::name() const {
  return detail::concat(block_m, "x", block_n, "x", block_k, "_s", stages, "_c", cluster_m);
}

unsigned gemm_threads(const GemmTile& tile) { return kg::gemm_threads(static_cast<unsigned>(tile.block_m)); }

size_t gemm_shared_bytes(const GemmTile& tile, DType dtype) {
  return kg::gemm_smem_bytes(tile.block_m, tile.block_n, tile.block_k, tile.stages,
                             static_cast<unsigned>(element_bytes(dtype)));
}

void check_gemm_tile(const GemmTile& t) {
  TDIST_CHECK_ARG(t.block_m == 64 || t.block_m == 128, "tile", "block_m must be 64 or 128, got ", t.block_m);
  TDIST_CHECK_ARG(t.block_n >= 16 && t.block_n <= 256 && t.block_n % 16 == 0, "tile",
                  "block_n must be a multiple of 16 in [16, 256], got ", t.block_n);
  TDIST_CHECK_ARG(t.block_k == 64, "tile", "block_k must be 64 (one 128-byte swizzle row), got ", t.block_k);
  TDIST_CHECK_ARG(t.stages >= 2, "tile", "at least 2 stages, got ", t.stages);
  TDIST_CHECK_ARG(t.cluster_m == 1 || t.cluster_m == 2, "tile", "cluster_m must be 1 or 2, got ", t.cluster_m);
  const size_t smem = gemm_shared_bytes(t, DType::kBFloat16);
  TDIST_CHECK_ARG(smem <= kg::kMaxSmemBytes, "tile", t.name(), " needs ", smem, " bytes of shared memory, more than ",
                  kg::kMaxSmemBytes);
}

const std::vector<GemmTile>& gemm_tiles() {
  static const std::vector<GemmTile> tiles = {
      {128, 256, 64, 4, 1},  // 192 KiB ring + 32 KiB of D chunks: the large-problem workhorse
      {128, 224, 64, 4, 1},  // N = 14336 (= 64 x 224): fills the last wave where 256 leaves it 40% empty
      {128, 192, 64, 5, 1},  // one D chunk buffer per warpgroup (two do not fit beside 5 stages)
      {128, 128, 64, 6, 1}, {64, 256, 64, 5, 1},
      {64, 128, 64, 8, 1},  // small problems: more tiles to spread over the SMs
  };
  return tiles;
}

GemmTile choose_gemm_tile(int64_t m, int64_t n, int64_t k, int num_sms, bool gathered_a, int block_m) {
  (void)k;
  const auto forced = detail::forced_tile("TDIST_GEMM_TILE", gemm_tiles());
  if (forced && (block_m == 0 || forced->block_m == block_m)) return *forced;
  return detail::choose_tile_among(gemm_tiles(), m, n, num_sms, gathered_a ? kGatheredFedColumns : 0.0, block_m);
}

GemmTile with_b_multicast(const GemmTile& tile, int64_t m, const void* b, int64_t ldb, DType dtype, int64_t num_groups,
                          bool pair_walk) {
  if (tile.cluster_m != 1) return tile;
  GemmTile t = tile;
  if (const auto forced = env::get("TDIST_GEMM_CLUSTER")) {
    TDIST_CHECK_ARG(*forced == "1" || *forced == "2", "TDIST_GEMM_CLUSTER", "expected 1 or 2, got '", *forced, "'");
    t.cluster_m = *forced == "2" ? 2 : 1;
    return t;
  }
  const bool b_rows_aligned = rows_32_byte_aligned(b, static_cast<uint64_t>(ldb) * element_bytes(dtype));
  const int64_t rows_per_b = m / std::max<int64_t>(num_groups, 1);
  const bool shared = pair_walk ? rows_per_b > t.block_m : rows_per_b >= 2 * t.block_m;
  if (!b_rows_aligned && detail::takes_cluster(t) && shared) t.cluster_m = 2;
  return t;
}

std::optional<GemmTile> detail::forced_tile(const char* variable, const std::vector<GemmTile>& shipped) {
  const auto forced = env::get(variable);
  if (!forced) return std::nullopt;
  std::string names;
  for (const GemmTile& t : shipped) {
    if (t.name() == *forced) return t;
    names += (names.empty() ? "" : ", ") + t.name();
  }
  TDIST_FAIL(variable, "='", *forced, "' names no shipped tile; expected one of ", names);
}

GemmTile detail::choose_tile_among(const std::vector<GemmTile>& tiles, int64_t m, int64_t n, int num_sms,
                                   double fed_columns, int block_m) {
  TDIST_CHECK_ARG(num_sms > 0, "num_sms", "expected a positive SM count, got ", num_sms);
  const GemmTile* best = nullptr;
  double best_score = -1;
  for (const GemmTile& t : tiles) {
    if (block_m > 0 && t.block_m != block_m) continue;
    const int64_t count = ((std::max<int64_t>(m, 1) + t.block_m - 1) / t.block_m) *
                          ((std::max<int64_t>(n, 1) + t.block_n - 1) / t.block_n);
    const int64_t waves = (count + num_sms - 1) / num_sms;
    // Useful fraction of the tile area (edge tiles are partly empty) times the wave fill.
    const double used = static_cast<double>(std::max<int64_t>(m, 1)) * std::max<int64_t>(n, 1) /
                        (static_cast<double>(count) * t.block_m * t.block_n);
    const double fill = static_cast<double>(count) / static_cast<double>(waves * num_sms);
    // A stage's MMAs last as long as block_n columns, or as the A they wait for.
    const double fed = fed_columns > t.block_n ? t.block_n / fed_columns : 1.0;
    const double score = used * fill * tile_efficiency(t) * fed;
    if (score > best_score * (1 + 1e-9)) best_score = score, best = &t;
  }
  TDIST_CHECK(best != nullptr, "no tile to choose from");
  return *best;
}

namespace detail {

std::string gemm_instance_name(DType dtype, const GemmTile& t, const char* hooks_type, const char* scheduler_type) {
  check_gemm_dtype(dtype);
  // The scheduler follows the hooks (the kernel's last template parameter, TileScheduler by default).
  return concat("tdist::kernels::gemm::sm90_gemm_tn<", kernel_type_name(dtype), ", ", t.block_m, ", ", t.block_n, ", ",
                t.block_k, ", ", t.stages, ", ", t.cluster_m, ", ", hooks_type,
                scheduler_type ? concat(", ", scheduler_type) : std::string(), ">");
}

jit::CompileRequest gemm_instance_request(const GemmTile& tile, const char* hooks_type, const char* hooks_header,
                                          const char* hooks_tag, const char* scheduler_type,
                                          const char* scheduler_tag) {
  check_gemm_tile(tile);
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/gemm/sm90_gemm.cuh\"\n";
  if (hooks_header) r.source += concat("#include \"", hooks_header, "\"\n");
  // gemm_sm90_<tile>[_<scheduler>][_<hooks>].cu: the plain instances keep their historical name.
  r.file_name = concat("gemm_sm90_", tile.name(), *scheduler_tag ? "_" : "", scheduler_tag, *hooks_tag ? "_" : "",
                       hooks_tag, ".cu");
  r.name_expressions = {gemm_instance_name(DType::kBFloat16, tile, hooks_type, scheduler_type),
                        gemm_instance_name(DType::kFloat16, tile, hooks_type, scheduler_type)};
  r.arch = "sm_90a";  // wgmma, TMA and setmaxnreg are sm_90a-only
  if (env::flag("TDIST_GEMM_DEBUG")) r.defines.push_back("TDIST_GEMM_DEBUG");
  return r;
}

struct GemmModules::Loaded {
  std::shared_ptr<jit::Module> module;
  jit::Kernel kernel;
};

const jit::Kernel& GemmModules::load(DType dtype, const GemmTile& tile, NameFn name, RequestFn request) {
  const auto key = std::make_tuple(static_cast<int>(dtype), tile.block_m, tile.block_n, tile.block_k, tile.stages,
                                   tile.cluster_m);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loaded_.find(key);
  if (it != loaded_.end()) return it->second->kernel;
  auto loaded = std::make_shared<Loaded>();
  loaded->module = jit::Module::load(jit::compile(request(tile)));
  loaded->kernel = loaded->module->kernel(name(dtype, tile));
  return loaded_.emplace(key, std::move(loaded)).first->second->kernel;
}

}  // namespace detail

std::string gemm_kernel_name(DType dtype, const GemmTile& t, const std::string& hook) {
  return detail::gemm_instance_name(dtype, t, hook.c_str(), nullptr);
}

jit::CompileRequest gemm_compile_request(const GemmTile& tile, const std::string& hook) {
  return detail::gemm_instance_request(tile, hook.c_str(), nullptr, "", nullptr, "");
}

std::vector<jit::CompileRequest> gemm_compile_requests() { return detail::PlainGemm::compile_requests(); }

TDIST_JIT_REGISTER_KERNELS(gemm, gemm_compile_requests);

void check_gemm_dims(int64_t m, int64_t n, int64_t k) {
  TDIST_CHECK_ARG(m >= 0 && m <= kGemmMaxDim, "m", "expected 0 <= m < 2^31, got ", m);
  TDIST_CHECK_ARG(n >= 0 && n <= kGemmMaxDim, "n", "expected 0 <= n < 2^31, got ", n);
  TDIST_CHECK_ARG(k > 0 && k <= kGemmMaxDim, "k", "expected 0 < k < 2^31, got ", k);
}

GemmArgs check_gemm_args(const GemmArgs& in) {
  GemmArgs a = in;
  check_gemm_dtype(a.dtype);
  check_gemm_dims(a.m, a.n, a.k);
  TDIST_CHECK_ARG(a.k % 8 == 0, "k", "must be a multiple of 8 (16-byte TMA rows), got ", a.k);
  if (a.lda == 0) a.lda = a.k;
  if (a.ldb == 0) a.ldb = a.k;
  if (a.ldd == 0) a.ldd = a.n;
  TDIST_CHECK_ARG(a.lda >= a.k && a.lda % 8 == 0, "lda", "must be >= k (", a.k,
                  ") and a multiple of 8 elements (16 bytes), got ", a.lda);
  TDIST_CHECK_ARG(a.ldb >= a.k && a.ldb % 8 == 0, "ldb", "must be >= k (", a.k,
                  ") and a multiple of 8 elements (16 bytes), got ", a.ldb);
  TDIST_CHECK_ARG(a.ldd >= a.n && a.ldd % 8 == 0, "ldd", "must be >= n (", a.n,
                  ") and a multiple of 8 elements (16 bytes), got ", a.ldd);
  if (a.m == 0 || a.n == 0) return a;  // nothing to compute; pointers may be anything
  TDIST_CHECK_ARG(a.a != nullptr, "a", "null pointer");
  TDIST_CHECK_ARG(a.b != nullptr, "b", "null pointer");
  TDIST_CHECK_ARG(a.d != nullptr, "d", "null pointer");
  TDIST_CHECK_ARG(is_aligned(a.a, 16), "a", "must be 16-byte aligned, got ", a.a);
  TDIST_CHECK_ARG(is_aligned(a.b, 16), "b", "must be 16-byte aligned, got ", a.b);
  TDIST_CHECK_ARG(is_aligned(a.d, 16), "d", "must be 16-byte aligned, got ", a.d);
  return a;
}

namespace {

// A K-major operand of `rows` x k elements, loaded in boxes of `box_rows` x BLOCK_K.
GemmTensorMapSpec k_major_tensor_map(const void* base, int64_t rows, int64_t ld, int box_rows, const GemmArgs& args,
                                     const GemmTile& tile) {
  GemmTensorMapSpec s;
  s.base = base;
  s.dims[0] = static_cast<uint64_t>(args.k);
  s.dims[1] = static_cast<uint64_t>(rows);
  s.row_stride_bytes = static_cast<uint64_t>(ld) * element_bytes(args.dtype);
  s.box[0] = static_cast<uint32_t>(tile.block_k);
  s.box[1] = static_cast<uint32_t>(box_rows);
  // Rows that are only 16-byte aligned read through 256-byte L2 promotion ran the GEMM 1.5-1.7x
  // slower than aligned ones; 128-byte promotion took that to 1.2-1.4x (docs/gemm.md, "Rows that are
  // not 32-byte aligned"). Aligned rows keep 256 bytes (no difference measured there).
  s.l2_promotion_bytes = rows_32_byte_aligned(base, s.row_stride_bytes) ? 256 : 128;
  return s;
}

}  // namespace

GemmTensorMapSpec gemm_tensor_map_a(const GemmArgs& args, const GemmTile& tile) {
  return k_major_tensor_map(args.a, args.m, args.lda, tile.block_m, args, tile);
}

// B's box: the tile's rows, or each CTA's half of them in a cluster (the multicast load).
GemmTensorMapSpec gemm_tensor_map_b(const GemmArgs& args, const GemmTile& tile) {
  return gemm_tensor_map_b_rows(args, tile, args.n);
}

GemmTensorMapSpec gemm_tensor_map_b_rows(const GemmArgs& args, const GemmTile& tile, int64_t b_rows) {
  return k_major_tensor_map(args.b, b_rows, args.ldb, tile.block_n / tile.cluster_m, args, tile);
}

GemmTensorMapSpec gemm_tensor_map_d(const GemmArgs& args, const GemmTile& tile) {
  // Dims {N rounded down to 8, M}: TMA stores clip columns in whole 16-byte units, so the map ends at
  // the last full unit and the kernel stores the remaining N % 8 columns itself (padding up to ldd
  // stays untouched); rows >= M are clipped exactly. With N < 8 the map is never used (8 columns
  // keep it encodable).
  GemmTensorMapSpec s;
  s.base = args.d;
  s.dims[0] = std::max<uint64_t>(static_cast<uint64_t>(args.n) & ~uint64_t{7}, 8);
  s.dims[1] = static_cast<uint64_t>(args.m);
  s.row_stride_bytes = static_cast<uint64_t>(args.ldd) * element_bytes(args.dtype);
  const unsigned cols = kg::gemm_epi_cols(static_cast<unsigned>(tile.block_n));
  s.box[0] = cols;
  s.box[1] = kg::kWgmmaM;
  s.swizzle_bytes = static_cast<uint32_t>(cols * element_bytes(args.dtype));
  return s;
}

GemmTensorMap encode_gemm_tensor_map(const GemmTensorMapSpec& spec, DType dtype) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    TDIST_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    TDIST_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr,
                "cuTensorMapEncodeTiled not found in the driver (status ", static_cast<int>(status), ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  TDIST_CHECK(spec.swizzle_bytes == 128 || spec.swizzle_bytes == 64 || spec.swizzle_bytes == 32,
              "tensor map swizzle must be 128, 64 or 32 bytes, got ", spec.swizzle_bytes);
  TDIST_CHECK(spec.l2_promotion_bytes == 256 || spec.l2_promotion_bytes == 128 || spec.l2_promotion_bytes == 64 ||
                  spec.l2_promotion_bytes == 0,
              "tensor map L2 promotion must be 256, 128, 64 or 0 bytes, got ", spec.l2_promotion_bytes);
  const CUtensorMapL2promotion promotion = spec.l2_promotion_bytes == 256   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                           : spec.l2_promotion_bytes == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                           : spec.l2_promotion_bytes == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                                                                            : CU_TENSOR_MAP_L2_PROMOTION_NONE;
  const CUtensorMapSwizzle swizzle = spec.swizzle_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : spec.swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                                : CU_TENSOR_MAP_SWIZZLE_32B;
  CUtensorMap map{};
  const cuuint64_t dims[2] = {spec.dims[0], spec.dims[1]};
  const cuuint64_t strides[1] = {spec.row_stride_bytes};
  const cuuint32_t box[2] = {spec.box[0], spec.box[1]};
  const cuuint32_t elem_strides[2] = {1, 1};
  // e4m3 travels as bytes (TMA copies, never converts).
  const CUtensorMapDataType type = dtype == DType::kBFloat16     ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : dtype == DType::kFloat8E4M3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                                 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r =
      encode(&map, type, 2,
             const_cast<void*>(spec.base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
             promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TDIST_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ") for dims {",
              spec.dims[0], ", ", spec.dims[1], "}, row stride ", spec.row_stride_bytes, " bytes, box {", spec.box[0],
              ", ", spec.box[1], "}, swizzle ", spec.swizzle_bytes, " bytes");
  GemmTensorMap out;
  static_assert(sizeof(out) == sizeof(map));
  std::memcpy(&out, &map, sizeof(map));
  return out;
}

kg::TileScheduler gemm_schedule(const GemmArgs& args, const GemmTile& tile, int group_m, int64_t first_row) {
  TDIST_CHECK_ARG(group_m >= 1, "group_m", "expected >= 1, got ", group_m);
  TDIST_CHECK_ARG(first_row >= 0, "first_row", "expected >= 0, got ", first_row);
  const uint64_t tiles_m = (static_cast<uint64_t>(args.m) + tile.block_m - 1) / tile.block_m;
  const uint64_t first_tile = tiles_m == 0 ? 0 : (static_cast<uint64_t>(first_row) / tile.block_m) % tiles_m;
  return kg::TileScheduler::make(static_cast<uint64_t>(args.m), static_cast<uint64_t>(args.n), tile.block_m,
                                 tile.block_n, static_cast<unsigned>(group_m), static_cast<unsigned>(first_tile));
}

jit::LaunchConfig gemm_launch_config(const GemmArgs& args, const GemmTile& tile, int num_sms, int max_ctas,
                                     cudaStream_t stream) {
  TDIST_CHECK_ARG(num_sms > 0, "num_sms", "expected a positive SM count, got ", num_sms);
  TDIST_CHECK_ARG(max_ctas >= 0, "max_ctas", "expected >= 0, got ", max_ctas);
  const auto sched = gemm_schedule(args, tile, 1, 0);
  int64_t ctas = std::min<int64_t>(sched.num_tiles(), max_ctas > 0 ? std::min(max_ctas, num_sms) : num_sms);
  ctas = std::max<int64_t>(ctas / tile.cluster_m * tile.cluster_m, tile.cluster_m);
  jit::LaunchConfig cfg;
  cfg.grid = {static_cast<unsigned>(ctas)};
  cfg.block = {gemm_threads(tile)};
  cfg.shared_bytes = gemm_shared_bytes(tile, args.dtype);
  cfg.cluster = {static_cast<unsigned>(tile.cluster_m)};
  cfg.stream = stream;
  return cfg;
}

jit::KernelArgs detail::gemm_operand_args(const GemmArgs& args, const GemmTile& tile, int64_t b_rows) {
  const GemmTensorMap map_a = encode_gemm_tensor_map(gemm_tensor_map_a(args, tile), args.dtype);
  const GemmTensorMap map_b = encode_gemm_tensor_map(gemm_tensor_map_b_rows(args, tile, b_rows), args.dtype);
  const GemmTensorMap map_d = encode_gemm_tensor_map(gemm_tensor_map_d(args, tile), args.dtype);
  // The maps are 128-byte aligned parameters; KernelArgs aligns to 16 at most, which is enough for
  // the copy the driver makes.
  jit::KernelArgs kargs;
  kargs.add(map_a).add(map_b).add(map_d).add(args.d).add(static_cast<unsigned long long>(args.ldd));
  kargs.add(static_cast<unsigned>(args.m)).add(static_cast<unsigned>(args.n)).add(static_cast<unsigned>(args.k));
  return kargs;
}

jit::KernelArgs gemm_kernel_args(const GemmArgs& args, const GemmTile& tile, const kg::TileScheduler& sched) {
  jit::KernelArgs kargs = detail::gemm_operand_args(args, tile, args.n);
  kargs.add(sched);
  return kargs;
}

Gemm::Gemm() {
  const int device = current_device();
  num_sms_ = sm_count(device);
  const int cc = compute_capability(device);
  TDIST_CHECK(cc == kGemmComputeCapability, "tdist::Gemm needs a Hopper GPU (sm_90a); device ", device, " is sm_", cc);
  runtime_ = std::make_unique<detail::PlainGemm>(num_sms_);
}

Gemm::~Gemm() = default;

const jit::Kernel& Gemm::kernel(DType dtype, const GemmTile& tile) { return runtime_->kernel(dtype, tile); }

void Gemm::run(const GemmArgs& raw, cudaStream_t stream, const GemmRunOptions& options) {
  TDIST_NVTX_RANGE("tdist::Gemm::run", "m=", raw.m, " n=", raw.n, " k=", raw.k, " ", to_string(raw.dtype));
  const GemmArgs args = check_gemm_args(raw);
  if (args.m == 0 || args.n == 0) return;
  GemmTile tile;
  if (options.tile) {
    tile = *options.tile;
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tuned_.find(detail::concat(args.m, ",", args.n, ",", args.k, ",", to_string(args.dtype)));
    tile = it != tuned_.end() ? it->second
                              : with_b_multicast(choose_gemm_tile(args.m, args.n, args.k, num_sms_), args.m, args.b,
                                                 args.ldb, args.dtype);
  }
  runtime_->run(args, tile, kg::NoTileHooks{}, options, stream);
}

GemmTile Gemm::tune(const GemmArgs& raw, cudaStream_t stream) {
  const GemmArgs args = check_gemm_args(raw);
  jit::TuneRequest req;
  req.kernel = "tdist.gemm.sm90.v2";  // v2: the candidates include the 2-CTA clusters
  req.shape_class = detail::concat("m=", args.m, ",n=", args.n, ",k=", args.k, ",", to_string(args.dtype));
  for (const GemmTile& t : detail::PlainGemm::instance_tiles()) {  // with the 2-CTA clusters
    req.configs.push_back({t.name(),
                           {{"block_m", t.block_m},
                            {"block_n", t.block_n},
                            {"block_k", t.block_k},
                            {"stages", t.stages},
                            {"cluster_m", t.cluster_m}}});
  }
  req.stream = stream;
  req.launch = [&](const jit::TuneConfig& c, int, cudaStream_t s) {
    GemmRunOptions o;
    o.tile = GemmTile{static_cast<int>(c.params.at("block_m")), static_cast<int>(c.params.at("block_n")),
                      static_cast<int>(c.params.at("block_k")), static_cast<int>(c.params.at("stages")),
                      static_cast<int>(c.params.at("cluster_m"))};
    run(args, s, o);
  };
  static jit::Autotuner tuner;
  const jit::TuneConfig& best = tuner.tune(req);
  const GemmTile tile{static_cast<int>(best.params.at("block_m")), static_cast<int>(best.params.at("block_n")),
                      static_cast<int>(best.params.at("block_k")), static_cast<int>(best.params.at("stages")),
                      static_cast<int>(best.params.at("cluster_m"))};
  std::lock_guard<std::mutex> lock(mu_);
  tuned_[detail::concat(args.m, ",", args.n, ",", args.k, ",", to_string(args.dtype))] = tile;
  return tile;
}

}  // namespace tdist
