// Autotuner: timing, multi-rank agreement and the persisted winners.
#include "tdist/jit/autotune.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "detail.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/hash.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/paths.hpp"

namespace tdist::jit {
namespace {

// Record file: "key value" lines; the first fields repeat what the file name hashes, so a
// record is only used for exactly the request it was written for.
constexpr const char* kRecordHeader = "tdist-autotune 1";

std::string one_line(std::string s) {
  for (auto& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

std::string candidates_digest(const TuneRequest& req) {
  Sha256 h;
  for (const auto& c : req.configs) {
    h.field("config", c.name);
    for (const auto& [k, v] : c.params) h.field(k, std::to_string(v));
  }
  return to_hex(h.finish()).substr(0, 16);
}

}  // namespace

Autotuner::Autotuner(std::string cache_dir, Timer timer, Reduce reduce, std::string gpu_name)
    : dir_(detail::join(cache_dir.empty() ? default_cache_dir() : cache_dir, "autotune")),
      timer_(timer ? std::move(timer) : Timer(&Autotuner::time_with_events)),
      reduce_(std::move(reduce)),
      gpu_(std::move(gpu_name)) {}

const std::string& Autotuner::gpu_name() {
  // Timings of ranks that time-share a GPU (TDIST_SHARE_GPUS) are not the GPU's: kept apart.
  if (gpu_.empty()) gpu_ = current_device_name() + (env::flag("TDIST_SHARE_GPUS") ? " (shared by ranks)" : "");
  return gpu_;
}

std::string Autotuner::key_string(const TuneRequest& req) {
  return "kernel " + one_line(req.kernel) + "\nshape " + one_line(req.shape_class) + "\ngpu " + one_line(gpu_name()) +
         "\ncandidates " + candidates_digest(req) + "\n";
}

std::string Autotuner::record_path(const TuneRequest& req) {
  std::string name;
  for (char c : req.kernel) name += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_';
  return detail::join(dir_, name.substr(0, 64) + "." + to_hex(sha256(key_string(req))).substr(0, 32) + ".txt");
}

double Autotuner::time_with_events(const TuneRequest& req, const TuneConfig& config) {
  TDIST_CHECK_ARG(bool(req.launch), "req.launch", "no launcher for ", req.kernel);
  cudaEvent_t start, stop;
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) TDIST_FAIL(what, " failed: ", cudaGetErrorString(e));
  };
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  int iter = 0;
  std::vector<double> ms;
  try {
    for (int i = 0; i < req.warmup; ++i, ++iter) {
      if (req.rotate) req.rotate(iter);
      req.launch(config, iter, req.stream);
    }
    for (int i = 0; i < std::max(1, req.repeat); ++i, ++iter) {
      if (req.rotate) req.rotate(iter);
      check(cudaEventRecord(start, req.stream), "cudaEventRecord");
      req.launch(config, iter, req.stream);
      check(cudaEventRecord(stop, req.stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      ms.push_back(t);
    }
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

const TuneConfig& Autotuner::tune(const TuneRequest& req) {
  TDIST_CHECK_ARG(!req.configs.empty(), "req.configs", "no candidate for ", req.kernel);
  std::lock_guard<std::mutex> lock(mu_);
  std::string key = key_string(req);
  auto index_of = [&](const std::string& name) -> int {
    for (std::size_t i = 0; i < req.configs.size(); ++i)
      if (req.configs[i].name == name) return int(i);
    return -1;
  };
  auto mem = memory_.find(key);
  if (mem != memory_.end()) return mem->second;

  // Stored winner, if its record is intact and names one of today's candidates.
  int stored = -1;
  std::string text;
  std::string path = record_path(req);
  // A winner planted by another user would only pick a slower config, but is ignored all the same.
  if (trusted_folder(detail::dirname(dir_), "autotune") && read_trusted_file(path, text) &&
      text.rfind(std::string(kRecordHeader) + "\n" + key, 0) == 0) {
    std::istringstream is(text.substr(std::string(kRecordHeader).size() + 1 + key.size()));
    for (std::string line; std::getline(is, line);)
      if (line.rfind("winner ", 0) == 0) stored = index_of(line.substr(7));
  }
  if (reduce_) {
    // All ranks must take the stored winner or all must time: agree with two max-reductions
    // (max of idx and of -idx match only when every rank holds the same index).
    auto agreed = reduce_({double(stored), -double(stored)});
    TDIST_CHECK(agreed.size() == 2, "the autotuner's reduce hook returned ", agreed.size(), " values, expected 2");
    if (agreed[0] != -agreed[1]) stored = -1;
  }
  if (stored >= 0) {
    detail::verbose("autotune " + req.kernel + " [" + req.shape_class + "]: stored winner " + req.configs[stored].name);
    return memory_[key] = req.configs[stored];
  }

  std::vector<double> times(req.configs.size(), std::numeric_limits<double>::infinity());
  std::string failures;
  for (std::size_t i = 0; i < req.configs.size(); ++i) {
    try {
      times[i] = timer_(req, req.configs[i]);
      ++timings_;
    } catch (const std::exception& e) {
      // A candidate that cannot run here (too much shared memory, ...) just loses.
      failures += "\n  " + req.configs[i].name + ": " + e.what();
    }
    if (!std::isfinite(times[i]) || times[i] < 0) times[i] = std::numeric_limits<double>::infinity();
  }
  if (reduce_) {
    // Replace infinities by a large finite value: some reductions mishandle them.
    std::vector<double> v(times);
    for (auto& t : v)
      if (!std::isfinite(t)) t = 1e30;
    v = reduce_(v);
    TDIST_CHECK(v.size() == times.size(), "the autotuner's reduce hook returned ", v.size(), " values, expected ",
                times.size());
    for (std::size_t i = 0; i < v.size(); ++i) times[i] = v[i] >= 1e30 ? std::numeric_limits<double>::infinity() : v[i];
  }
  std::size_t best = std::min_element(times.begin(), times.end()) - times.begin();
  if (!std::isfinite(times[best]))
    TDIST_FAIL("autotune of ", req.kernel, " [", req.shape_class, "]: no candidate ran", failures);

  std::ostringstream rec;
  rec << kRecordHeader << "\n" << key << "winner " << req.configs[best].name << "\n";
  rec << "# median ms per candidate (after the ranks' reduction):\n";
  for (std::size_t i = 0; i < times.size(); ++i) rec << "# " << req.configs[i].name << " " << times[i] << "\n";
  write_file_atomic(path, rec.str(), detail::join(dir_, "tmp"));
  detail::verbose("autotune " + req.kernel + " [" + req.shape_class + "]: winner " + req.configs[best].name + " (" +
                  std::to_string(times[best]) + " ms)");
  return memory_[key] = req.configs[best];
}

}  // namespace tdist::jit
