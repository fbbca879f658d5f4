// A wait that no one will satisfy must end with the diagnostic, not hang. Runs as its own process
// (the trap leaves the CUDA context unusable). Exits 0 only when the kernel failed within a few
// timeouts; scripts/gpu-test also checks that the diagnostic line was printed.
#include <chrono>
#include <cstdio>

#include "tdist/common/cuda_check.hpp"
#include "tdist/device.cuh"
#include "tdist/runtime/wait_config.hpp"

using namespace tdist::device;

__global__ void wait_forever(const u64* flag) { signal_wait_until(flag, Cmp::kGe, u64{1}); }

int main() {
  constexpr double kTimeoutSeconds = 1.0;
  TDIST_CUDA_CHECK(cudaSetDevice(0));
  TDIST_CUDA_CHECK(tdist::configure_waits(/*rank=*/0, kTimeoutSeconds));
  u64* flag;
  TDIST_CUDA_CHECK(cudaMalloc(&flag, sizeof(u64)));
  TDIST_CUDA_CHECK(cudaMemset(flag, 0, sizeof(u64)));
  const auto start = std::chrono::steady_clock::now();
  wait_forever<<<2, 2>>>(flag);
  const cudaError_t launch = cudaGetLastError();
  const cudaError_t result = cudaDeviceSynchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wait without notify: launch %s, kernel ended with %s after %.2f s\n", cudaGetErrorName(launch),
              cudaGetErrorName(result), seconds);
  const bool ok = launch == cudaSuccess && result != cudaSuccess && seconds >= 0.9 * kTimeoutSeconds &&
                  seconds < 10 * kTimeoutSeconds;
  std::printf("%s\n", ok ? "1 passed, 0 failed" : "0 passed, 1 failed");
  return ok ? 0 : 1;
}
