// The typed launcher of kernels/moe/routing.cuh (routing) and kernels/moe/combine.cuh (top-k
// weighted reduce): the kernels' names live here only. Shared by MoeRouter (moe_routing.cpp) and
// the MoE ops (moe_ops.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "tdist/common/dtype.hpp"
#include "tdist/jit/jit.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/kernels/moe/combine.cuh"
#include "tdist/kernels/moe/routing.cuh"

namespace tdist::moe {

class MoeKernels {
 public:
  static jit::CompileRequest compile_request();
  // Compiles (or loads) the module; combine takes `dtype` (bf16 or fp16).
  explicit MoeKernels(DType dtype);

  // The two routing kernels (count; scan, tile lists and place in one launch) on `stream`.
  void route(const kernels::moe::RouteParams& p, cudaStream_t stream) const;
  void combine(const kernels::moe::CombineParams& p, cudaStream_t stream) const;

 private:
  static constexpr const char* kCount = "tdist::kernels::moe::moe_route_count";
  static constexpr const char* kBuild = "tdist::kernels::moe::moe_route_build";
  static std::string combine_instance(DType dtype);

  std::shared_ptr<jit::Module> module_;
  jit::Kernel count_, build_, combine_;
  int num_sms_ = 0;
};

}  // namespace tdist::moe
