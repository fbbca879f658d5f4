// CuTe kernels through the JIT: the CUTLASS headers of a pip-installed nvidia-cutlass are found
// without configuration, and NVRTC compiles them for sm_90a (with -default-device added for them).
// Skips when no CUTLASS is installed; CI installs nvidia-cutlass so that it runs there.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <string>

#include "cpu/temp_dir.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/paths.hpp"

namespace jit = tdist::jit;
using tdist::test::TempDir;

TEST(JitCutlass, CuteKernelCompilesThroughNvrtc) {
  if (jit::cutlass_include_dir().empty()) GTEST_SKIP() << "no CUTLASS headers found (pip install nvidia-cutlass)";
  TempDir cache;
  jit::KernelCache kernels(cache.path);
  jit::CompileRequest request;
  request.file_name = "cute_copy.cu";
  request.source = R"(
#include <cute/tensor.hpp>
template <int kN>
__global__ void cute_copy(float* out, const float* in) {
  using namespace cute;
  Tensor src = make_tensor(make_gmem_ptr(in), make_layout(make_shape(Int<kN>{})));
  Tensor dst = make_tensor(make_gmem_ptr(out), make_layout(make_shape(Int<kN>{})));
  for (int i = threadIdx.x; i < kN; i += blockDim.x) dst(i) = src(i);
}
)";
  request.name_expressions = {"cute_copy<256>"};
  request.arch = "sm_90a";
  request.compiler = jit::CompilerKind::kNvrtc;
  const auto compiled = jit::compile(request, kernels);
  EXPECT_FALSE(compiled->cubin.empty());
  EXPECT_FALSE(compiled->lowered_name("cute_copy<256>").empty());
}
