#include "tdist/common/log.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "tdist/common/process.hpp"

namespace tdist::log {
namespace {

std::string upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

struct Settings {
  Level level = Level::kWarn;
  std::string subsys;  // TDIST_DEBUG_SUBSYS; empty: every subsystem
  bool jit_verbose = false;
  std::string prefix;  // "host:pid"
};

// Read once; a bad value is reported on stderr (logging cannot throw into the caller's code path).
const Settings& settings() {
  static const Settings s = [] {
    Settings out;
    if (const char* v = std::getenv("TDIST_DEBUG"); v != nullptr && *v != '\0') {
      try {
        out.level = parse_level(v);
      } catch (const Error& e) {
        std::fprintf(stderr, "tdist: WARN %s; using WARN\n", e.what());
      }
    }
    if (const char* v = std::getenv("TDIST_DEBUG_SUBSYS")) out.subsys = v;
    out.jit_verbose = env_set("TDIST_JIT_VERBOSE");
    char host[256] = {0};
    if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
    out.prefix = std::string(host) + ":" + std::to_string(::getpid());
    return out;
  }();
  return s;
}

}  // namespace

const char* to_string(Level level) {
  switch (level) {
    case Level::kNone: return "NONE";
    case Level::kWarn: return "WARN";
    case Level::kInfo: return "INFO";
    case Level::kTrace: return "TRACE";
  }
  return "?";
}

Level parse_level(const std::string& text, const char* what) {
  const std::string t = upper(trim(text));
  if (t == "NONE" || t == "OFF") return Level::kNone;
  if (t == "WARN") return Level::kWarn;
  if (t == "INFO") return Level::kInfo;
  if (t == "TRACE") return Level::kTrace;
  throw Error(detail::concat("invalid ", what, " '", text, "': expected NONE, WARN, INFO or TRACE"));
}

bool subsys_matches(const std::string& filter, const std::string& subsys) {
  std::string f = upper(trim(filter));
  if (f.empty()) return true;
  // "^A,B": every subsystem but A and B (as NCCL_DEBUG_SUBSYS).
  const bool exclude = f[0] == '^';
  if (exclude) f.erase(0, 1);
  const std::string name = upper(subsys);
  bool listed = false;
  for (size_t start = 0; start <= f.size();) {
    size_t end = f.find(',', start);
    if (end == std::string::npos) end = f.size();
    const std::string item = trim(f.substr(start, end - start));
    if (item == "ALL" || item == name) listed = true;
    start = end + 1;
  }
  return exclude ? !listed : listed;
}

Level level() { return settings().level; }

bool enabled(Level lvl, const char* subsys) {
  const Settings& s = settings();
  if (s.jit_verbose && upper(subsys) == "JIT") return true;
  if (lvl == Level::kNone || static_cast<int>(lvl) > static_cast<int>(s.level)) return false;
  return subsys_matches(s.subsys, subsys);
}

void write(Level lvl, const char* subsys, const std::string& message) {
  const Settings& s = settings();
  std::string line = s.prefix;
  if (const int rank = process_rank(); rank >= 0) line += " [rank " + std::to_string(rank) + "]";
  line += detail::concat(" TDIST ", to_string(lvl), " ", subsys, ": ", message, "\n");
  // One write per line, so that lines of several threads do not interleave.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace tdist::log
