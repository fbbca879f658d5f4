// Errors of the host library: every failure is a tdist::Error whose message names
// the file and line that detected it, the failing call, and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tdist {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A host-side wait (rendezvous, barrier, launcher) ran past its deadline.
class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& what) : Error(what) {}
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename E = Error, typename... Args>
[[noreturn]] void throw_at(const char* file, int line, Args&&... args) {
  throw E(concat(file, ":", line, ": ", std::forward<Args>(args)...));
}

}  // namespace detail
}  // namespace tdist

// Throws tdist::Error with the message parts concatenated, prefixed by file:line.
#define TDIST_FAIL(...) ::tdist::detail::throw_at(__FILE__, __LINE__, __VA_ARGS__)

#define TDIST_CHECK(cond, ...)                                                                             \
  do {                                                                                                     \
    if (!(cond)) ::tdist::detail::throw_at(__FILE__, __LINE__, "check failed (" #cond "): ", __VA_ARGS__); \
  } while (0)

// Validates a caller's argument: the message names the argument and what was expected.
#define TDIST_CHECK_ARG(cond, arg, ...)                                                                      \
  do {                                                                                                       \
    if (!(cond)) ::tdist::detail::throw_at(__FILE__, __LINE__, "invalid argument '" arg "': ", __VA_ARGS__); \
  } while (0)
