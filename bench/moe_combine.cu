// The MoE ops' top-k weighted reduce (kernels/moe/combine.cuh, moe_combine) in the shapes of the
// second projection, for each choice of 16-byte columns per lane (kCols), pairs' loads in flight per
// warp (kPairs) and blocks per SM: time and bytes per second (every pair's row read, every token's
// written). One GPU; rows in a random order (as the routing's are, token after token).
//
//   bench_moe_combine [--iters 30]
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/kernels/moe/combine.cuh"

using namespace tdist;
namespace km = kernels::moe;

namespace {

struct Shape {
  const char* model;
  int64_t m;
  int topk, experts;
  int64_t n;  // hidden: the second projection's N
};

struct Variant {
  void (*kernel)(km::CombineParams);
  unsigned cols, pairs, blocks_per_sm;
};

template <unsigned kCols, unsigned kPairs, unsigned kBlocks>
Variant variant() {
  return {km::moe_combine<__nv_bfloat16, kCols, kPairs, kBlocks>, kCols, kPairs, kBlocks};
}

int run(int iters) {
  int sms = 0;
  TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Shape shapes[] = {{"qwen3", 1024, 8, 128, 2048},
                          {"qwen3", 4096, 8, 128, 2048},
                          {"qwen3", 16384, 8, 128, 2048},
                          {"dsv2lite", 4096, 6, 64, 2048},
                          {"mixtral", 4096, 2, 8, 4096}};
  const Variant variants[] = {variant<2, 2, 4>(), variant<2, 4, 3>(), variant<1, 4, 3>(), variant<2, 8, 2>(),
                              variant<1, 8, 3>(), variant<4, 4, 2>(), variant<2, 4, 4>(), variant<1, 4, 6>()};
  std::printf("%-9s %6s  %-22s %9s %8s\n", "model", "M", "cols x pairs x blocks", "us", "TB/s");
  for (const Shape& s : shapes) {
    const int64_t pairs = s.m * s.topk, rows = pairs + int64_t{s.experts} * km::kMoeTile;
    std::vector<int> row_of_pair(pairs);
    std::iota(row_of_pair.begin(), row_of_pair.end(), 0);
    std::shuffle(row_of_pair.begin(), row_of_pair.end(), std::mt19937(1));
    std::vector<float> weights(pairs, 1.0f / s.topk);
    DeviceBuffer d_rows(rows * s.n * 2), out(s.m * s.n * 2), rop(pairs * 4), w(pairs * 4);
    TDIST_CUDA_CHECK(cudaMemset(d_rows.get(), 0x3c, rows * s.n * 2));  // bf16 1.0-ish everywhere: no zeros
    TDIST_CUDA_CHECK(cudaMemcpy(rop.get(), row_of_pair.data(), pairs * 4, cudaMemcpyHostToDevice));
    TDIST_CUDA_CHECK(cudaMemcpy(w.get(), weights.data(), pairs * 4, cudaMemcpyHostToDevice));
    km::CombineParams p{};
    p.d_rows = d_rows.get();
    p.row_of_pair = rop.get<int>();
    p.weights = w.get<float>();
    p.out = out.get();
    p.tokens = static_cast<uint64_t>(s.m);
    p.topk = static_cast<unsigned>(s.topk);
    p.n = static_cast<unsigned>(s.n);
    const double bytes = static_cast<double>(pairs + s.m) * s.n * 2;
    for (const Variant& v : variants) {
      const unsigned grid = km::combine_grid(static_cast<uint64_t>(s.m), static_cast<unsigned>(s.n),
                                             static_cast<unsigned>(sms), v.cols, v.blocks_per_sm);
      cudaEvent_t start, end;
      TDIST_CUDA_CHECK(cudaEventCreate(&start));
      TDIST_CUDA_CHECK(cudaEventCreate(&end));
      for (int i = 0; i < 5; ++i) v.kernel<<<grid, km::kMoeCopyThreads>>>(p);
      std::vector<float> ms(iters);
      for (float& t : ms) {
        TDIST_CUDA_CHECK(cudaEventRecord(start));
        v.kernel<<<grid, km::kMoeCopyThreads>>>(p);
        TDIST_CUDA_CHECK(cudaEventRecord(end));
        TDIST_CUDA_CHECK(cudaEventSynchronize(end));
        TDIST_CUDA_CHECK(cudaEventElapsedTime(&t, start, end));
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      const bool shipped =
          v.cols == km::kCombineCols && v.pairs == km::kCombinePairs && v.blocks_per_sm == km::kCombineBlocksPerSm;
      std::printf("%-9s %6lld  %u x %u x %u%-16s %9.1f %8.2f\n", s.model, static_cast<long long>(s.m), v.cols, v.pairs,
                  v.blocks_per_sm, shipped ? " (shipped)" : "", med * 1e3, bytes / (med * 1e-3) / 1e12);
      TDIST_CUDA_CHECK(cudaEventDestroy(start));
      TDIST_CUDA_CHECK(cudaEventDestroy(end));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  cli::Parser p("bench_moe_combine", "The MoE top-k weighted reduce's variants on one GPU.");
  p.option("--iters", "N", "timings per figure, the median is kept (default 30)", &iters, 1, 100000);
  p.parse(argc, argv);
  return cli::run_main("bench_moe_combine", [&] { return run(iters); });
}
