// Strict TDIST_* settings (tdist/common/env.hpp) and size arithmetic that cannot wrap
// (tdist/common/checked.hpp, the symmetric heap's size functions, the collectives' heap sizes).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include "cpu/test_env.hpp"
#include "tdist/common/checked.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/collectives.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/wait_config.hpp"

namespace env = tdist::env;

namespace {

using tdist::test::free_port;
using tdist::test::ScopedEnv;

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// Runs `fn`, expecting a tdist::Error whose message holds every one of `parts`.
template <typename F>
void expect_error(F&& fn, std::initializer_list<std::string> parts, const std::string& label) {
  try {
    fn();
    ADD_FAILURE() << label << ": accepted";
  } catch (const tdist::Error& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << label << ": '" << p << "' not in: " << e.what();
  }
}

}  // namespace

TEST(Settings, IntegersAreDecimalAndBounded) {
  EXPECT_EQ(env::parse_int("TDIST_X", "0", 0, 10), 0);
  EXPECT_EQ(env::parse_int("TDIST_X", "10", 0, 10), 10);
  EXPECT_EQ(env::parse_int("TDIST_X", "-3", -5, 5), -3);
  EXPECT_EQ(env::parse_int("TDIST_X", "-9223372036854775808", INT64_MIN, 0), INT64_MIN);
  for (const char* bad :
       {"", "11", "-1", "0x10", "010x", "1e3", "+5", " 5", "5 ", "5\n", "abc", "1.5", "99999999999999999999", "-"})
    expect_error([&] { env::parse_int("TDIST_X", bad, 0, 10); }, {"TDIST_X", "from 0 to 10"},
                 std::string("int '") + bad + "'");
  expect_error([] { env::parse_int("TDIST_X", "-6", -5, 5); }, {"TDIST_X='-6'"}, "below min");
}

TEST(Settings, DurationsAreDecimalSecondsWithinBounds) {
  EXPECT_DOUBLE_EQ(env::parse_seconds("TDIST_T", "2.5", 0.001, 86400), 2.5);
  EXPECT_DOUBLE_EQ(env::parse_seconds("TDIST_T", "0.001", 0.001, 86400), 0.001);
  EXPECT_DOUBLE_EQ(env::parse_seconds("TDIST_T", "86400", 0.001, 86400), 86400);
  for (const char* bad : {"1e-9", "0", "0.0001", "9936000", "86400.5", "0x10", "-1", "+1", "inf", "nan", "1e3", ".5",
                          "5.", "5s", "1,5", " 1"})
    expect_error([&] { env::parse_seconds("TDIST_T", bad, 0.001, 86400); },
                 {"TDIST_T", std::string("'") + bad + "'", "seconds"}, std::string("seconds '") + bad + "'");
}

TEST(Settings, SizesCannotWrap) {
  EXPECT_EQ(env::parse_size("TDIST_S", "512M", 1, kMax), 512ull << 20);
  EXPECT_EQ(env::parse_size("TDIST_S", "2g", 1, kMax), 2ull << 30);
  EXPECT_EQ(env::parse_size("TDIST_S", "1048576", 1, kMax), 1048576ull);
  EXPECT_EQ(env::parse_size("TDIST_S", "16777215T", 1, kMax), 16777215ull << 40);
  // 17179869185 G is 2^64 + 1 GiB: it once wrapped to 1 GiB.
  for (const char* bad :
       {"17179869185G", "16777216T", "18446744073709551616", "0", "12X", "M", "1.5G", "-1G", "0x10", "1 G", "1GB"})
    expect_error([&] { env::parse_size("TDIST_S", bad, 1, kMax); }, {"TDIST_S", std::string("'") + bad + "'"},
                 std::string("size '") + bad + "'");
  expect_error([] { env::parse_size("TDIST_S", "2T", 1, 1ull << 40); }, {"TDIST_S", "1099511627776"}, "above max");

  EXPECT_EQ(tdist::SymmetricHeap::parse_size("3G", "heap_size"), 3ull << 30);
  expect_error([] { tdist::SymmetricHeap::parse_size("17179869185G", "TDIST_SYMMETRIC_HEAP_SIZE"); },
               {"TDIST_SYMMETRIC_HEAP_SIZE", "17179869185G"}, "heap parse_size wrap");
  expect_error([] { tdist::SymmetricHeap::parse_size("99999999999999999999", "heap_size"); }, {"heap_size"},
               "heap parse_size digits");
}

TEST(Settings, BooleansAndChoices) {
  EXPECT_TRUE(env::parse_bool("TDIST_B", "1"));
  EXPECT_TRUE(env::parse_bool("TDIST_B", "on"));
  EXPECT_FALSE(env::parse_bool("TDIST_B", "false"));
  EXPECT_FALSE(env::parse_bool("TDIST_B", "0"));
  for (const char* bad : {"2", "yes please", "tru", " 1", "-1"})
    expect_error([&] { env::parse_bool("TDIST_B", bad); }, {"TDIST_B", "true"}, bad);
  EXPECT_EQ(env::parse_choice("TDIST_C", "nvcc", {"auto", "nvrtc", "nvcc"}), "nvcc");
  expect_error(
      [] {
        env::parse_choice("TDIST_C", "NVCC ", {"auto", "nvrtc", "nvcc"});
      },
      {"TDIST_C", "one of auto, nvrtc, nvcc"}, "choice");
}

