// Minimal harness for multi-rank GPU tests: each rank runs every case, catches errors, and prints
// one line per case; the process prints "N passed, M failed" last and exits non-zero on failure.
// Cases must be run in the same order on every rank (they contain collective calls).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/device.cuh"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/wait_config.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist::test {

class Suite {
 public:
  // TDIST_TEST_FILTER=a,b runs only the cases whose name contains a or b (every rank reads the same
  // setting, so all skip alike): one case at a time when GPU time is scarce.
  explicit Suite(const World& world) : rank_(world.rank()), filter_(split_filter(env::text("TDIST_TEST_FILTER"))) {}

  void run(const std::string& name, const std::function<void()>& body) {
    if (!selected(name)) {
      ++skipped_;
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      body();
      ++passed_;
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      std::printf("PASS %s (%.0f ms)\n", name.c_str(), ms);
    } catch (const std::exception& e) {
      ++failed_;
      std::printf("FAIL %s: %s\n", name.c_str(), e.what());
    }
    std::fflush(stdout);
  }

  int finish() const {
    if (skipped_ > 0) std::printf("rank %d: %d cases left out by TDIST_TEST_FILTER\n", rank_, skipped_);
    std::printf("rank %d: %d passed, %d failed\n", rank_, passed_, failed_);
    std::fflush(stdout);
    return failed_ == 0 ? 0 : 1;
  }

 private:
  static std::vector<std::string> split_filter(const std::string& text) {
    std::vector<std::string> parts;
    size_t begin = 0;
    while (begin <= text.size()) {
      const size_t end = std::min(text.find(',', begin), text.size());
      if (end > begin) parts.push_back(text.substr(begin, end - begin));
      begin = end + 1;
    }
    return parts;
  }
  bool selected(const std::string& name) const {
    if (filter_.empty()) return true;
    for (const auto& part : filter_)
      if (name.find(part) != std::string::npos) return true;
    return false;
  }

  int rank_;
  std::vector<std::string> filter_;
  int passed_ = 0, failed_ = 0, skipped_ = 0;
};

// Pseudo-random, position-dependent bytes: a buffer that holds the wrong part of a pattern, or a
// pattern of the wrong seed, fails the check.
__host__ __device__ inline unsigned char pattern_byte(unsigned long long seed, unsigned long long index) {
  unsigned long long x = (index + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<unsigned char>(x);
}

// Grid-stride bodies, for kernels of their own and for tests' kernels that do more around them.
__device__ inline void fill_pattern_kernel_body(unsigned char* p, unsigned long long bytes, unsigned long long seed) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x)
    p[i] = pattern_byte(seed, i);
}

// Counts bytes of p[0, bytes) that differ from pattern(seed, first_index + i); records the first.
__device__ inline void check_pattern_kernel_body(const unsigned char* p, unsigned long long bytes,
                                                 unsigned long long seed, unsigned long long first_index,
                                                 unsigned long long* mismatches, unsigned long long* first_bad) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    if (p[i] != pattern_byte(seed, first_index + i)) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, i);
    }
  }
}

__global__ void fill_pattern_kernel(unsigned char* p, unsigned long long bytes, unsigned long long seed) {
  fill_pattern_kernel_body(p, bytes, seed);
}

__global__ void check_pattern_kernel(const unsigned char* p, unsigned long long bytes, unsigned long long seed,
                                     unsigned long long first_index, unsigned long long* mismatches,
                                     unsigned long long* first_bad) {
  check_pattern_kernel_body(p, bytes, seed, first_index, mismatches, first_bad);
}

// Counts bytes of p[0, bytes) that differ from `value`.
__global__ void check_value_kernel(const unsigned char* p, unsigned long long bytes, unsigned char value,
                                   unsigned long long* mismatches, unsigned long long* first_bad) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    if (p[i] != value) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, i);
    }
  }
}

inline void fill_pattern(void* p, size_t bytes, unsigned long long seed, cudaStream_t stream = nullptr) {
  if (bytes == 0) return;
  fill_pattern_kernel<<<1024, 256, 0, stream>>>(static_cast<unsigned char*>(p), bytes, seed);
  TDIST_CUDA_CHECK(cudaGetLastError());
}

