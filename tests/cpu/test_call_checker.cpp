// Call checking's decisions (tdist/runtime/call_checker.hpp): TDIST_CHECK_CALLS parsed strictly,
// signature keys, which calls are compared under off / first / always, the bound on remembered
// signatures, equal decisions for equal call sequences (what keeps ranks in step), and the host
// cost per call of a signature already seen.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "cpu/errors.hpp"
#include "cpu/test_env.hpp"
#include "tdist/runtime/call_checker.hpp"
#include "tdist/runtime/world.hpp"  // call_compare_bound, call_compare_timeout_message

namespace {

using tdist::CallChecker;
using tdist::CallCheckMode;
using tdist::CallKey;
using tdist::test::ScopedEnv;

TEST(CallCheckMode, ParsesTheThreeValuesAndTheOldFlags) {
  EXPECT_EQ(tdist::parse_call_check_mode("first"), CallCheckMode::kFirst);
  EXPECT_EQ(tdist::parse_call_check_mode("always"), CallCheckMode::kAlways);
  EXPECT_EQ(tdist::parse_call_check_mode("off"), CallCheckMode::kOff);
  EXPECT_EQ(tdist::parse_call_check_mode("1"), CallCheckMode::kAlways);
  EXPECT_EQ(tdist::parse_call_check_mode("0"), CallCheckMode::kOff);
  for (CallCheckMode m : {CallCheckMode::kOff, CallCheckMode::kFirst, CallCheckMode::kAlways})
    EXPECT_EQ(tdist::parse_call_check_mode(tdist::to_string(m)), m);
}

TEST(CallCheckMode, RejectsOtherValuesNamingTheVariableAndTheAcceptedOnes) {
  for (const char* bad : {"First", "ALWAYS", "on", "true", "yes", "2", " first", "first ", "alway", "-1", "detail"}) {
    const std::string error = tdist::test::error_of([&] { tdist::parse_call_check_mode(bad); });
    ASSERT_FALSE(error.empty()) << "'" << bad << "' was accepted";
    for (const char* part : {"TDIST_CHECK_CALLS", "first", "always", "off"})
      EXPECT_NE(error.find(part), std::string::npos) << "'" << part << "' not in: " << error;
    EXPECT_NE(error.find(std::string("'") + bad), std::string::npos) << "the value is not shown: " << error;
  }
}

TEST(CallCheckMode, FromTheEnvironmentWithFirstAsDefault) {
  {
    ScopedEnv unset("TDIST_CHECK_CALLS", std::nullopt);
    EXPECT_EQ(tdist::call_check_mode_from_env(), CallCheckMode::kFirst);
  }
  {
    ScopedEnv empty("TDIST_CHECK_CALLS", "");
    EXPECT_EQ(tdist::call_check_mode_from_env(), CallCheckMode::kFirst);
  }
  {
    ScopedEnv always("TDIST_CHECK_CALLS", "always");
    EXPECT_EQ(tdist::call_check_mode_from_env(), CallCheckMode::kAlways);
  }
  {
    ScopedEnv off("TDIST_CHECK_CALLS", "0");
    EXPECT_EQ(tdist::call_check_mode_from_env(), CallCheckMode::kOff);
  }
  {
    ScopedEnv bad("TDIST_CHECK_CALLS", "sometimes");
    const std::string error = tdist::test::error_of([] { tdist::call_check_mode_from_env(); });
    EXPECT_NE(error.find("TDIST_CHECK_CALLS='sometimes'"), std::string::npos) << error;
  }
}

// A collective call's key as the ops build it: op, count, dtype, method, buffer kinds.
uint64_t collective_key(const char* op, uint64_t count, int dtype, int method, bool in_sym, bool out_sym, bool in_place,
                        bool aligned) {
  return CallKey(op).add(count).add(dtype).add(method).add(in_sym).add(out_sym).add(in_place).add(aligned).value();
}

TEST(CallKey, EqualFieldsEqualKeysAnyChangedFieldAnotherKey) {
  const uint64_t base = collective_key("all_reduce", 1000, 2, 0, true, false, false, true);
  EXPECT_EQ(base, collective_key("all_reduce", 1000, 2, 0, true, false, false, true));
  const std::vector<uint64_t> changed = {
      collective_key("all_gather", 1000, 2, 0, true, false, false, true),
      collective_key("all_reduce", 1008, 2, 0, true, false, false, true),
      collective_key("all_reduce", 1000 + (uint64_t{1} << 40), 2, 0, true, false, false, true),  // high bytes count
      collective_key("all_reduce", 1000, 1, 0, true, false, false, true),
      collective_key("all_reduce", 1000, 2, 1, true, false, false, true),
      collective_key("all_reduce", 1000, 2, 0, false, false, false, true),
      collective_key("all_reduce", 1000, 2, 0, true, true, false, true),
      collective_key("all_reduce", 1000, 2, 0, true, false, true, true),
      collective_key("all_reduce", 1000, 2, 0, true, false, false, false),
  };
  std::unordered_set<uint64_t> keys = {base};
  for (uint64_t k : changed) EXPECT_TRUE(keys.insert(k).second) << "a changed field kept the key " << k;
}

TEST(CallKey, FieldBoundariesAndOrderCount) {
  EXPECT_NE(CallKey("ab").add(std::string_view("c")).value(), CallKey("a").add(std::string_view("bc")).value());
  EXPECT_NE(CallKey("op").add(int64_t{1}).add(int64_t{2}).value(),
            CallKey("op").add(int64_t{2}).add(int64_t{1}).value());
  EXPECT_NE(CallKey("op").add(int64_t{-1}).value(), CallKey("op").add(int64_t{1}).value());
  EXPECT_NE(CallKey("op").value(), CallKey("op").add(int64_t{0}).value());
}

TEST(CallKey, NoCollisionsAmongManyRandomSignatures) {
  std::mt19937_64 rng(std::random_device{}());
  std::unordered_set<uint64_t> fields_seen, keys;
  for (int i = 0; i < 200000; ++i) {
    const uint64_t count = rng() % (uint64_t{1} << 34);
    const int dtype = static_cast<int>(rng() % 3), method = static_cast<int>(rng() % 7);
    const unsigned kinds = static_cast<unsigned>(rng() % 16);
    const uint64_t fields = count << 12 | uint64_t(dtype) << 8 | uint64_t(method) << 4 | kinds;
    if (!fields_seen.insert(fields).second) continue;  // the same signature drawn twice
    const uint64_t key = collective_key("all_gather", count, dtype, method, kinds & 1, kinds & 2, kinds & 4, kinds & 8);
    EXPECT_TRUE(keys.insert(key).second) << "two signatures share key " << key;
  }
}

TEST(CallChecker, OffComparesNothingAlwaysEverything) {
  CallChecker off(CallCheckMode::kOff), always(CallCheckMode::kAlways);
  for (uint64_t key : {uint64_t{0}, uint64_t{1}, ~uint64_t{0}}) {
    EXPECT_FALSE(off.must_compare(key));
    EXPECT_TRUE(always.must_compare(key));
    always.record(key);
    EXPECT_TRUE(always.must_compare(key)) << "always compared a recorded key only once";
  }
}

TEST(CallChecker, FirstComparesUntilAComparisonSucceeded) {
  CallChecker c;  // the default mode
  EXPECT_EQ(c.mode(), CallCheckMode::kFirst);
  EXPECT_EQ(c.max_remembered(), CallChecker::kMaxRemembered);
  EXPECT_EQ(CallChecker::kMaxRemembered, 4096u);
  const uint64_t a = collective_key("all_reduce", 1000, 2, 0, false, false, false, true);
  const uint64_t b = collective_key("all_reduce", 1008, 2, 0, false, false, false, true);
  EXPECT_TRUE(c.must_compare(a));
  // A comparison that raised records nothing: the call is compared again next time.
  EXPECT_TRUE(c.must_compare(a));
  c.record(a);
  EXPECT_FALSE(c.must_compare(a));
  EXPECT_TRUE(c.must_compare(b));
  c.record(b);
  EXPECT_FALSE(c.must_compare(b));
  EXPECT_EQ(c.remembered(), 2u);
  c.record(a);  // again: no change
  EXPECT_EQ(c.remembered(), 2u);
  c.forget();
  EXPECT_TRUE(c.must_compare(a));
  EXPECT_TRUE(c.must_compare(b));
}

TEST(CallChecker, ModeChangesKeepTheSeenSignatures) {
  CallChecker c(CallCheckMode::kFirst);
  c.record(7);
  c.set_mode(CallCheckMode::kOff);
  EXPECT_FALSE(c.must_compare(7));
  EXPECT_FALSE(c.must_compare(8));
  c.set_mode(CallCheckMode::kAlways);
  EXPECT_TRUE(c.must_compare(7));
  c.set_mode(CallCheckMode::kFirst);
  EXPECT_FALSE(c.must_compare(7));
  EXPECT_TRUE(c.must_compare(8));
}

TEST(CallChecker, TheBoundClearsTheSetAtTheFirstNewKeyPastIt) {
  CallChecker c(CallCheckMode::kFirst, 4);
  for (uint64_t k = 1; k <= 4; ++k) c.record(k);
  EXPECT_EQ(c.remembered(), 4u);
  c.record(3);  // known: no clear
  EXPECT_EQ(c.remembered(), 4u);
  EXPECT_EQ(c.clears(), 0u);
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_FALSE(c.must_compare(k));
  c.record(5);
  EXPECT_EQ(c.clears(), 1u);
  EXPECT_EQ(c.remembered(), 1u);
  EXPECT_FALSE(c.must_compare(5));
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_TRUE(c.must_compare(k)) << "key " << k << " survived the clear";
}

TEST(CallChecker, TheDefaultBoundHolds4096Signatures) {
  CallChecker c;
  for (uint64_t k = 0; k < CallChecker::kMaxRemembered; ++k) c.record(k * 0x9e3779b97f4a7c15ull);
  EXPECT_EQ(c.remembered(), CallChecker::kMaxRemembered);
  EXPECT_EQ(c.clears(), 0u);
  c.record(12345);
  EXPECT_EQ(c.remembered(), 1u);
  EXPECT_EQ(c.clears(), 1u);
}

TEST(CallChecker, RejectsAZeroBoundNamingIt) {
  tdist::test::expect_arg_error([] { CallChecker c(CallCheckMode::kFirst, 0); }, "max_remembered");
}

// Two ranks that make the same calls in the same order decide alike at every call, bound and clears
// included: neither waits in a comparison the other skips.
TEST(CallChecker, EqualCallSequencesGiveEqualDecisions) {
  std::mt19937_64 rng(std::random_device{}());
  CallChecker r0(CallCheckMode::kFirst, 64), r1(CallCheckMode::kFirst, 64);
  size_t compared = 0;
  for (int i = 0; i < 20000; ++i) {
    // Mostly a few hot signatures, sometimes one of many cold ones (forces clears).
    const uint64_t key = rng() % 4 != 0 ? rng() % 16 : 1000 + rng() % 5000;
    const bool c0 = r0.must_compare(key), c1 = r1.must_compare(key);
    ASSERT_EQ(c0, c1) << "call " << i;
    if (c0) {
      ++compared;
      r0.record(key);
      r1.record(key);
    }
  }
  EXPECT_EQ(r0.clears(), r1.clears());
  EXPECT_GT(r0.clears(), 0u);
  EXPECT_LT(compared, 20000u);
}

// The host cost `first` adds to a call whose signature was seen: building its key and one lookup.
TEST(CallChecker, CostPerSeenCallIsWellUnderAMicrosecond) {
  CallChecker c;
  std::vector<uint64_t> counts(256);
  std::mt19937_64 rng(std::random_device{}());
  for (auto& n : counts) {
    n = 1 + rng() % (uint64_t{1} << 28);
    c.record(collective_key("all_reduce", n, 2, 0, true, true, false, true));
  }
  // Fill the set to its bound so that the lookup runs on a full table.
  for (uint64_t k = c.remembered(); k < CallChecker::kMaxRemembered; ++k) c.record(rng());
  constexpr int kCalls = 1 << 20;
  double best_ns = 1e9;
  size_t compares = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) {
      const uint64_t key = collective_key("all_reduce", counts[i & 255], 2, 0, true, true, false, true);
      compares += c.must_compare(key) ? 1 : 0;
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    best_ns = std::min(best_ns, ns / kCalls);
  }
  EXPECT_EQ(compares, 0u);
  std::printf("call check (first, seen signature): %.1f ns per call (key of 8 fields + lookup in %zu)\n", best_ns,
              c.remembered());
  RecordProperty("ns_per_call", std::to_string(best_ns));
  EXPECT_LT(best_ns, 1000.0);
}

