// The JIT's own self-test kernel, registered for tdist-compile --all and used by the GPU smoke
// test of compile + load + launch.
#include "tdist/jit/registry.hpp"

namespace tdist::jit {
namespace {

constexpr const char* kSelftestSource = R"(// tdist JIT self-test: out[i] = base + i * kScale.
template <int kScale, typename T>
__global__ void jit_selftest_fill(T* out, T base, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = base + T(i * kScale);
}
)";

std::vector<CompileRequest> selftest_requests() {
  CompileRequest r;
  r.source = kSelftestSource;
  r.file_name = "jit_selftest.cu";
  r.name_expressions = {"jit_selftest_fill<1, float>", "jit_selftest_fill<3, int>"};
  return {r};
}

}  // namespace

TDIST_JIT_REGISTER_KERNELS(jit_selftest, selftest_requests);

}  // namespace tdist::jit
