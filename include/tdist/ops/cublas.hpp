// cuBLAS, opened at run time (dlopen of libcublas.so.13, or TDIST_CUBLAS_LIBRARY), as the GEMM of the
// baselines and of the chunked overlap methods: libtdist links nothing of cuBLAS, and a process that
// never takes those paths never loads it.
//
// Same layout as tdist::Gemm ("TN"): D[M][ldd] = A[M][lda] x B[N][ldb]^T, row-major, bf16 or fp16
// inputs, fp32 accumulation, output in the input type.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tdist/ops/gemm.hpp"

namespace tdist {

class CublasGemm {
 public:
  // Opens cuBLAS and creates a handle on the current device. Throws tdist::Error (naming
  // TDIST_CUBLAS_LIBRARY) when the library cannot be found.
  CublasGemm();
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;

  // D = A x B^T on `stream`; the arguments are checked as tdist::Gemm checks them.
  void run(const GemmArgs& args, cudaStream_t stream);

 private:
  struct Api;
  const Api* api_ = nullptr;
  void* handle_ = nullptr;
};

}  // namespace tdist
