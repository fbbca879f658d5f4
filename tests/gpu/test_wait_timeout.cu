// A wait that no one will satisfy must end with the diagnostic, not hang.
//   (default) abort: the kernel returns within a few timeouts, tdist raises DeviceTimeoutError
//             from the fault record, the CUDA context stays usable, every later wait gives up at
//             once until the record is cleared, and a satisfied wait still returns its value.
//   --trap:   the kernel traps (the context is lost, so this runs as its own process).
// Exits 0 only when all of that held; scripts/gpu-test also checks the printed diagnostic lines.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "tdist/common/cuda_check.hpp"
#include "tdist/device.cuh"
#include "tdist/runtime/device_fault.hpp"
#include "tdist/runtime/wait_config.hpp"

using namespace tdist::device;

constexpr double kTimeoutSeconds = 1.0;

// Every thread of every block waits; out[block * threads + thread] = the value the wait returned.
__global__ void wait_on(const u64* flag, u64 expected, u64* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = signal_wait_until(flag, Cmp::kGe, expected);
}

__global__ void add_one(int* p, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

namespace {

int g_failed = 0, g_passed = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  ok ? ++g_passed : ++g_failed;
}

// Launches wait_on and returns (launch error, completion error, seconds).
struct Run {
  cudaError_t launch, result;
  double seconds;
};
Run run_wait(const u64* flag, u64 expected, u64* out, int blocks, int threads) {
  const auto start = std::chrono::steady_clock::now();
  wait_on<<<blocks, threads>>>(flag, expected, out);
  Run r;
  r.launch = cudaGetLastError();
  r.result = cudaDeviceSynchronize();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

int trap_mode(u64* flag, u64* out) {
  TDIST_CUDA_CHECK(tdist::configure_waits(/*rank=*/0, kTimeoutSeconds, TimeoutAction::kTrap));
  const Run r = run_wait(flag, 1, out, 2, 2);
  std::printf("trap: launch %s, kernel ended with %s after %.2f s\n", cudaGetErrorName(r.launch),
              cudaGetErrorName(r.result), r.seconds);
  expect(r.launch == cudaSuccess && r.result != cudaSuccess && r.seconds >= 0.9 * kTimeoutSeconds &&
             r.seconds < 10 * kTimeoutSeconds,
         "trap: the kernel fails within a few timeouts");
  return 0;
}

int abort_mode(u64* flag, u64* out) {
  TDIST_CUDA_CHECK(tdist::configure_waits(/*rank=*/0, kTimeoutSeconds, TimeoutAction::kAbort));
  tdist::clear_device_fault();
  // Many blocks wait at once: the first to time out records, the others give up at their next
  // clock check instead of each taking its own timeout in turn.
  constexpr int kBlocks = 264, kThreads = 64;
  const Run r = run_wait(flag, 7, out, kBlocks, kThreads);
  std::printf("abort: launch %s, kernel ended with %s after %.2f s\n", cudaGetErrorName(r.launch),
              cudaGetErrorName(r.result), r.seconds);
  expect(r.launch == cudaSuccess && r.result == cudaSuccess, "abort: the kernel returns without an error");
  expect(r.seconds >= 0.9 * kTimeoutSeconds && r.seconds < 5 * kTimeoutSeconds,
         "abort: it returns after one timeout, not one per block (" + std::to_string(r.seconds) + " s)");

  const tdist::device::FaultRecord* rec = tdist::device_fault_record();
  expect(rec->state == kFaultRecorded && rec->rank == 0 && rec->address == reinterpret_cast<u64>(flag) &&
             rec->expected == 7 && rec->seen == 0 && rec->site == static_cast<u32>(WaitSite::kSignalWaitUntil) &&
             rec->block[0] < kBlocks && rec->thread[0] < kThreads,
         "abort: the record names the rank, the wait, the block, the address, expected and seen values");
  bool raised = false;
  try {
    tdist::check_device_faults();
  } catch (const tdist::DeviceTimeoutError& e) {
    const std::string what = e.what();
    raised = what.find("rank 0") != std::string::npos && what.find("signal_wait_until") != std::string::npos &&
             what.find("0x") != std::string::npos;
    std::printf("raised: %s\n", e.what());
  }
  expect(raised, "abort: check_device_faults raises DeviceTimeoutError with the record");

  // The context is still usable: copies and kernels work.
  int* data = nullptr;
  int host[1000];
  TDIST_CUDA_CHECK(cudaMalloc(&data, sizeof(host)));
  for (int i = 0; i < 1000; ++i) host[i] = i;
  TDIST_CUDA_CHECK(cudaMemcpy(data, host, sizeof(host), cudaMemcpyHostToDevice));
  add_one<<<4, 256>>>(data, 1000);
  TDIST_CUDA_CHECK(cudaGetLastError());
  TDIST_CUDA_CHECK(cudaMemcpy(host, data, sizeof(host), cudaMemcpyDeviceToHost));
  bool usable = true;
  for (int i = 0; i < 1000; ++i) usable = usable && host[i] == i + 1;
  expect(usable, "abort: the CUDA context is still usable (copy, kernel, copy back)");
  TDIST_CUDA_CHECK(cudaFree(data));

  // While the record stands, a new wait gives up at its first clock check.
  const Run again = run_wait(flag, 7, out, 4, 32);
  expect(again.result == cudaSuccess && again.seconds < 0.5 * kTimeoutSeconds,
         "abort: later waits give up at once while the fault stands (" + std::to_string(again.seconds) + " s)");

  // Cleared, a satisfied wait returns the flag's value, and nothing is recorded.
  tdist::clear_device_fault();
  const u64 nine = 9;
  TDIST_CUDA_CHECK(cudaMemcpy(flag, &nine, sizeof(nine), cudaMemcpyHostToDevice));
  TDIST_CUDA_CHECK(cudaMemset(out, 0, 64 * sizeof(u64)));
  const Run ok = run_wait(flag, 7, out, 2, 32);
  u64 seen[64];
  TDIST_CUDA_CHECK(cudaMemcpy(seen, out, sizeof(seen), cudaMemcpyDeviceToHost));
  bool nines = true;
  for (u64 v : seen) nines = nines && v == 9;
  expect(ok.result == cudaSuccess && nines && !tdist::device_fault_message(),
         "abort: after clearing, a satisfied wait returns the value it saw and records nothing");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool trap = argc > 1 && std::strcmp(argv[1], "--trap") == 0;
  TDIST_CUDA_CHECK(cudaSetDevice(0));
  u64* flag;
  u64* out;
  TDIST_CUDA_CHECK(cudaMalloc(&flag, sizeof(u64)));
  TDIST_CUDA_CHECK(cudaMemset(flag, 0, sizeof(u64)));
  TDIST_CUDA_CHECK(cudaMalloc(&out, 264 * 64 * sizeof(u64)));
  trap ? trap_mode(flag, out) : abort_mode(flag, out);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