TEST(Settings, ProcessSettingsNameTheVariable) {
  {
    ScopedEnv v("TDIST_WAIT_TIMEOUT_S", nullptr);
    EXPECT_DOUBLE_EQ(tdist::wait_timeout_seconds_from_env(), tdist::device::kDefaultWaitTimeoutSeconds);
  }
  {
    ScopedEnv v("TDIST_WAIT_TIMEOUT_S", "");
    EXPECT_DOUBLE_EQ(tdist::wait_timeout_seconds_from_env(), tdist::device::kDefaultWaitTimeoutSeconds);
  }
  {
    ScopedEnv v("TDIST_WAIT_TIMEOUT_S", "30");
    EXPECT_DOUBLE_EQ(tdist::wait_timeout_seconds_from_env(), 30.0);
  }
  // 1e-9 made every device wait trap at once; 0x10 and 115 days were taken as well.
  for (const char* bad : {"1e-9", "0x10", "9936000", "abc"}) {
    ScopedEnv v("TDIST_WAIT_TIMEOUT_S", bad);
    expect_error([] { tdist::wait_timeout_seconds_from_env(); }, {"TDIST_WAIT_TIMEOUT_S", bad}, bad);
  }
  {
    ScopedEnv v("TDIST_OVERLAP_PIECES", "0x2");
    expect_error([] { env::integer("TDIST_OVERLAP_PIECES", 0, 1, 64); }, {"TDIST_OVERLAP_PIECES='0x2'"}, "pieces");
  }
  {
    ScopedEnv v("TDIST_JIT_VERBOSE", "maybe");
    expect_error([] { env::flag("TDIST_JIT_VERBOSE"); }, {"TDIST_JIT_VERBOSE='maybe'"}, "flag");
  }
  {
    ScopedEnv v("TDIST_SYMMETRIC_HEAP_SIZE", "17179869185G");
    expect_error([] { env::size("TDIST_SYMMETRIC_HEAP_SIZE", 1, 1, 1ull << 40); },
                 {"TDIST_SYMMETRIC_HEAP_SIZE='17179869185G'"}, "heap env");
  }
}

TEST(CheckedSizes, MulAndAddThrowNamingWhat) {
  EXPECT_EQ(tdist::checked_mul<size_t>(3, 5, "x"), 15u);
  EXPECT_EQ(tdist::checked_add<size_t>(3, 5, "x"), 8u);
  expect_error([] { tdist::checked_mul<size_t>(size_t(1) << 63, 2, "the workspace bytes"); },
               {"the workspace bytes", "overflow"}, "mul");
  expect_error([] { tdist::checked_add<size_t>(SIZE_MAX, 1, "the heap total"); }, {"the heap total"}, "add");
  expect_error([] { tdist::checked_align_up(SIZE_MAX - 3, 256, "the capacity"); }, {"the capacity"}, "align");
  EXPECT_EQ(tdist::checked_align_up(257, 256, "x"), 512u);
}

TEST(CheckedSizes, SymmetricArraysAndFirstFit) {
  EXPECT_EQ(tdist::SymmetricHeap::array_bytes(10, 8), 80u);
  expect_error([] { tdist::SymmetricHeap::array_bytes(SIZE_MAX / 4 + 1, 4); }, {"symmetric array"}, "array");

  const std::map<size_t, size_t> free_blocks = {{100, 1000}, {4096, 8192}};
  const auto before = free_blocks;
  EXPECT_EQ(tdist::SymmetricHeap::first_fit(free_blocks, 1000, 1), std::optional<size_t>(100));
  EXPECT_EQ(tdist::SymmetricHeap::first_fit(free_blocks, 800, 256), std::optional<size_t>(256));
  EXPECT_EQ(tdist::SymmetricHeap::first_fit(free_blocks, 1000, 256), std::optional<size_t>(4096));
  EXPECT_EQ(tdist::SymmetricHeap::first_fit(free_blocks, 8192, 256), std::optional<size_t>(4096));
  EXPECT_EQ(tdist::SymmetricHeap::first_fit(free_blocks, 8193, 256), std::nullopt);
  // A size near 2^64 once wrapped in "offset + bytes <= end" and fitted anywhere.
  for (size_t huge : {SIZE_MAX, SIZE_MAX - 4095, size_t(1) << 63})
    EXPECT_EQ(tdist::SymmetricHeap::first_fit(free_blocks, huge, 256), std::nullopt) << huge;
  EXPECT_EQ(free_blocks, before);
}

TEST(CheckedSizes, CollectivesWorkspaceCannotWrap) {
  const size_t ok = tdist::Collectives::heap_bytes(2, 1 << 20, 8);
  EXPECT_GE(ok, size_t(2) << 20);
  // 2 * (2^63 + 256) wrapped to a 512-byte workspace.
  expect_error([] { tdist::Collectives::heap_bytes(2, (size_t(1) << 63) + 256, 8); }, {"collectives"}, "2x");
  expect_error([] { tdist::Collectives::heap_bytes(2, SIZE_MAX, 8); }, {"collectives"}, "round up");
  expect_error([] { tdist::Collectives::heap_bytes(2, (size_t(1) << 63) - 256, 8); }, {"collectives"}, "total");
}
