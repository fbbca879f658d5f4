// Levelled diagnostics of the host library, on stderr, named after NCCL_DEBUG:
//
//   TDIST_DEBUG=NONE|WARN|INFO|TRACE   how much to print (default WARN)
//   TDIST_DEBUG_SUBSYS=JIT,INIT,...    only these subsystems; "^JIT,TUNE" all but these; ALL (default)
//   TDIST_JIT_VERBOSE=1                alias kept from before: JIT at TRACE, whatever TDIST_DEBUG says
//
// TDIST_INFO(JIT, "compiled ", name) and its siblings print at that level when enabled.
// A line reads "host:pid [rank R] TDIST INFO JIT: message" (rank once a World exists). Settings
// are read once, at the first log call.
#pragma once

#include <string>

#include "tdist/common/error.hpp"

namespace tdist::log {

enum class Level { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

const char* to_string(Level level);
// "WARN", "info", ... ; throws tdist::Error naming `what` and the accepted names otherwise.
Level parse_level(const std::string& text, const char* what = "TDIST_DEBUG");
// Whether a comma list of TDIST_DEBUG_SUBSYS form lets `subsys` through (case-insensitive).
bool subsys_matches(const std::string& filter, const std::string& subsys);

// The settings in effect (environment, read once).
Level level();
bool enabled(Level level, const char* subsys);
void write(Level level, const char* subsys, const std::string& message);

}  // namespace tdist::log

// TDIST_LOG(kInfo, JIT, "compiled ", name, " in ", ms, " ms"): the message is built only when printed.
#define TDIST_LOG(LEVEL, SUBSYS, ...)                                                                 \
  do {                                                                                                \
    if (::tdist::log::enabled(::tdist::log::Level::LEVEL, #SUBSYS))                                   \
      ::tdist::log::write(::tdist::log::Level::LEVEL, #SUBSYS, ::tdist::detail::concat(__VA_ARGS__)); \
  } while (0)
#define TDIST_WARN(SUBSYS, ...) TDIST_LOG(kWarn, SUBSYS, __VA_ARGS__)
#define TDIST_INFO(SUBSYS, ...) TDIST_LOG(kInfo, SUBSYS, __VA_ARGS__)
#define TDIST_TRACE(SUBSYS, ...) TDIST_LOG(kTrace, SUBSYS, __VA_ARGS__)
