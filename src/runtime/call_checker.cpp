#include "tdist/runtime/call_checker.hpp"

#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"

namespace tdist {

const char* to_string(CallCheckMode mode) {
  switch (mode) {
    case CallCheckMode::kOff: return "off";
    case CallCheckMode::kFirst: return "first";
    case CallCheckMode::kAlways: return "always";
  }
  return "invalid";
}

CallCheckMode parse_call_check_mode(std::string_view text) {
  // Exact spellings only, as env::parse_choice: a typo must not silently mean another mode.
  const std::string mode = env::parse_choice(kCheckCallsEnv, text, {"first", "always", "off", "1", "0"});
  if (mode == "first") return CallCheckMode::kFirst;
  if (mode == "always" || mode == "1") return CallCheckMode::kAlways;
  return CallCheckMode::kOff;
}

CallCheckMode call_check_mode_from_env() {
  const auto v = env::get(kCheckCallsEnv);
  return v ? parse_call_check_mode(*v) : CallCheckMode::kFirst;
}

CallChecker::CallChecker(CallCheckMode mode, size_t max_remembered) : mode_(mode), max_remembered_(max_remembered) {
  TDIST_CHECK_ARG(max_remembered >= 1, "max_remembered", "expected at least 1 signature, got ", max_remembered);
  seen_.reserve(max_remembered_ < kMaxRemembered ? max_remembered_ : kMaxRemembered);
}

void CallChecker::record(uint64_t key) {
  if (seen_.size() >= max_remembered_ && seen_.find(key) == seen_.end()) {
    seen_.clear();  // bucket array kept: no rehash on the way back up
    ++clears_;
  }
  seen_.insert(key);
}

}  // namespace tdist
