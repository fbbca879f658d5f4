// Error macros for the CUDA runtime, the CUDA driver and NCCL, with file and line.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "tdist/common/error.hpp"

#define TDIST_CUDA_CHECK(expr)                                                                             \
  do {                                                                                                     \
    cudaError_t tdist_err_ = (expr);                                                                       \
    if (tdist_err_ != cudaSuccess)                                                                         \
      ::tdist::detail::throw_at(__FILE__, __LINE__, #expr " failed: ", cudaGetErrorName(tdist_err_), " (", \
                                cudaGetErrorString(tdist_err_), ")");                                      \
  } while (0)

#define TDIST_CU_CHECK(expr)                                                                                   \
  do {                                                                                                         \
    CUresult tdist_err_ = (expr);                                                                              \
    if (tdist_err_ != CUDA_SUCCESS)                                                                            \
      ::tdist::detail::throw_at(__FILE__, __LINE__, #expr " failed: CUresult ", static_cast<int>(tdist_err_)); \
  } while (0)

#define TDIST_NCCL_CHECK(expr)                                                                          \
  do {                                                                                                  \
    ncclResult_t tdist_err_ = (expr);                                                                   \
    if (tdist_err_ != ncclSuccess)                                                                      \
      ::tdist::detail::throw_at(__FILE__, __LINE__, #expr " failed: ", ncclGetErrorString(tdist_err_)); \
  } while (0)