// Host to device, landed on return: a cudaMemcpy from pageable memory may return before its DMA is
// done, and work on a non-blocking stream is not ordered after it.
inline void copy_to_device(void* dst, const void* src, size_t bytes) {
  TDIST_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

// cudaMemset, landed on return: it is not ordered before work on a non-blocking stream either (a
// kernel's output poisoned this way may be overwritten after the kernel wrote it).
inline void fill_device(void* dst, int byte, size_t bytes) {
  TDIST_CUDA_CHECK(cudaMemset(dst, byte, bytes));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

// Device counters for the check kernels.
class MismatchCounter {
 public:
  MismatchCounter() { TDIST_CUDA_CHECK(cudaMalloc(&counters_, 2 * sizeof(unsigned long long))); }
  ~MismatchCounter() { cudaFree(counters_); }
  MismatchCounter(const MismatchCounter&) = delete;
  MismatchCounter& operator=(const MismatchCounter&) = delete;

  // Throws naming `what`, the first bad index and the count when p differs from the pattern.
  void expect_pattern(const void* p, size_t bytes, unsigned long long seed, size_t first_index,
                      const std::string& what) {
    reset();
    if (bytes > 0)
      check_pattern_kernel<<<1024, 256>>>(static_cast<const unsigned char*>(p), bytes, seed, first_index, counters_,
                                          counters_ + 1);
    report(what, bytes);
  }

  void expect_value(const void* p, size_t bytes, unsigned char value, const std::string& what) {
    reset();
    if (bytes > 0)
      check_value_kernel<<<1024, 256>>>(static_cast<const unsigned char*>(p), bytes, value, counters_, counters_ + 1);
    report(what, bytes);
  }

  // For a test's own check kernel: reset(), pass mismatches() and first_bad(), then read() the
  // {mismatches, first bad index} pair after the kernel.
  void reset() {
    const unsigned long long init[2] = {0, ~0ull};
    copy_to_device(counters_, init, sizeof(init));  // landed: a test's kernel may run on another stream
  }
  unsigned long long* mismatches() const { return counters_; }
  unsigned long long* first_bad() const { return counters_ + 1; }
  std::array<unsigned long long, 2> read() const {
    std::array<unsigned long long, 2> host;
    TDIST_CUDA_CHECK(cudaMemcpy(host.data(), counters_, sizeof(host), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void report(const std::string& what, size_t bytes) {
    TDIST_CUDA_CHECK(cudaGetLastError());
    const auto [wrong, first] = read();
    if (wrong != 0) TDIST_FAIL(what, ": ", wrong, " of ", bytes, " bytes wrong, first at byte ", first);
  }
  unsigned long long* counters_ = nullptr;
};

// Expects fn() to throw a tdist::Error that names the argument `arg` (TDIST_CHECK_ARG quotes it).
template <typename Fn>
void expect_error(const char* arg, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    if (std::string(e.what()).find(detail::concat("'", arg, "'")) == std::string::npos)
      TDIST_FAIL("the error does not name '", arg, "': ", e.what());
    return;
  }
  TDIST_FAIL("expected an error naming '", arg, "'");
}

// A fresh seed per call, different on every rank and every run.
inline unsigned long long fresh_seed(int rank) {
  static unsigned long long counter =
      static_cast<unsigned long long>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  counter = counter * 6364136223846793005ull + 1442695040888963407ull;
  return counter ^ (static_cast<unsigned long long>(rank) << 56);
}

}  // namespace tdist::test

namespace tdist::test {

// Every rank's value, indexed by rank.
inline std::vector<unsigned long long> all_gather_u64(World& world, const std::string& tag, unsigned long long mine) {
  const auto* p = reinterpret_cast<const uint8_t*>(&mine);
  const auto all = world.all_gather(tag, Bytes(p, p + sizeof(mine)));
  std::vector<unsigned long long> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) std::memcpy(&out[r], all[r].data(), sizeof(unsigned long long));
  return out;
}

// Fails on every rank when any rank counted wrong elements (`bad`), so that all ranks pass or fail a
// case together (a rank that left a group early would desynchronise the collectives of the next
// one): "<prefix>rank R has N wrong elements", with `mine` appended on rank R itself.
inline void fail_unless_every_rank_clean(World& world, const std::string& tag, unsigned long long bad,
                                         const std::string& prefix, const std::string& mine) {
  const auto all = all_gather_u64(world, tag, bad);
  for (int r = 0; r < world.world_size(); ++r)
    if (all[r] != 0) TDIST_FAIL(prefix, "rank ", r, " has ", all[r], " wrong elements", r == world.rank() ? mine : "");
}

// Waits for this rank's GPU work, then for every rank.
inline void sync_all(World& world, const char* tag) {
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  world.barrier(tag);
}

}  // namespace tdist::test