// The comparison's bound: the device wait timeout in whole milliseconds, rounded up, unless the host
// timeout is shorter; bad inputs name the argument.
TEST(CallCompareBound, IsTheWaitTimeoutUnlessTheHostTimeoutIsShorter) {
  using namespace std::chrono_literals;
  auto b = tdist::call_compare_bound(300s, 60.0);  // the defaults
  EXPECT_EQ(b.timeout, 60s);
  EXPECT_STREQ(b.setting, "the device wait timeout, TDIST_WAIT_TIMEOUT_S");
  b = tdist::call_compare_bound(300s, 2.0);
  EXPECT_EQ(b.timeout, 2s);
  b = tdist::call_compare_bound(5s, 60.0);
  EXPECT_EQ(b.timeout, 5s);
  EXPECT_STREQ(b.setting, "the host timeout, TDIST_HOST_TIMEOUT_S");
  b = tdist::call_compare_bound(2s, 2.0);  // equal: the wait timeout's name
  EXPECT_EQ(b.timeout, 2s);
  EXPECT_STREQ(b.setting, "the device wait timeout, TDIST_WAIT_TIMEOUT_S");
  // Rounded up, never below the device waits' timeout nor to 0; exact decimals stay exact.
  EXPECT_EQ(tdist::call_compare_bound(300s, 0.001).timeout, 1ms);
  EXPECT_EQ(tdist::call_compare_bound(300s, 0.0001).timeout, 1ms);
  EXPECT_EQ(tdist::call_compare_bound(300s, 0.007).timeout, 7ms);
  EXPECT_EQ(tdist::call_compare_bound(300s, 1.5).timeout, 1500ms);
  EXPECT_EQ(tdist::call_compare_bound(300s, 1.2345).timeout, 1235ms);
  EXPECT_EQ(tdist::call_compare_bound(100000000ms, 86400.0).timeout, 86400s);
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 1000; ++i) {
    const double s = std::uniform_real_distribution<double>(0.001, 86400.0)(rng);
    const auto t = tdist::call_compare_bound(100000000ms, s).timeout;
    EXPECT_GE(t.count() / 1000.0, s - 1e-9) << s;
    EXPECT_LT(t.count() / 1000.0, s + 0.001 + 1e-9) << s;
  }
  tdist::test::expect_arg_error([] { tdist::call_compare_bound(0ms, 1.0); }, "host_timeout");
  tdist::test::expect_arg_error([] { tdist::call_compare_bound(1s, 0.0); }, "wait_timeout_seconds");
  tdist::test::expect_arg_error([] { tdist::call_compare_bound(1s, -1.0); }, "wait_timeout_seconds");
  tdist::test::expect_arg_error([] { tdist::call_compare_bound(1s, std::nan("")); }, "wait_timeout_seconds");
}

