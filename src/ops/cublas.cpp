// tdist::CublasGemm: cuBLAS's cublasGemmEx through dlopen (include/tdist/ops/cublas.hpp).
#include "tdist/ops/cublas.hpp"

#include <cublas_v2.h>
#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "tdist/common/error.hpp"

namespace tdist {

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

CublasGemm::CublasGemm() {
  // The library is opened once per process and never closed.
  static const Api api = [] {
    std::vector<std::string> names;
    if (const char* env = std::getenv("TDIST_CUBLAS_LIBRARY")) names.push_back(env);
    names.insert(names.end(), {"libcublas.so.13", "libcublas.so"});
    if (const char* home = std::getenv("CUDA_HOME")) names.push_back(std::string(home) + "/lib64/libcublas.so.13");
    names.push_back("/usr/local/cuda/lib64/libcublas.so.13");
    void* lib = nullptr;
    std::string tried;
    for (const auto& n : names) {
      if ((lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      tried += (tried.empty() ? "" : ", ") + n;
    }
    TDIST_CHECK(lib != nullptr, "cannot open cuBLAS (tried ", tried, "); set TDIST_CUBLAS_LIBRARY to libcublas.so.13");
    Api a;
    a.create = reinterpret_cast<decltype(a.create)>(dlsym(lib, "cublasCreate_v2"));
    a.destroy = reinterpret_cast<decltype(a.destroy)>(dlsym(lib, "cublasDestroy_v2"));
    a.set_stream = reinterpret_cast<decltype(a.set_stream)>(dlsym(lib, "cublasSetStream_v2"));
    a.gemm_ex = reinterpret_cast<Api::GemmEx>(dlsym(lib, "cublasGemmEx"));
    TDIST_CHECK(a.create && a.destroy && a.set_stream && a.gemm_ex,
                "the cuBLAS library found lacks cublasCreate_v2, cublasSetStream_v2 or cublasGemmEx");
    return a;
  }();
  api_ = &api;
  cublasHandle_t h = nullptr;
  const cublasStatus_t st = api_->create(&h);
  TDIST_CHECK(st == CUBLAS_STATUS_SUCCESS, "cublasCreate failed with status ", static_cast<int>(st));
  handle_ = h;
}

CublasGemm::~CublasGemm() {
  if (handle_) api_->destroy(static_cast<cublasHandle_t>(handle_));
}

void CublasGemm::run(const GemmArgs& raw, cudaStream_t stream) {
  const GemmArgs a = check_gemm_args(raw);
  if (a.m == 0 || a.n == 0) return;
  const cudaDataType_t t = a.dtype == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
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

}  // namespace tdist
