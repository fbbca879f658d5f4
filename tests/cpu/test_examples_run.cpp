// The tutorial programs fail cleanly where they cannot run: --help and bad options without touching
// a GPU, a clear error without a launcher (a world of one rank), and, on a machine without a GPU,
// a clear error through tdistrun. Each failure ends with "0 passed, 1 failed" and exit code 1 (2
// for a usage error), never a crash.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "tdist/jit/launch.hpp"

namespace jit = tdist::jit;

namespace {

const std::string kBinaryDir = TDIST_BINARY_DIR;
const char* const kPrograms[] = {"example_01_notify_wait", "example_02_allgather", "example_03_low_latency_all_to_all",
                                 "example_04_gemm_wait_flags"};

struct Result {
  int exit_code = -1;  // -1: killed by a signal
  std::string output;  // stdout and stderr
};

Result run(const std::string& command) {
  Result result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

std::string program_path(const char* program) { return kBinaryDir + "/examples/" + program; }

// No launcher variables: the program sees a world of one rank.
const std::string kWithoutLauncher =
    "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE "
    "-u SLURM_PROCID -u SLURM_NTASKS ";

bool gpu_present() {
  const Result smi = run("nvidia-smi -L");
  return jit::driver_available() || (smi.exit_code == 0 && smi.output.find("GPU") != std::string::npos);
}

class ExamplesRun : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(program_path(GetParam())))
      GTEST_SKIP() << program_path(GetParam()) << " was not built (TDIST_BUILD_EXAMPLES=OFF?)";
  }
};

}  // namespace

TEST_P(ExamplesRun, HelpNeedsNoGpu) {
  const Result r = run(kWithoutLauncher + program_path(GetParam()) + " --help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("usage: tdistrun -n N --"), std::string::npos) << r.output;
}

TEST_P(ExamplesRun, BadOptionsAreUsageErrors) {
  for (const char* args : {"--no-such-option=1", "--seed=abc", "--seed=-1", "stray", "--seed"}) {
    const Result r = run(kWithoutLauncher + program_path(GetParam()) + " " + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("invalid argument"), std::string::npos) << args << "\n" << r.output;
  }
}

TEST_P(ExamplesRun, OneRankIsAClearError) {
  const Result r = run(kWithoutLauncher + program_path(GetParam()));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("needs at least 2 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("0 passed, 1 failed"), std::string::npos) << r.output;
}

TEST_P(ExamplesRun, NoGpuIsAClearErrorThroughTdistrun) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present: the GPU runs test this program for real";
  const Result r = run(kBinaryDir + "/tools/tdistrun -n 2 --timeout 60 -- " + program_path(GetParam()));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no CUDA device is usable"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("0 passed, 1 failed"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Tutorials, ExamplesRun, ::testing::ValuesIn(kPrograms),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param).substr(8);  // without "example_"
                         });
