// Autotuner without a GPU: a fake timer stands in for CUDA events. The winner is stored, then
// reused by a new tuner without timing; another shape class, GPU or candidate set re-tunes;
// the reduce hook makes ranks agree.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "cpu/temp_dir.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/autotune.hpp"

namespace jit = tdist::jit;

namespace {

using tdist::test::TempDir;

struct FakeTimer {
  std::map<std::string, double> ms;  // per config name
  int calls = 0;
  jit::Autotuner::Timer timer() {
    return [this](const jit::TuneRequest&, const jit::TuneConfig& c) {
      ++calls;
      auto it = ms.find(c.name);
      if (it == ms.end()) throw tdist::Error("cannot run " + c.name);
      return it->second;
    };
  }
};

jit::TuneRequest request(const std::string& shape) {
  jit::TuneRequest r;
  r.kernel = "gemm_rs.v1";
  r.shape_class = shape;
  r.configs = {{"tile128", {{"BLOCK_M", 128}, {"STAGES", 4}}},
               {"tile64", {{"BLOCK_M", 64}, {"STAGES", 6}}},
               {"tile256", {{"BLOCK_M", 256}, {"STAGES", 3}}}};
  return r;
}

}  // namespace

TEST(JitAutotune, WinnerPersistsAndIsReusedWithoutTiming) {
  TempDir dir;
  FakeTimer t;
  t.ms = {{"tile128", 2.0}, {"tile64", 1.5}, {"tile256", 3.0}};
  {
    jit::Autotuner tuner(dir.path, t.timer(), {}, "FakeGPU H200");
    EXPECT_EQ(tuner.tune(request("m=4096")).name, "tile64");
    EXPECT_EQ(t.calls, 3);
    EXPECT_EQ(tuner.tune(request("m=4096")).name, "tile64");  // in memory
    EXPECT_EQ(t.calls, 3);
    std::ifstream rec(tuner.record_path(request("m=4096")));
    ASSERT_TRUE(rec.good());
  }
  // A new tuner (a later run): the stored winner, no timing, even if timings would differ now.
  t.ms["tile256"] = 0.1;
  jit::Autotuner again(dir.path, t.timer(), {}, "FakeGPU H200");
  EXPECT_EQ(again.tune(request("m=4096")).name, "tile64");
  EXPECT_EQ(t.calls, 3);
  EXPECT_EQ(again.timings(), 0u);
  EXPECT_EQ(again.tune(request("m=4096")).params.at("STAGES"), 6);

  // Another shape class is tuned afresh.
  EXPECT_EQ(again.tune(request("m=128")).name, "tile256");
  EXPECT_EQ(t.calls, 6);

  // Another GPU is tuned afresh.
  jit::Autotuner other_gpu(dir.path, t.timer(), {}, "FakeGPU B200");
  EXPECT_EQ(other_gpu.tune(request("m=4096")).name, "tile256");
  EXPECT_EQ(t.calls, 9);

  // A changed candidate set is tuned afresh.
  auto r = request("m=4096");
  r.configs.push_back({"tile32", {{"BLOCK_M", 32}}});
  t.ms["tile32"] = 0.05;
  jit::Autotuner more(dir.path, t.timer(), {}, "FakeGPU H200");
  EXPECT_EQ(more.tune(r).name, "tile32");
  EXPECT_EQ(t.calls, 13);
}

TEST(JitAutotune, FailingCandidatesLoseAndAllFailingThrows) {
  TempDir dir;
  FakeTimer t;
  t.ms = {{"tile256", 4.0}};  // the others throw, e.g. too much shared memory
  jit::Autotuner tuner(dir.path, t.timer(), {}, "FakeGPU");
  EXPECT_EQ(tuner.tune(request("s")).name, "tile256");
  t.ms.clear();
  EXPECT_THROW(tuner.tune(request("s2")), tdist::Error);
}

TEST(JitAutotune, CorruptRecordIsIgnored) {
  TempDir dir;
  FakeTimer t;
  t.ms = {{"tile128", 1.0}, {"tile64", 2.0}, {"tile256", 3.0}};
  std::string path;
  {
    jit::Autotuner tuner(dir.path, t.timer(), {}, "G");
    tuner.tune(request("s"));
    path = tuner.record_path(request("s"));
  }
  std::ofstream(path, std::ios::trunc) << "tdist-autotune 1\ngarbage\nwinner tile256\n";
  jit::Autotuner tuner(dir.path, t.timer(), {}, "G");
  EXPECT_EQ(tuner.tune(request("s")).name, "tile128");
  EXPECT_EQ(t.calls, 6);
}

TEST(JitAutotune, ReduceHookMakesRanksAgree) {
  // Two ranks simulated: this rank measured tile64 fastest, the other rank saw it slow.
  TempDir dir;
  FakeTimer t;
  t.ms = {{"tile128", 2.0}, {"tile64", 1.0}, {"tile256", 3.0}};
  std::vector<double> other_rank = {2.1, 5.0, 3.1};
  int reductions = 0;
  auto reduce = [&](const std::vector<double>& v) {
    ++reductions;
    std::vector<double> out = v;
    if (v.size() == other_rank.size())
      for (std::size_t i = 0; i < v.size(); ++i) out[i] = std::max(v[i], other_rank[i]);
    else  // agreement on a stored winner: the other rank holds none (-1)
      out = {std::max(v[0], -1.0), std::max(v[1], 1.0)};
    return out;
  };
  jit::Autotuner tuner(dir.path, t.timer(), reduce, "G");
  EXPECT_EQ(tuner.tune(request("s")).name, "tile128");  // max over ranks: 2.1 < 3.1 < 5.0
  EXPECT_EQ(reductions, 2);

  // This rank has a stored winner but the other does not: both must time again.
  jit::Autotuner later(dir.path, t.timer(), reduce, "G");
  EXPECT_EQ(later.tune(request("s")).name, "tile128");
  EXPECT_EQ(t.calls, 6);
  EXPECT_EQ(reductions, 4);

  // Both hold the same stored winner: no timing.
  auto agree = [&](const std::vector<double>& v) {
    ++reductions;
    return v;
  };
  jit::Autotuner agreed(dir.path, t.timer(), agree, "G");
  EXPECT_EQ(agreed.tune(request("s")).name, "tile128");
  EXPECT_EQ(t.calls, 6);
}
