// An environment variable set (or unset) for one scope; for the CPU and the GPU tests alike (no
// test framework needed).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace tdist::test {

// Sets `name` to `value` (unsets it for nullopt) until the end of the scope, then restores it.
struct ScopedEnv {
  const char* name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, std::optional<std::string> value) : name(n) {
    if (const char* o = std::getenv(n)) old = o;
    if (value)
      setenv(n, value->c_str(), 1);
    else
      unsetenv(n);
  }
  ScopedEnv(const char* n, const char* value)
      : ScopedEnv(n, value ? std::optional<std::string>(value) : std::nullopt) {}
  ~ScopedEnv() {
    if (old)
      setenv(name, old->c_str(), 1);
    else
      unsetenv(name);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

}  // namespace tdist::test
