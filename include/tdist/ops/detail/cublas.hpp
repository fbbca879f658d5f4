// cuBLAS, opened at run time (dlopen of libcublas.so.13, or TDIST_CUBLAS_LIBRARY), as the GEMM of the
// baselines and of the chunked overlap methods: libtdist links nothing of cuBLAS, and a process that
// never takes those paths never loads it.
//
// Same layout as tdist::Gemm ("TN"): D[M][ldd] = A[M][lda] x B[N][ldb]^T, row-major, bf16 or fp16
// inputs, fp32 accumulation, output in the input type.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "tdist/ops/gemm.hpp"

namespace tdist {

class CublasGemm {
 public:
  // Opens cuBLAS and creates a handle on the current device. With `with_addend`, also cuBLASLt
  // (libcublasLt.so.13, beside libcublas) and its 32 MiB workspace, for run_add. Throws tdist::Error
  // (naming TDIST_CUBLAS_LIBRARY) when a library cannot be found.
  explicit CublasGemm(bool with_addend = false);
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;

  // D = A x B^T on `stream`; the arguments are checked as tdist::Gemm checks them.
  void run(const GemmArgs& args, cudaStream_t stream);

  // D = A x B^T + C on `stream` (cuBLASLt; C has D's type, shape and leading dimension, and may be
  // another buffer than D): the addend joins the fp32 accumulator before the one rounding to the
  // output type. Needs `with_addend`.
  void run_add(const GemmArgs& args, const void* c, cudaStream_t stream);

 private:
  struct Api;
  struct LtApi;
  struct LtPlan;  // descriptors and algorithm of one problem shape
  // m, n, k, lda, ldb, ldd, dtype, and the alignment of A, B, C, D (the algorithms cuBLASLt offers
  // depend on it).
  using LtKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int, int>;
  const LtPlan& lt_plan(const GemmArgs& args, const void* c);

  const Api* api_ = nullptr;
  void* handle_ = nullptr;
  const LtApi* lt_api_ = nullptr;
  void* lt_handle_ = nullptr;
  void* lt_workspace_ = nullptr;
  std::mutex lt_mu_;
  std::map<LtKey, std::unique_ptr<LtPlan>> lt_plans_;
};

}  // namespace tdist
