// tdist::CublasGemm: cuBLAS's cublasGemmEx, and cuBLASLt's matmul for the addend form, through dlopen
// (include/tdist/ops/detail/cublas.hpp).
#include "tdist/ops/detail/cublas.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "tdist/common/alignment.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"

namespace tdist {

namespace {

// Opens `soname` (after `preferred`, when not empty), also trying CUDA_HOME and /usr/local/cuda, or
// throws naming what was tried.
void* open_library(const std::string& preferred, const std::string& soname, const char* what) {
  std::vector<std::string> names;
  if (!preferred.empty()) names.push_back(preferred);
  names.push_back(soname);
  if (const char* home = std::getenv("CUDA_HOME")) names.push_back(std::string(home) + "/lib64/" + soname);
  names.push_back("/usr/local/cuda/lib64/" + soname);
  std::string tried;
  for (const auto& n : names) {
    if (void* lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return lib;
    tried += (tried.empty() ? "" : ", ") + n;
  }
  TDIST_FAIL("cannot open ", what, " (tried ", tried, "); set TDIST_CUBLAS_LIBRARY to libcublas.so.13");
}

// TDIST_CUBLAS_LIBRARY, or "".
std::string cublas_env() { return env::text("TDIST_CUBLAS_LIBRARY"); }

template <typename F>
F symbol(void* lib, const char* name, const char* what) {
  void* p = dlsym(lib, name);
  TDIST_CHECK(p != nullptr, "the ", what, " library found lacks ", name);
  return reinterpret_cast<F>(p);
}
// field = the function `fn` of `lib`, typed as the header declares it.
#define TDIST_LOAD_SYMBOL(field, fn, what) (field) = symbol<decltype(&fn)>(lib, #fn, what)

#define TDIST_CUBLAS_CALL(call)                                                                            \
  do {                                                                                                     \
    const cublasStatus_t st_ = (call);                                                                     \
    TDIST_CHECK(st_ == CUBLAS_STATUS_SUCCESS, #call " failed with cuBLAS status ", static_cast<int>(st_)); \
  } while (0)

cudaDataType_t cuda_type(DType t) { return t == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F; }

// The largest power of two (at most 256) dividing the address: what cuBLASLt's algorithms require.
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return static_cast<int>(std::min<uintptr_t>(256, a & (~a + 1)));
}

constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

}  // namespace

struct CublasGemm::Api {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  // The C symbol (the header also declares C++ overloads of cublasGemmEx).
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                    cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx gemm_ex = nullptr;
};

struct CublasGemm::LtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

struct CublasGemm::LtPlan {
  const LtApi* api = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, cd = nullptr;  // C and D share one layout
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
  ~LtPlan() {
    if (cd) api->layout_destroy(cd);
    if (b) api->layout_destroy(b);
    if (a) api->layout_destroy(a);
    if (desc) api->desc_destroy(desc);
  }
};

CublasGemm::CublasGemm(bool with_addend) {
  // The libraries are opened once per process and never closed.
  static const Api api = [] {
    void* lib = open_library(cublas_env(), "libcublas.so.13", "cuBLAS");
    Api a;
    TDIST_LOAD_SYMBOL(a.create, cublasCreate_v2, "cuBLAS");
    TDIST_LOAD_SYMBOL(a.destroy, cublasDestroy_v2, "cuBLAS");
    TDIST_LOAD_SYMBOL(a.set_stream, cublasSetStream_v2, "cuBLAS");
    a.gemm_ex = symbol<Api::GemmEx>(lib, "cublasGemmEx", "cuBLAS");
    return a;
  }();
  api_ = &api;
  cublasHandle_t h = nullptr;
  TDIST_CUBLAS_CALL(api_->create(&h));
  handle_ = h;
  if (!with_addend) return;

  static const LtApi lt_api = [] {
    // libcublas depends on libcublasLt, so after the load above the soname finds the same copy; a
    // TDIST_CUBLAS_LIBRARY names the directory to look in first.
    const std::string env = cublas_env();
    const std::string dir = env.substr(0, env.find_last_of('/') + 1);
    void* lib = open_library(dir.empty() ? "" : dir + "libcublasLt.so.13", "libcublasLt.so.13", "cuBLASLt");
    LtApi a;
    TDIST_LOAD_SYMBOL(a.create, cublasLtCreate, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.destroy, cublasLtDestroy, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.desc_create, cublasLtMatmulDescCreate, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.desc_destroy, cublasLtMatmulDescDestroy, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.desc_set, cublasLtMatmulDescSetAttribute, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.layout_create, cublasLtMatrixLayoutCreate, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.layout_destroy, cublasLtMatrixLayoutDestroy, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.pref_create, cublasLtMatmulPreferenceCreate, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.pref_destroy, cublasLtMatmulPreferenceDestroy, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.pref_set, cublasLtMatmulPreferenceSetAttribute, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.heuristic, cublasLtMatmulAlgoGetHeuristic, "cuBLASLt");
    TDIST_LOAD_SYMBOL(a.matmul, cublasLtMatmul, "cuBLASLt");
    return a;
  }();
  lt_api_ = &lt_api;
  cublasLtHandle_t lt = nullptr;
  TDIST_CUBLAS_CALL(lt_api_->create(&lt));
  lt_handle_ = lt;
  // Allocated now: a first call inside a CUDA-graph capture could not allocate.
  TDIST_CUDA_CHECK(cudaMalloc(&lt_workspace_, kLtWorkspaceBytes));
}

CublasGemm::~CublasGemm() {
  lt_plans_.clear();
  if (lt_workspace_) cudaFree(lt_workspace_);
  if (lt_handle_) lt_api_->destroy(static_cast<cublasLtHandle_t>(lt_handle_));
  if (handle_) api_->destroy(static_cast<cublasHandle_t>(handle_));
}

void CublasGemm::run(const GemmArgs& raw, cudaStream_t stream) {
  const GemmArgs a = check_gemm_args(raw);
  if (a.m == 0 || a.n == 0) return;
  const cudaDataType_t t = cuda_type(a.dtype);
  const float alpha = 1.0f, beta = 0.0f;
  auto h = static_cast<cublasHandle_t>(handle_);
  api_->set_stream(h, stream);
  // Row-major D[M][N] = A[M][K] x B[N][K]^T is column-major D^T (N x M) = B^T (N x K) x A^T (K x M).
  const cublasStatus_t st =
      api_->gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(a.n), static_cast<int>(a.m), static_cast<int>(a.k),
                    &alpha, a.b, t, static_cast<int>(a.ldb), a.a, t, static_cast<int>(a.lda), &beta, a.d, t,
                    static_cast<int>(a.ldd), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TDIST_CHECK(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx failed with status ", static_cast<int>(st), " (m=", a.m,
              ", n=", a.n, ", k=", a.k, ")");
}

const CublasGemm::LtPlan& CublasGemm::lt_plan(const GemmArgs& a, const void* c) {
  const int align_a = alignment_of(a.a), align_b = alignment_of(a.b), align_c = alignment_of(c),
            align_d = alignment_of(a.d);
  const LtKey key{a.m, a.n, a.k, a.lda, a.ldb, a.ldd, static_cast<int>(a.dtype), align_a, align_b, align_c, align_d};
  std::lock_guard<std::mutex> lock(lt_mu_);
  auto it = lt_plans_.find(key);
  if (it != lt_plans_.end()) return *it->second;

  auto plan = std::make_unique<LtPlan>();
  plan->api = lt_api_;
  const LtApi& api = *lt_api_;
  const cudaDataType_t t = cuda_type(a.dtype);
  // The column-major view of run(): D^T (N x M) = B^T x A^T, B stored K x N (transposed), A K x M.
  TDIST_CUBLAS_CALL(api.desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  TDIST_CUBLAS_CALL(api.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  TDIST_CUBLAS_CALL(api.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  TDIST_CUBLAS_CALL(api.layout_create(&plan->a, t, a.k, a.n, a.ldb));
  TDIST_CUBLAS_CALL(api.layout_create(&plan->b, t, a.k, a.m, a.lda));
  TDIST_CUBLAS_CALL(api.layout_create(&plan->cd, t, a.n, a.m, a.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  TDIST_CUBLAS_CALL(api.pref_create(&pref));
  const size_t ws = kLtWorkspaceBytes;
  // cuBLASLt's A is our B and its B our A (the column-major view above).
  const uint32_t align[4] = {static_cast<uint32_t>(align_b), static_cast<uint32_t>(align_a),
                             static_cast<uint32_t>(align_c), static_cast<uint32_t>(align_d)};
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
    st = api.pref_set(pref, align_attr[i], &align[i], sizeof(align[i]));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = api.heuristic(static_cast<cublasLtHandle_t>(lt_handle_), plan->desc, plan->a, plan->b, plan->cd, plan->cd,
                       pref, 1, &result, &found);
  api.pref_destroy(pref);
  TDIST_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0, "cuBLASLt has no algorithm for D = A x B^T + C (m=", a.m,
              ", n=", a.n, ", k=", a.k, ", status ", static_cast<int>(st), ")");
  plan->algo = result.algo;
  plan->workspace_bytes = result.workspaceSize;
  return *lt_plans_.emplace(key, std::move(plan)).first->second;
}

void CublasGemm::run_add(const GemmArgs& raw, const void* c, cudaStream_t stream) {
  TDIST_CHECK(lt_handle_ != nullptr, "CublasGemm::run_add needs a CublasGemm created with_addend");
  const GemmArgs a = check_gemm_args(raw);
  if (a.m == 0 || a.n == 0) return;
  TDIST_CHECK_ARG(c != nullptr && is_aligned(c, 16), "c", "expected a 16-byte aligned pointer, got ", c);
  const LtPlan& plan = lt_plan(a, c);
  const float alpha = 1.0f, beta = 1.0f;
  TDIST_CUBLAS_CALL(lt_api_->matmul(static_cast<cublasLtHandle_t>(lt_handle_), plan.desc, &alpha, a.b, plan.a, a.a,
                                    plan.b, &beta, c, plan.cd, a.d, plan.cd, &plan.algo, lt_workspace_,
                                    plan.workspace_bytes, stream));
}

}  // namespace tdist
