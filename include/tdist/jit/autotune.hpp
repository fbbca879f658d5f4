// Autotuner: times candidate configurations of a kernel once per (kernel, shape class, GPU,
// candidate set), keeps the fastest, and persists it in the cache folder so later runs reuse it
// without timing.
//
//   tdist::jit::Autotuner tuner;                      // cache at default_cache_dir()/autotune
//   tdist::jit::TuneRequest req;
//   req.kernel = "ag_gemm.v1";
//   req.shape_class = "m=8192,n=4096,k=4096,bf16";
//   req.configs = {{"128x128x3", {{"BLOCK_M", 128}, {"BLOCK_N", 128}, {"STAGES", 3}}}, ...};
//   req.launch = [&](const tdist::jit::TuneConfig& c, int iter, cudaStream_t s) { ... };
//   req.rotate = [&](int iter) { ... point the next launch at another input set ... };
//   const tdist::jit::TuneConfig& best = tuner.tune(req);
//
// Several ranks: give a `reduce` hook (e.g. an all-reduce with max over the ranks) so that every
// rank picks the same winner. The hook is collective: every rank calls tune() with the same
// requests in the same order, and each tune() calls the hook the same number of times on every
// rank (once to agree on a stored winner, once more after timing).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace tdist::jit {

struct TuneConfig {
  std::string name;  // unique within a request
  std::map<std::string, std::int64_t> params;
};

struct TuneRequest {
  std::string kernel;       // what is tuned (include a version if its code changes)
  std::string shape_class;  // the problem class the winner holds for
  std::vector<TuneConfig> configs;
  // Launches candidate `config` once on `stream`; `iteration` counts every launch of a candidate.
  std::function<void(const TuneConfig& config, int iteration, cudaStream_t stream)> launch;
  // Called before every launch, outside the timed region: switch to another input set so that
  // no timed launch finds its data in L2. Optional.
  std::function<void(int iteration)> rotate;
  cudaStream_t stream = nullptr;
  int warmup = 3;
  int repeat = 20;
};

class Autotuner {
 public:
  // Median time in ms of one candidate. The default one uses CUDA events around each launch.
  using Timer = std::function<double(const TuneRequest& req, const TuneConfig& config)>;
  // Reduces a vector across ranks, element-wise max; must return a vector of the same size.
  using Reduce = std::function<std::vector<double>(const std::vector<double>&)>;

  // `cache_dir` empty: default_cache_dir(). `gpu_name` empty: the current device's name.
  explicit Autotuner(std::string cache_dir = "", Timer timer = {}, Reduce reduce = {}, std::string gpu_name = "");

  // The winner for req (from memory, from disk, or timed now). Throws tdist::Error if no
  // candidate could be timed.
  const TuneConfig& tune(const TuneRequest& req);

  // File that holds the winner of req's (kernel, shape class, GPU, candidate set).
  std::string record_path(const TuneRequest& req);
  const std::string& gpu_name();
  std::uint64_t timings() const { return timings_; }  // candidates timed by this tuner

  // Default timer: CUDA events, `warmup` untimed launches, then the median of `repeat` timed ones.
  static double time_with_events(const TuneRequest& req, const TuneConfig& config);

 private:
  std::string key_string(const TuneRequest& req);
  std::string dir_;
  Timer timer_;
  Reduce reduce_;
  std::string gpu_;
  std::mutex mu_;
  std::map<std::string, TuneConfig> memory_;
  std::uint64_t timings_ = 0;
};

}  // namespace tdist::jit
