// JIT on a real GPU: compile for the current GPU, load, launch (dynamic shared memory above
// 48 KiB, clusters, programmatic dependent launch), and autotune with CUDA events. Every test
// skips where no GPU driver is present (CI), and runs on the GPU machines.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "cpu/temp_dir.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/autotune.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/registry.hpp"

namespace jit = tdist::jit;

namespace {

bool have_gpu() {
  int n = 0;
  if (!jit::driver_available() || cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no GPU"

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

using tdist::test::TempDir;

const char* kKernels = R"(
template <int kScale>
__global__ void fill(int* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i * kScale;
}

// Round trip through dynamic shared memory of `words` ints.
extern "C" __global__ void smem_roundtrip(int* out, int words) {
  extern __shared__ int buf[];
  for (int i = threadIdx.x; i < words; i += blockDim.x) buf[i] = i ^ 0x5a5a;
  __syncthreads();
  int bad = 0;
  for (int i = threadIdx.x; i < words; i += blockDim.x) bad += buf[words - 1 - i] != ((words - 1 - i) ^ 0x5a5a);
  atomicAdd(out, bad);
}

extern "C" __global__ void cluster_rank(unsigned* out) {
  unsigned r, n;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  if (threadIdx.x == 0) out[blockIdx.x] = r * 100 + n;
}

// Producer then a programmatically dependent consumer on the same stream.
extern "C" __global__ void producer(int* data, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] = i + 1;
  asm volatile("griddepcontrol.launch_dependents;");
}
extern "C" __global__ void consumer(const int* data, int* sum_bad, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && data[i] != i + 1) atomicAdd(sum_bad, 1);
}
)";

std::shared_ptr<jit::Module> load_test_module(jit::KernelCache& cache) {
  jit::CompileRequest r;
  r.source = kKernels;
  r.file_name = "gpu_test_kernels.cu";
  r.name_expressions = {"fill<3>", "fill<5>"};
  // arch left empty: the current GPU's
  return jit::Module::load(jit::compile(r, cache));
}

}  // namespace

TEST(JitGpu, CompileLoadLaunchTemplates) {
  SKIP_WITHOUT_GPU();
  jit::KernelCache cache("");
  auto m = load_test_module(cache);
  EXPECT_EQ(m->compiled().arch, jit::current_arch());
  const int n = 100003;
  int* d = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d), n * sizeof(int)));
  std::vector<int> h(n);
  for (int scale : {3, 5}) {
    CUDA_OK(cudaMemset(d, 0xff, n * sizeof(int)));
    auto k = m->kernel("fill<" + std::to_string(scale) + ">");
    jit::KernelArgs args;
    args.add(d).add(n);
    jit::launch(k, {.grid = {(n + 255) / 256}, .block = {256}}, args);
    CUDA_OK(cudaMemcpy(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < n; ++i) bad += h[i] != i * scale;
    EXPECT_EQ(bad, 0) << "scale " << scale;
  }
  EXPECT_THROW(m->kernel("fill<7>"), tdist::Error);
  CUDA_OK(cudaFree(d));
}

TEST(JitGpu, RegisteredSelftestKernelRuns) {
  SKIP_WITHOUT_GPU();
  jit::KernelCache cache("");
  std::vector<jit::CompileRequest> reqs;
  for (const auto& fam : jit::registered_kernels())
    if (fam.name == "jit_selftest") reqs = fam.requests();
  ASSERT_EQ(reqs.size(), 1u);
  auto m = jit::Module::load(jit::compile(reqs[0], cache));
  const int n = 4097;
  float* d = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d), n * sizeof(float)));
  jit::launch(m->kernel("jit_selftest_fill<1, float>"), {.grid = {(n + 127) / 128}, .block = {128}},
              (jit::make_args(d, 0.5f, n)));
  std::vector<float> h(n);
  CUDA_OK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(h[0], 0.5f);
  EXPECT_EQ(h[n - 1], 0.5f + float(n - 1));
  CUDA_OK(cudaFree(d));
}

TEST(JitGpu, DynamicSharedMemoryAbove48KiB) {
  SKIP_WITHOUT_GPU();
  jit::KernelCache cache("");
  auto m = load_test_module(cache);
  int* bad = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&bad), sizeof(int)));
  for (std::size_t bytes : {std::size_t(16) << 10, std::size_t(100) << 10, std::size_t(200) << 10}) {
    CUDA_OK(cudaMemset(bad, 0, sizeof(int)));
    int words = int(bytes / sizeof(int));
    jit::launch(m->kernel("smem_roundtrip"), {.grid = {4}, .block = {512}, .shared_bytes = bytes},
                (jit::make_args(bad, words)));
    int h = -1;
    CUDA_OK(cudaMemcpy(&h, bad, sizeof(int), cudaMemcpyDeviceToHost));
    EXPECT_EQ(h, 0) << bytes << " bytes";
  }
  CUDA_OK(cudaFree(bad));
}

