// Host side of the FP8 row quantisation (include/tdist/ops/grouped_gemm.hpp, Fp8QuantizeArgs):
// checks, the JIT module (one per process: kernels are context-independent), launch. Kernel:
// kernels/gemm/fp8_quantize.cuh.
#include <algorithm>
#include <iterator>
#include <mutex>

#include "tdist/common/alignment.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/jit.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/gemm/fp8_quantize.cuh"
#include "tdist/ops/detail/gemm_instance.hpp"
#include "tdist/ops/grouped_gemm.hpp"

namespace tdist {

namespace kg = kernels::gemm;

namespace {

constexpr DType kQuantizeInputs[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};

std::string quantize_instance(DType dtype, bool swiglu) {
  return detail::concat("tdist::kernels::gemm::fp8_quantize_rows<", kernel_type_name(dtype), ", ",
                        swiglu ? "true" : "false", ">");
}

jit::CompileRequest quantize_request() {
  jit::CompileRequest r;
  r.source = "#include \"tdist/kernels/gemm/fp8_quantize.cuh\"\n";
  r.file_name = "fp8_quantize.cu";
  for (DType t : kQuantizeInputs)
    for (bool swiglu : {false, true}) r.name_expressions.push_back(quantize_instance(t, swiglu));
  r.arch = "sm_90a";
  return r;
}

// The loaded instances, by (input type, swiglu), and the grid's bound.
struct QuantizeKernels {
  std::shared_ptr<jit::Module> module;
  jit::Kernel kernel[std::size(kQuantizeInputs)][2];
  int num_sms = 0;

  QuantizeKernels() : module(jit::Module::load(jit::compile(quantize_request()))) {
    for (size_t t = 0; t < std::size(kQuantizeInputs); ++t)
      for (int s = 0; s < 2; ++s) kernel[t][s] = module->kernel(quantize_instance(kQuantizeInputs[t], s == 1));
    num_sms = sm_count(current_device());
  }
};

const QuantizeKernels& quantize_kernels() {
  static std::once_flag once;
  static std::unique_ptr<QuantizeKernels> kernels;
  std::call_once(once, [] { kernels = std::make_unique<QuantizeKernels>(); });
  return *kernels;
}

}  // namespace

Fp8QuantizeArgs check_fp8_quantize_args(const Fp8QuantizeArgs& in) {
  Fp8QuantizeArgs a = in;
  TDIST_CHECK_ARG(a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16 || a.dtype == DType::kFloat32, "dtype",
                  "expected bf16, f16 or f32 rows, got ", to_string(a.dtype));
  TDIST_CHECK_ARG(a.rows >= 0, "rows", "expected >= 0, got ", a.rows);
  TDIST_CHECK_ARG(a.k > 0 && a.k % 16 == 0 && a.k < (int64_t{1} << 30), "k",
                  "expected a positive multiple of 16 (an FP8 GEMM's K) below 2^30, got ", a.k);
  const int64_t columns = a.swiglu ? 2 * a.k : a.k;
  const int64_t blocks = (a.k + kg::kFp8BlockK - 1) / kg::kFp8BlockK;
  if (a.ldx == 0) a.ldx = columns;
  if (a.ldq == 0) a.ldq = a.k;
  const bool column_major = a.scale_ld == 1 && a.scale_kb_stride > 1;
  if (a.scale_kb_stride == 0) a.scale_kb_stride = 1;
  if (a.scale_ld == 0) a.scale_ld = column_major ? 1 : blocks;
  TDIST_CHECK_ARG(a.ldx >= columns && a.ldx % 8 == 0, "ldx", "expected >= ", columns,
                  a.swiglu ? " (2 k: gate, up)" : "", " and a multiple of 8, got ", a.ldx);
  TDIST_CHECK_ARG(a.ldq >= a.k && a.ldq % 16 == 0, "ldq", "expected >= k (", a.k, ") and a multiple of 16, got ",
                  a.ldq);
  if (column_major)
    TDIST_CHECK_ARG(a.scale_kb_stride >= a.rows, "scale_kb_stride",
                    "column-major scales (scale_ld 1): expected >= rows (", a.rows, "), got ", a.scale_kb_stride);
  else
    TDIST_CHECK_ARG(a.scale_kb_stride == 1 && (a.scale_ld >= blocks || a.rows <= 1), "scale_ld",
                    "expected row-major scales (scale_ld >= ceil(k / 128) = ", blocks,
                    ", scale_kb_stride 1) or column-major ones (scale_ld 1, scale_kb_stride >= rows), got scale_ld ",
                    a.scale_ld, ", scale_kb_stride ", a.scale_kb_stride);
  if (a.rows == 0) return a;
  TDIST_CHECK_ARG(a.x != nullptr && is_aligned(a.x, 16), "x", "expected a 16-byte aligned device pointer, got ", a.x);
  TDIST_CHECK_ARG(a.q != nullptr && is_aligned(a.q, 16), "q", "expected a 16-byte aligned device pointer, got ", a.q);
  TDIST_CHECK_ARG(a.scales != nullptr && is_aligned(a.scales, 4), "scales",
                  "expected a 4-byte aligned device pointer to f32 scales, got ", static_cast<const void*>(a.scales));
  return a;
}

void quantize_fp8_rows(const Fp8QuantizeArgs& raw, cudaStream_t stream) {
  const Fp8QuantizeArgs a = check_fp8_quantize_args(raw);
  if (a.rows == 0) return;
  const QuantizeKernels& k = quantize_kernels();
  const int type = static_cast<int>(std::find(std::begin(kQuantizeInputs), std::end(kQuantizeInputs), a.dtype) -
                                    std::begin(kQuantizeInputs));  // checked: one of them
  kg::Fp8QuantizeParams p{a.x,
                          static_cast<kg::u64>(a.ldx),
                          a.q,
                          static_cast<kg::u64>(a.ldq),
                          a.scales,
                          static_cast<kg::u64>(a.scale_ld),
                          static_cast<kg::u64>(a.scale_kb_stride),
                          static_cast<kg::u64>(a.rows),
                          static_cast<kg::u32>(a.k)};
  constexpr kg::u64 kWarps = kg::kQuantizeThreads / 32, kBlocksPerSm = 8;  // 64 warps: a full SM
  const kg::u64 items = static_cast<kg::u64>(a.rows) * ((a.k + kg::kFp8BlockK - 1) / kg::kFp8BlockK);
  jit::LaunchConfig cfg;
  cfg.stream = stream;
  cfg.programmatic_dependent_launch = true;  // waits for the kernel before it on the device
  cfg.block = {kg::kQuantizeThreads};
  cfg.grid = {
      static_cast<unsigned>(std::min<kg::u64>((items + kWarps - 1) / kWarps, kg::u64(k.num_sms) * kBlocksPerSm))};
  jit::launch(k.kernel[type][a.swiglu ? 1 : 0], cfg, jit::make_args(p));
}

std::vector<jit::CompileRequest> fp8_quantize_compile_requests() {
  jit::CompileRequest r = quantize_request();
  r.arch.clear();  // tdist-compile sets it
  return {r};
}

TDIST_JIT_REGISTER_KERNELS(fp8_quantize, fp8_quantize_compile_requests);

}  // namespace tdist
