// Timing GPU work the same way everywhere tdist measures itself beside a baseline.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "tdist/common/cuda_check.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist {

// Median milliseconds of one `launch()` on `stream`, as the slowest rank saw it: `warmup` untimed
// launches, a host barrier so that every rank starts together, then `iters` launches back to back,
// each between two CUDA events (no host synchronisation between them). Collective.
template <typename Launch>
double slowest_rank_median_ms(World& world, cudaStream_t stream, int iters, Launch&& launch, int warmup = 3) {
  TDIST_CHECK_ARG(iters > 0, "iters", "expected a positive count, got ", iters);
  for (int i = 0; i < warmup; ++i) launch();
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  world.barrier("timing start");
  std::vector<cudaEvent_t> events(iters + 1);
  for (auto& e : events) TDIST_CUDA_CHECK(cudaEventCreate(&e));
  TDIST_CUDA_CHECK(cudaEventRecord(events[0], stream));
  for (int i = 0; i < iters; ++i) {
    launch();
    TDIST_CUDA_CHECK(cudaEventRecord(events[i + 1], stream));
  }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) TDIST_CUDA_CHECK(cudaEventElapsedTime(&ms[i], events[i], events[i + 1]));
  for (auto& e : events) TDIST_CUDA_CHECK(cudaEventDestroy(e));
  std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
  return world.max_across_ranks("timing result", {static_cast<double>(ms[iters / 2])})[0];
}

}  // namespace tdist