TEST(JitGpu, ClusterLaunch) {
  SKIP_WITHOUT_GPU();
  jit::KernelCache cache("");
  auto m = load_test_module(cache);
  const int blocks = 8;
  unsigned* d = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d), blocks * sizeof(unsigned)));
  jit::launch(m->kernel("cluster_rank"), {.grid = {blocks}, .block = {64}, .cluster = {2}}, (jit::make_args(d)));
  std::vector<unsigned> h(blocks);
  CUDA_OK(cudaMemcpy(h.data(), d, blocks * sizeof(unsigned), cudaMemcpyDeviceToHost));
  for (int b = 0; b < blocks; ++b) EXPECT_EQ(h[b], unsigned((b % 2) * 100 + 2)) << "block " << b;
  CUDA_OK(cudaFree(d));
}

TEST(JitGpu, ProgrammaticDependentLaunch) {
  SKIP_WITHOUT_GPU();
  jit::KernelCache cache("");
  auto m = load_test_module(cache);
  const int n = 1 << 22;
  int *data = nullptr, *bad = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(int)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&bad), sizeof(int)));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int rep = 0; rep < 5; ++rep) {
    CUDA_OK(cudaMemsetAsync(data, 0, n * sizeof(int), s));
    CUDA_OK(cudaMemsetAsync(bad, 0, sizeof(int), s));
    auto pa = jit::make_args(data, n);
    jit::launch(m->kernel("producer"), {.grid = {n / 256}, .block = {256}, .stream = s}, pa);
    auto ca = jit::make_args(static_cast<const int*>(data), bad, n);
    jit::launch(m->kernel("consumer"),
                {.grid = {n / 256}, .block = {256}, .programmatic_dependent_launch = true, .stream = s}, ca);
    int h = -1;
    CUDA_OK(cudaMemcpyAsync(&h, bad, sizeof(int), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_EQ(h, 0) << "rep " << rep;
  }
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFree(data));
  CUDA_OK(cudaFree(bad));
}

TEST(JitGpu, AutotuneWithCudaEvents) {
  SKIP_WITHOUT_GPU();
  TempDir dir;
  jit::KernelCache cache("");
  auto m = load_test_module(cache);
  const int n = 1 << 24;
  // Two input sets used in turn, so no timed launch reuses the previous one's L2 lines.
  int* bufs[2] = {nullptr, nullptr};
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&bufs[0]), n * sizeof(int)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&bufs[1]), n * sizeof(int)));
  int current = 0, launches = 0;
  jit::TuneRequest req;
  req.kernel = "jit_gpu_test.fill";
  req.shape_class = "n=16M";
  req.configs = {{"block32", {{"BLOCK", 32}}}, {"block256", {{"BLOCK", 256}}}, {"block1024", {{"BLOCK", 1024}}}};
  auto k = m->kernel("fill<3>");
  req.rotate = [&](int iter) { current = iter % 2; };
  req.launch = [&](const jit::TuneConfig& c, int, cudaStream_t s) {
    unsigned block = unsigned(c.params.at("BLOCK"));
    auto args = jit::make_args(bufs[current], n);
    jit::launch(k, {.grid = {unsigned((n + block - 1) / block)}, .block = {block}, .stream = s}, args);
    ++launches;
  };
  req.warmup = 2;
  req.repeat = 10;
  std::string winner;
  {
    jit::Autotuner tuner(dir.path);
    EXPECT_FALSE(tuner.gpu_name().empty());
    winner = tuner.tune(req).name;
    EXPECT_EQ(tuner.timings(), 3u);
    EXPECT_EQ(launches, 3 * 12);
    std::printf("autotune on %s: winner %s\n", tuner.gpu_name().c_str(), winner.c_str());
  }
  jit::Autotuner again(dir.path);
  EXPECT_EQ(again.tune(req).name, winner);
  EXPECT_EQ(again.timings(), 0u);
  EXPECT_EQ(launches, 3 * 12);
  CUDA_OK(cudaFree(bufs[0]));
  CUDA_OK(cudaFree(bufs[1]));
}
