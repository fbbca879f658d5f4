// The random benchmark sweeps (tdist/common/random_sweep.hpp): ranges, determinism, the odd sizes
// and shapes they exist for, bad specs rejected (by the tools too, exit 2), and the same lists from
// the Python port in python/tdist/bench.py for the same seed.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tdist/common/random_sweep.hpp"

namespace sweep = tdist::sweep;
namespace cli = tdist::cli;

namespace {

struct Result {
  int exit_code = -1;  // -1: killed by a signal or not started
  std::string output;  // stdout, and stderr when asked
};

Result run(const std::string& command) {
  Result result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

int octave(uint64_t v) { return 63 - __builtin_clzll(v); }

TEST(RandomSweep, SplitMix64MatchesTheReferenceSequence) {
  // splitmix64 from seed 0: the published first outputs.
  sweep::SplitMix64 r{0};
  EXPECT_EQ(r.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(r.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(r.next(), 0x06C45D188009454Full);
}

TEST(RandomSweep, SizesAreInRangeSortedAndMultiplesOfTheElement) {
  for (uint64_t elem : {1, 2, 4, 8}) {
    for (uint64_t seed : {0ull, 1ull, 99ull, 0x7FFFFFFFFFFFFFFFull}) {
      const auto sizes = sweep::random_sizes(500, seed, elem);
      ASSERT_EQ(sizes.size(), 500u);
      EXPECT_TRUE(std::is_sorted(sizes.begin(), sizes.end()));
      for (uint64_t s : sizes) {
        EXPECT_GE(s, sweep::kMinBytes);
        EXPECT_LE(s, sweep::kMaxBytes);
        EXPECT_EQ(s % elem, 0u) << s << " bytes, element " << elem;
      }
    }
  }
}

TEST(RandomSweep, SizesSpreadOverEveryOctaveWithOddCountsAmongThem) {
  const uint64_t elem = 2;
  const auto sizes = sweep::random_sizes(2000, 1, elem);
  std::set<int> octaves;
  int odd = 0, off16 = 0, on16 = 0;
  for (uint64_t s : sizes) {
    octaves.insert(octave(s));
    odd += (s / elem) % 2 == 1;
    off16 += s % 16 != 0;
    on16 += s % 16 == 0;
  }
  EXPECT_EQ(octaves.size(), 20u) << "log-uniform from 1 KB to 1 GB: every octave 2^10 .. 2^29";
  EXPECT_EQ(*octaves.begin(), 10);
  EXPECT_EQ(*octaves.rbegin(), 29);
  // A third odd by construction, a third any multiple of the element (mostly off 16 too).
  EXPECT_GT(odd, 2000 / 4);
  EXPECT_GT(off16, 2000 / 3);
  EXPECT_GT(on16, 2000 / 4);
  for (uint64_t s : sizes)
    if ((s / elem) % 2 == 1) EXPECT_NE(s % 16, 0u);
}

TEST(RandomSweep, SameSeedSameListOtherSeedOtherList) {
  EXPECT_EQ(sweep::random_sizes(50, 7, 2), sweep::random_sizes(50, 7, 2));
  EXPECT_NE(sweep::random_sizes(50, 7, 2), sweep::random_sizes(50, 8, 2));
  EXPECT_EQ(sweep::random_gemm_shapes(50, 7), sweep::random_gemm_shapes(50, 7));
  EXPECT_NE(sweep::random_gemm_shapes(50, 7), sweep::random_gemm_shapes(50, 8));
  // A longer list starts with the same draws: its first N, sorted, are the shorter list.
  auto a = sweep::random_sizes(10, 5, 4);
  auto b = sweep::random_sizes(11, 5, 4);
  for (uint64_t s : a) EXPECT_NE(std::find(b.begin(), b.end(), s), b.end()) << s;
}

TEST(RandomSweep, GemmShapesInRangeWithOddRowsAndMultiplesOfEight) {
  const auto shapes = sweep::random_gemm_shapes(1000, 3);
  ASSERT_EQ(shapes.size(), 1000u);
  EXPECT_TRUE(std::is_sorted(shapes.begin(), shapes.end()));
  int m_off128 = 0, m_on128 = 0;
  std::set<int> m_octaves, nk_octaves;
  int64_t nk_max = 0;
  for (const auto& s : shapes) {
    EXPECT_GE(s.m, sweep::kMinM);
    EXPECT_LT(s.m, sweep::kMaxM);
    for (int64_t v : {s.n, s.k}) {
      EXPECT_EQ(v % 8, 0) << v;
      EXPECT_GE(v, sweep::kMinNK);
      EXPECT_LE(v, sweep::kMaxNK);
      nk_octaves.insert(octave(static_cast<uint64_t>(v)));
      nk_max = std::max(nk_max, v);
    }
    m_off128 += s.m % 128 != 0;
    m_on128 += s.m % 128 == 0;
    m_octaves.insert(octave(static_cast<uint64_t>(s.m)));
  }
  EXPECT_GT(m_off128, 1000 / 2) << "M that no tile divides";
  EXPECT_GT(m_on128, 1000 / 8);
  EXPECT_EQ(m_octaves.size(), 7u) << "M log-uniform over 128 .. 16384";
  EXPECT_EQ(nk_octaves.size(), 5u) << "N, K log-uniform over 1024 .. 28672";
  EXPECT_GT(nk_max, 24576);
}

TEST(RandomSweep, BadSpecsNameTheOption) {
  for (const char* bad : {"random:0", "random:x", "random:-3", "random:", "random:100001", "random:1.5", "rand:4"}) {
    try {
      sweep::parse_random_count(bad, "--sizes");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const cli::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--sizes expects random:N"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(sweep::parse_random_count("random:1", "--shapes"), 1);
  EXPECT_EQ(sweep::parse_random_count("random:100000", "--shapes"), 100000);
  EXPECT_THROW(sweep::random_sizes(10, 1, 3), cli::UsageError);  // no element of 3 bytes
  EXPECT_THROW(sweep::random_sizes(0, 1, 2), cli::UsageError);
  EXPECT_THROW(sweep::random_gemm_shapes(0, 1), cli::UsageError);
}

// The tools, without a GPU: bad specs exit 2 naming the option; --print-sweep lists the sweep.
std::string tool(const std::string& rel) {
  const std::string path = std::string(TDIST_BINARY_DIR) + "/" + rel;
  return std::filesystem::exists(path) ? path : "";
}

TEST(RandomSweep, ToolsRejectBadSpecsWithExitTwo) {
  const std::string bench = tool("tools/tdist-bench"), gemm = tool("bench/bench_gemm_overlap");
  if (bench.empty() && gemm.empty()) GTEST_SKIP() << "tdist-bench and bench_gemm_overlap are not built";
  for (const char* bad : {"random:0", "random:x", "random:-3"}) {
    if (!bench.empty()) {
      const Result r = run(bench + " --sizes " + bad + " --print-sweep 2>&1");
      EXPECT_EQ(r.exit_code, 2) << r.output;
      EXPECT_NE(r.output.find("tdist-bench: error: --sizes expects random:N"), std::string::npos) << r.output;
    }
    if (!gemm.empty()) {
      const Result r = run(gemm + " --shapes " + bad + " --print-sweep 2>&1");
      EXPECT_EQ(r.exit_code, 2) << r.output;
      EXPECT_NE(r.output.find("bench_gemm_overlap: error: --shapes expects random:N"), std::string::npos) << r.output;
    }
  }
  if (!gemm.empty()) {
    for (const char* bad : {"128x1004x1024", "128x1024x1020", "128x1024", "0x1024x1024", "128x1024x1024,"}) {
      const Result r = run(gemm + " --shapes " + bad + " --print-sweep 2>&1");
      EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
      EXPECT_NE(r.output.find("--shapes expects"), std::string::npos) << r.output;
    }
    const Result both = run(gemm + " --shapes random:2 --m 128 --print-sweep 2>&1");
    EXPECT_EQ(both.exit_code, 2) << both.output;
    EXPECT_NE(both.output.find("--shapes and --m are exclusive"), std::string::npos) << both.output;
  }
}

TEST(RandomSweep, ToolsPrintTheSweep) {
  const std::string bench = tool("tools/tdist-bench"), gemm = tool("bench/bench_gemm_overlap");
  if (bench.empty() && gemm.empty()) GTEST_SKIP() << "tdist-bench and bench_gemm_overlap are not built";
  if (!bench.empty()) {
    for (const char* dtype : {"bf16", "f32"}) {
      const Result r = run(bench + " --sizes random:25 --seed 11 --dtype " + dtype + " --print-sweep");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      std::string want;
      for (uint64_t s : sweep::random_sizes(25, 11, std::string(dtype) == "f32" ? 4 : 2))
        want += std::to_string(s) + "\n";
      EXPECT_EQ(r.output, want);
    }
  }
  if (!gemm.empty()) {
    const Result r = run(gemm + " --shapes random:9 --seed 4 --print-sweep");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::string want;
    for (const auto& s : sweep::random_gemm_shapes(9, 4))
      want += std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + "\n";
    EXPECT_EQ(r.output, want);
    const Result l = run(gemm + " --shapes 100x1024x2048,4096X28672x8192 --print-sweep");
    ASSERT_EQ(l.exit_code, 0) << l.output;
    EXPECT_EQ(l.output, "100x1024x2048\n4096x28672x8192\n");
  }
}

// The Python port (python/tdist/bench.py, loaded as a file: no extension module needed) gives the
// same lists for the same seeds.
TEST(RandomSweep, PythonPortGivesTheSameLists) {
  const std::string bench_py = std::string(TDIST_SOURCE_DIR) + "/python/tdist/bench.py";
  if (run("python3 -c 'pass' >/dev/null 2>&1").exit_code != 0) GTEST_SKIP() << "no python3";
  ASSERT_TRUE(std::filesystem::exists(bench_py)) << bench_py;
  const std::vector<uint64_t> seeds = {0, 1, 2, 7, 12345, 0x7FFFFFFFFFFFFFFFull};
  std::string seed_list;
  for (uint64_t s : seeds) seed_list += (seed_list.empty() ? "" : ",") + std::to_string(s);
  const std::string script =
      "import importlib.util as u\n"
      "spec = u.spec_from_file_location('tdist_bench_port', '" + bench_py + "')\n"
      "b = u.module_from_spec(spec); spec.loader.exec_module(b)\n"
      "for seed in [" + seed_list + "]:\n"
      "    for elem in (2, 4):\n"
      "        print('sizes', seed, elem, *b.random_sizes(300, seed, elem))\n"
      "    print('shapes', seed, *('%dx%dx%d' % s for s in b.random_gemm_shapes(300, seed)))\n";
  const std::string path = ::testing::TempDir() + "/tdist_random_sweep_port.py";
  {
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr) << path;
    std::fputs(script.c_str(), f);
    std::fclose(f);
  }
  const Result r = run("python3 " + path + " 2>&1");
  std::remove(path.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ostringstream want;
  for (uint64_t seed : seeds) {
    for (uint64_t elem : {2, 4}) {
      want << "sizes " << seed << " " << elem;
      for (uint64_t s : sweep::random_sizes(300, seed, elem)) want << " " << s;
      want << "\n";
    }
    want << "shapes " << seed;
    for (const auto& s : sweep::random_gemm_shapes(300, seed)) want << " " << s.m << "x" << s.n << "x" << s.k;
    want << "\n";
  }
  EXPECT_EQ(r.output, want.str());
}

}  // namespace
