// ag_gemm_swiglu: the first projection of a tensor-parallel LLaMA-style MLP in one call,
//   d = silu(allgather(A) x W_gate^T) * (allgather(A) x W_up^T)
// with this rank's weight shard b = [W_gate; W_up] (N = 2 x the rank's intermediate features, the
// gate rows first) and d of N/2 columns. The AllGather overlaps the GEMM as in AllGatherGemm (every
// method of it: the op wraps one), and the SwiGLU runs on the GEMM's output
// (kernels/epilogue/swiglu.cuh) once the GEMM is done: one extra pass that reads M x N and writes
// M x N / 2 elements (at M = 8192, N = 7168 per rank, 176 MB: about 50 us at H200 copy bandwidth,
// beside a GEMM of about 1.2 ms). Fusing it into the GEMM's epilogue would save that pass.
//
// This op is the worked example of docs/adding_an_op.md: a device header, this file, and a test.
#include <algorithm>

#include "src/ops/overlap/runtime.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/nvtx.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/ops/detail/overlap_registry.hpp"
#include "tdist/ops/gemm_overlap.hpp"

namespace tdist {

using namespace overlap;

namespace {

// The SwiGLU kernel's instances, named here only.
class SwiGluKernel {
 public:
  static std::string instance(DType dtype) {
    return detail::concat("tdist::kernels::epilogue::swiglu_rows<", kernel_type_name(dtype), ">");
  }
  static jit::CompileRequest compile_request() {
    jit::CompileRequest r;
    r.source = "#include \"tdist/kernels/epilogue/swiglu.cuh\"\n";
    r.file_name = "swiglu.cu";
    r.name_expressions = {instance(DType::kBFloat16), instance(DType::kFloat16)};
    return r;
  }

  SwiGluKernel(DType dtype, int num_sms)
      : module_(jit::Module::load(jit::compile(compile_request()))),
        kernel_(module_->kernel(instance(dtype))),
        num_sms_(num_sms) {}

  // d (rows x n_half) = SwiGLU of h (rows x 2 n_half).
  void launch(const void* h, void* d, int64_t rows, int64_t n_half, cudaStream_t stream) const {
    const u64 vectors = static_cast<u64>(rows) * static_cast<u64>(n_half) / 8;
    if (vectors == 0) return;
    jit::LaunchConfig cfg;
    cfg.grid = {static_cast<unsigned>(std::min<u64>((vectors + 255) / 256, static_cast<u64>(num_sms_) * 8))};
    cfg.block = {256};
    cfg.stream = stream;
    jit::launch(kernel_, cfg, jit::make_args(h, d, static_cast<u64>(rows), static_cast<u32>(n_half)));
  }

 private:
  std::shared_ptr<jit::Module> module_;
  jit::Kernel kernel_;
  int num_sms_;
};

std::vector<jit::CompileRequest> swiglu_compile_requests() {
  auto r = SwiGluKernel::compile_request();
  r.arch.clear();  // tdist-compile sets it
  return {r};
}
TDIST_JIT_REGISTER_KERNELS(ag_gemm_swiglu, swiglu_compile_requests);

AllGatherGemmConfig inner_config(const OverlapContextConfig& c) { return {c.max_m, c.k, c.dtype}; }

// Operands: a_local (rows x K), b (N x K), d (M x N/2), gathered (optional, M x K).
class AllGatherGemmSwiGlu final : public OverlapContext {
 public:
  AllGatherGemmSwiGlu(World& world, SymmetricHeap& heap, const OverlapContextConfig& c)
      : config_(c),
        gemm_(world, heap, inner_config(c)),
        swiglu_(c.dtype, sm_count(world.device())),
        h_(static_cast<size_t>(c.max_m) * c.max_n * dtype_size(c.dtype)) {
    TDIST_CHECK_ARG(c.max_n > 0 && c.max_n % 16 == 0, "config.max_n", "expected a positive multiple of 16, got ",
                    c.max_n);
  }
  ~AllGatherGemmSwiGlu() override { cudaDeviceSynchronize(); }

  OverlapContextConfig context_config() const override { return config_; }

  OverlapMethod method(const OverlapCall& call, OverlapMethod requested) const override {
    return gemm_.method(inner_call(call), requested);
  }

  void run(const OverlapCall& call, cudaStream_t stream, OverlapMethod method) override {
    TDIST_NVTX_RANGE("tdist::ag_gemm_swiglu", "m=", call.m, " n=", call.n, " k=", call.k, " ", to_string(config_.dtype),
                     " requested ", to_string(method));
    TDIST_CHECK_ARG(call.n <= config_.max_n && call.n % 16 == 0, "n", "expected N <= max_n (", config_.max_n,
                    ") and a multiple of 16 (the gate and up halves of 16-byte rows), got ", call.n);
    check_operand(call.operands[2], "d", call.m > 0);
    gemm_.run(inner_call(call), stream, method);
    swiglu_.launch(h_.get(), call.operands[2], call.m, call.n / 2, stream);
  }

 private:
  // The AllGather-GEMM's call: its D is the context's h.
  OverlapCall inner_call(const OverlapCall& call) const {
    OverlapCall inner = call;
    inner.operands[2] = h_.get();
    return inner;
  }

  OverlapContextConfig config_;
  AllGatherGemm gemm_;
  SwiGluKernel swiglu_;
  DeviceBuffer h_;  // T[max_m][max_n], ordinary memory: the GEMM's output, gate and up halves per row
};

const OverlapOpTraits& ag_gemm_swiglu_traits() {
  static const OverlapOpTraits traits{
      .name = "ag_gemm_swiglu",
      .summary = "D = silu(allgather(A) x W_gate^T) * (allgather(A) x W_up^T) with B = [W_gate; W_up]",
      .operands = {{"a_local", Extent::kRows, Extent::kK, OperandRole::kInput},
                   {"b", Extent::kN, Extent::kK, OperandRole::kInput},
                   {"d", Extent::kM, Extent::kHalfN, OperandRole::kOutput},
                   {"gathered", Extent::kM, Extent::kK, OperandRole::kOptionalOutput}},
      .comm = OverlapComm::kGatherA,
      .n_multiple = 16,
      .context_by_k = true,
      .context_by_n = true,
      .heap_bytes =
          [](const OverlapContextConfig& c, int world_size, int num_sms) {
            return all_gather_gemm_heap_bytes(inner_config(c), world_size, num_sms);  // h is ordinary memory
          },
      .create = [](World& world, SymmetricHeap& heap, const OverlapContextConfig& c)
          -> std::unique_ptr<OverlapContext> { return std::make_unique<AllGatherGemmSwiGlu>(world, heap, c); }};
  return traits;
}

TDIST_REGISTER_OVERLAP_OP(ag_gemm_swiglu, ag_gemm_swiglu_traits);

}  // namespace

}  // namespace tdist
