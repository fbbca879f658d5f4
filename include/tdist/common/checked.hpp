// Size arithmetic that cannot wrap: every product or sum of sizes that comes from a caller, an
// environment setting or the wire goes through these, so an absurd size is an error naming what
// was being computed instead of a small number that passes every later check.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "tdist/common/error.hpp"

namespace tdist {

// a * b; throws tdist::Error naming `what` (e.g. "workspace bytes") when it does not fit in T.
template <typename T>
T checked_mul(T a, T b, const char* what) {
  static_assert(std::is_integral_v<T>, "checked_mul takes integers");
  T out{};
  if (__builtin_mul_overflow(a, b, &out))
    TDIST_FAIL("size overflow computing ", what, ": ", +a, " * ", +b, " does not fit in ", sizeof(T) * 8, "-bit ",
               std::is_signed_v<T> ? "signed" : "unsigned", " integers");
  return out;
}

// a + b; throws tdist::Error naming `what` when it does not fit in T.
template <typename T>
T checked_add(T a, T b, const char* what) {
  static_assert(std::is_integral_v<T>, "checked_add takes integers");
  T out{};
  if (__builtin_add_overflow(a, b, &out))
    TDIST_FAIL("size overflow computing ", what, ": ", +a, " + ", +b, " does not fit in ", sizeof(T) * 8, "-bit ",
               std::is_signed_v<T> ? "signed" : "unsigned", " integers");
  return out;
}

// value rounded up to a multiple of `alignment` (> 0); throws naming `what` on overflow.
inline size_t checked_align_up(size_t value, size_t alignment, const char* what) {
  TDIST_CHECK_ARG(alignment > 0, "alignment", "expected a positive alignment for ", what, ", got 0");
  const size_t rem = value % alignment;
  return rem == 0 ? value : checked_add(value, alignment - rem, what);
}

}  // namespace tdist
