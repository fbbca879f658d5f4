// Checking the errors of the library in CPU tests: the message of a tdist::Error a call throws, and
// the expectation that it names an argument.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "tdist/common/error.hpp"

namespace tdist::test {

// The message of the tdist::Error that `f` throws; "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const tdist::Error& e) {
    return e.what();
  }
  return "";
}

// Runs `f`, expects a tdist::Error whose message names 'arg' (quoted, as TDIST_CHECK_ARG writes it).
template <typename F>
void expect_arg_error(F&& f, const std::string& arg) {
  try {
    f();
    ADD_FAILURE() << "no error for '" << arg << "'";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + arg + "'"), std::string::npos) << e.what();
  }
}

}  // namespace tdist::test
