// The host side of aborted device waits without a GPU: the action from the environment, the
// message built from a fault record, and that nothing is reported before a record exists.
#include <gtest/gtest.h>

#include <string>

#include "errors.hpp"
#include "test_env.hpp"
#include "tdist/runtime/device_fault.hpp"

namespace {

using tdist::device::FaultRecord;
using tdist::device::TimeoutAction;

TEST(DeviceFault, ActionFromEnvironment) {
  {
    tdist::test::ScopedEnv env("TDIST_WAIT_TIMEOUT_ACTION", nullptr);
    EXPECT_EQ(tdist::wait_timeout_action_from_env(), TimeoutAction::kAbort);
  }
  {
    tdist::test::ScopedEnv env("TDIST_WAIT_TIMEOUT_ACTION", "trap");
    EXPECT_EQ(tdist::wait_timeout_action_from_env(), TimeoutAction::kTrap);
  }
  {
    tdist::test::ScopedEnv env("TDIST_WAIT_TIMEOUT_ACTION", "abort");
    EXPECT_EQ(tdist::wait_timeout_action_from_env(), TimeoutAction::kAbort);
  }
  tdist::test::ScopedEnv env("TDIST_WAIT_TIMEOUT_ACTION", "crash");
  const std::string error = tdist::test::error_of([] { tdist::wait_timeout_action_from_env(); });
  EXPECT_NE(error.find("TDIST_WAIT_TIMEOUT_ACTION"), std::string::npos) << error;
  EXPECT_NE(error.find("abort"), std::string::npos) << error;
  EXPECT_NE(error.find("trap"), std::string::npos) << error;
}

TEST(DeviceFault, MessageNamesEverythingRecorded) {
  FaultRecord r{};
  r.state = tdist::device::kFaultRecorded;
  r.site = static_cast<unsigned>(tdist::device::WaitSite::kLl128Read);
  r.rank = 5;
  r.cmp = static_cast<unsigned>(tdist::device::Cmp::kEq);
  r.block[0] = 17, r.block[1] = 2, r.block[2] = 0;
  r.thread[0] = 96;
  r.address = 0x7f00deadbe00ull;
  r.expected = 42;
  r.seen = 41;
  r.timeout_ns = 2500000000ull;
  const std::string m = tdist::describe_device_fault(r);
  for (const char* part : {"on rank 5", "LL128", "block (17,2,0)", "thread (96,0,0)", "0x7f00deadbe00", "== 42",
                           "saw 41", "2.5 s", "TDIST_WAIT_TIMEOUT_S", "still usable"})
    EXPECT_NE(m.find(part), std::string::npos) << "missing '" << part << "' in: " << m;
}

TEST(DeviceFault, MessageNamesTheOwnerOfTheAddress) {
  FaultRecord r{};
  r.state = tdist::device::kFaultRecorded;
  r.site = static_cast<unsigned>(tdist::device::WaitSite::kSignalWaitUntil);
  r.address = 0x7f00deadbe08ull;
  auto* base = reinterpret_cast<const void*>(0x7f00deadbe00ull);
  EXPECT_EQ(tdist::describe_device_fault(r).find("(tdist's"), std::string::npos);  // nothing named yet

  tdist::name_memory(base, 0x100, "tdist's AllGather-GEMM");
  EXPECT_NE(tdist::describe_device_fault(r).find("0x7f00deadbe08 (tdist's AllGather-GEMM) for a value"),
            std::string::npos)
      << tdist::describe_device_fault(r);
  r.address = 0x7f00deadbf00ull;  // one past the range
  EXPECT_FALSE(tdist::memory_owner(r.address).has_value());
  EXPECT_EQ(tdist::describe_device_fault(r).find("AllGather-GEMM"), std::string::npos);

  // A later name over part of the range replaces the whole earlier one; forgetting removes it.
  tdist::name_memory(reinterpret_cast<const void*>(0x7f00deadbe80ull), 0x100, "tdist's collectives");
  EXPECT_FALSE(tdist::memory_owner(0x7f00deadbe08ull).has_value());
  EXPECT_EQ(tdist::memory_owner(0x7f00deadbf00ull).value_or(""), "tdist's collectives");
  EXPECT_EQ(tdist::memory_owner(0x7f00deadbe80ull).value_or(""), "tdist's collectives");
  tdist::forget_memory_names(base, 0x1000);
  EXPECT_FALSE(tdist::memory_owner(0x7f00deadbe80ull).has_value());
}

TEST(DeviceFault, NothingReportedWithoutARecord) {
  // No CUDA context here: the record is never allocated, and checking is free of side effects.
  EXPECT_FALSE(tdist::device_fault_message().has_value());
  EXPECT_NO_THROW(tdist::check_device_faults());
  EXPECT_NO_THROW(tdist::clear_device_fault());
}

TEST(DeviceFault, DeviceTimeoutErrorIsATimeoutError) {
  try {
    throw tdist::DeviceTimeoutError("x");
  } catch (const tdist::TimeoutError& e) {
    EXPECT_STREQ(e.what(), "x");
    return;
  }
  ADD_FAILURE() << "DeviceTimeoutError is not a TimeoutError";
}

}  // namespace
