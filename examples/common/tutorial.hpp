// What every tutorial program shares, so that each main.cpp shows only its own kernel's story:
// command-line options, the launch checks, compiling the tutorial's kernels through the JIT,
// reproducible random data, device buffers, and the PASS/FAIL report that ends the run with the
// line "N passed, M failed".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tdist/common/cuda_check.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist::examples {

// ------------------------------------------------------------------------------------------------
// Command line: every option is an integer `--name=value` or `--name value` within [min, max].

struct OptionSpec {
  std::string name;
  long long default_value;
  long long min;
  long long max;
  std::string help;
};

class Options {
 public:
  // Throws tdist::Error naming the option on anything unknown, malformed or out of range.
  Options(int argc, char** argv, const std::vector<OptionSpec>& specs);
  long long operator[](const std::string& name) const;
  bool help_requested() const { return help_; }

 private:
  std::vector<OptionSpec> specs_;
  std::vector<long long> values_;
  bool help_ = false;
};

// ------------------------------------------------------------------------------------------------
// Random data. Every rank derives every input from one job-wide seed, so a rank can rebuild any
// peer's input on the host as the reference, without exchanging it.

// splitmix64: small, fast, and good enough for test data.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  // Uniform in [0, bound); bound > 0.
  uint64_t below(uint64_t bound) { return next() % bound; }
  // Uniform in [-1, 1).
  float uniform_pm1() { return static_cast<float>(static_cast<double>(next() >> 40) * 0x1p-23 - 1.0); }

 private:
  uint64_t state_;
};

// A seed for one piece of data: (job seed, owning rank, purpose, index) mixed together.
uint64_t derive_seed(uint64_t job_seed, int rank, uint64_t purpose, uint64_t index);

// ------------------------------------------------------------------------------------------------
// Device memory owned by this process (not symmetric: symmetric buffers come from SymmetricHeap).

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (count_ > 0) TDIST_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count_ * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(const std::vector<T>& host, size_t first = 0) {
    TDIST_CHECK(first + host.size() <= count_, "upload of ", host.size(), " elements at ", first,
                " overruns a device array of ", count_);
    if (!host.empty())
      TDIST_CUDA_CHECK(cudaMemcpy(data_ + first, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) TDIST_CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte`: outputs are poisoned so that anything left unwritten shows.
  void poison(unsigned char byte) {
    if (count_ > 0) TDIST_CUDA_CHECK(cudaMemset(data_, byte, bytes()));
  }

 private:
  size_t count_;
  T* data_ = nullptr;
};

// A non-blocking stream: it does not wait for the legacy default stream, so kernels on two such
// streams may run at the same time (the tutorials need that: a waiting kernel beside its producer).
class Stream {
 public:
  Stream() { TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Compiling the tutorial kernels.

// The examples/ folder holding kernels.manifest and the kernel sources: TDIST_EXAMPLES_DIR when
// set, else the source folder this program was built from.
std::string examples_dir();

// Compiles the kernels of `source` (a path relative to examples/, e.g. "01_notify_wait/notify_wait.cu")
// for this GPU, exactly as examples/kernels.manifest lists them (name expressions, defines,
// constants), and loads the module. The JIT caches the cubin on disk; Module::load loads it eagerly,
// so a kernel may wait on a kernel launched after it.
std::shared_ptr<jit::Module> load_tutorial_kernels(const std::string& source);

// ------------------------------------------------------------------------------------------------
// Checks and the report.

// The checks of one case on this rank. Mismatches are recorded, never thrown: every rank must go on
// to the case's remaining collective calls, or the others would wait for it.
class Case {
 public:
  explicit Case(std::string name) : name_(std::move(name)) {}
  // Records a failure when `ok` is false; prints the first few on this rank.
  template <typename... Parts>
  bool expect(bool ok, const Parts&... what) {
    if (!ok) record(detail::concat(what...));
    return ok;
  }
  size_t failures() const { return failures_; }

 private:
  void record(const std::string& what);
  std::string name_;
  size_t failures_ = 0;
};

class Report {
 public:
  explicit Report(World& world) : world_(world) {}
  // Runs one case; every rank runs the same cases in the same order. After the body, the ranks
  // combine their verdicts and rank 0 prints PASS or FAIL (naming the failing ranks). An exception
  // from the body (a CUDA error, a trapped device wait) is fatal: see run_tutorial.
  void run(const std::string& name, const std::function<void(Case&)>& body);
  int passed() const { return passed_; }
  int failed() const { return failed_; }

 private:
  World& world_;
  int passed_ = 0, failed_ = 0;
};

// ------------------------------------------------------------------------------------------------
// The program around a tutorial.

struct TutorialInfo {
  std::string program;  // "example_01_notify_wait"
  std::string summary;  // one line for --help
  std::vector<OptionSpec> options;
};

struct Context {
  World& world;
  const Options& options;
  Report& report;
  uint64_t job_seed;  // the same on every rank
  int device_sm_count;

  // Collective: the tutorial's symmetric heap of `capacity` bytes. It belongs to the context, not to
  // the tutorial's stack frame, so that a fatal error ends the process before the heap's collective
  // teardown (a barrier) could wait for peers that are themselves waiting for this rank.
  SymmetricHeap& create_heap(size_t capacity) {
    TDIST_CHECK(heap == nullptr, "a tutorial creates one symmetric heap");
    heap = std::make_unique<SymmetricHeap>(world, capacity);
    return *heap;
  }
  std::unique_ptr<SymmetricHeap> heap;
};

// Parses the options (plus --seed), checks that the job has at least two ranks before touching a
// GPU, sets a 30 s device wait timeout unless TDIST_WAIT_TIMEOUT_S says otherwise, creates the
// World, checks that every rank is load/store reachable, runs `body`, and prints the closing line
// "N passed, M failed" on rank 0. Returns the process exit code: 0 when everything passed, 1 on a
// failure, 2 on a usage error.
//
// A fatal error (no GPU, a CUDA error, a device wait that timed out) prints the error and the
// closing line on the failing rank and ends the process at once: its peers are probably waiting
// for it, and tdistrun stops them when one rank exits non-zero, whereas running the World's and the
// heap's collective destructors would wait for those peers. (Both live outside the frames that an
// exception unwinds, so they are still alive when the process ends.)
int run_tutorial(int argc, char** argv, const TutorialInfo& info, const std::function<void(Context&)>& body);

// Waits for this rank's GPU work, then for every rank.
void sync_all(World& world, const char* tag);

// Rounds up to a multiple of `align` (a power of two).
constexpr size_t align_up(size_t x, size_t align) { return (x + align - 1) & ~(align - 1); }

}  // namespace tdist::examples