TEST(CallCompareBound, TimeoutMessageNamesTheCallTheBoundAndUnderFirstTheHint) {
  using namespace std::chrono_literals;
  const std::string store_error = "rank 0: all_gather('x') timed out after 2000 ms; ranks that never arrived: 1";
  const std::string call = "all_gather(count=4096, bf16, method auto)";
  const tdist::CallCompareBound bound{2000ms, "the device wait timeout, TDIST_WAIT_TIMEOUT_S"};
  const std::string first = tdist::call_compare_timeout_message(store_error, call, bound, CallCheckMode::kFirst);
  EXPECT_NE(first.find("this rank compared its call " + call), std::string::npos) << first;
  EXPECT_NE(first.find("did not arrive within 2000 ms (the device wait timeout, TDIST_WAIT_TIMEOUT_S)"),
            std::string::npos)
      << first;
  EXPECT_NE(first.find(store_error), std::string::npos) << first;
  EXPECT_NE(first.find("Under TDIST_CHECK_CALLS=first"), std::string::npos) << first;
  EXPECT_NE(first.find("TDIST_CHECK_CALLS=always compares every call"), std::string::npos) << first;
  const std::string always = tdist::call_compare_timeout_message(store_error, call, bound, CallCheckMode::kAlways);
  EXPECT_NE(always.find("this rank compared its call " + call), std::string::npos) << always;
  EXPECT_NE(always.find(store_error), std::string::npos) << always;
  EXPECT_EQ(always.find("Under TDIST_CHECK_CALLS=first"), std::string::npos) << always;
  EXPECT_NE(always.find("died, hung, or skipped the call"), std::string::npos) << always;
}

}  // namespace
