// Strict, uniform reading of tdist's environment settings (TDIST_*).
//
// Rules, the same for every setting:
//   - unset or empty means "not set": the documented default applies;
//   - numbers are plain decimal: no sign unless the range allows negatives, no hex, no exponent,
//     no spaces, nothing after the number (the unit suffix of a size excepted);
//   - every value has bounds; a value outside them is an error, never clamped;
//   - an error names the variable, the value given and what is accepted.
// Header-only, so that the device API's host helpers (timeout.cuh) can use it without libtdist.
#pragma once

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "tdist/common/error.hpp"

namespace tdist::env {

namespace detail {

// The value as shown in an error: quoted, cut when long, control characters escaped.
inline std::string shown(std::string_view text) {
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < 64; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > 64) out += "...";
  return out + "'";
}

[[noreturn]] inline void invalid(const char* file, int line, const char* name, std::string_view text,
                                 const std::string& expected) {
  ::tdist::detail::throw_at(file, line, "environment variable ", name, "=", shown(text), " is invalid: expected ",
                            expected);
}

inline bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// Decimal digits only, into an unsigned 64-bit value; false when empty, not digits, or too large.
inline bool parse_u64(std::string_view s, uint64_t& out) {
  if (!all_digits(s)) return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out, 10);
  return ec == std::errc() && ptr == s.data() + s.size();
}

}  // namespace detail

// The raw value of `name`, or nullopt when it is unset or empty.
inline std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// A decimal integer in [min, max]: "42", or "-3" when min < 0.
inline int64_t parse_int(const char* name, std::string_view text, int64_t min, int64_t max) {
  const std::string expected = ::tdist::detail::concat("a decimal integer from ", min, " to ", max);
  const bool negative = !text.empty() && text[0] == '-';
  uint64_t magnitude = 0;
  if ((negative && min >= 0) || !detail::parse_u64(negative ? text.substr(1) : text, magnitude))
    detail::invalid(__FILE__, __LINE__, name, text, expected);
  constexpr uint64_t kMagnitudeLimit = uint64_t(1) << 63;  // |INT64_MIN|
  if (magnitude > (negative ? kMagnitudeLimit : kMagnitudeLimit - 1))
    detail::invalid(__FILE__, __LINE__, name, text, expected);
  const int64_t value = !negative ? int64_t(magnitude) : magnitude == kMagnitudeLimit ? INT64_MIN : -int64_t(magnitude);
  if (value < min || value > max) detail::invalid(__FILE__, __LINE__, name, text, expected);
  return value;
}

// A duration in seconds, "300" or "2.5" (digits, an optional fraction), in [min_s, max_s].
inline double parse_seconds(const char* name, std::string_view text, double min_s, double max_s) {
  const std::string expected =
      ::tdist::detail::concat("a decimal number of seconds from ", min_s, " to ", max_s, " (e.g. 300 or 2.5)");
  const size_t dot = text.find('.');
  const std::string_view whole = text.substr(0, dot);
  const bool ok = detail::all_digits(whole) &&
                  (dot == std::string_view::npos || detail::all_digits(text.substr(dot + 1))) && whole.size() <= 15;
  if (!ok) detail::invalid(__FILE__, __LINE__, name, text, expected);
  const double value = std::strtod(std::string(text).c_str(), nullptr);
  if (!std::isfinite(value) || value < min_s || value > max_s)
    detail::invalid(__FILE__, __LINE__, name, text, expected);
  return value;
}

// A byte count: decimal digits, then an optional K, M, G or T (binary units, either case), in
// [min, max]. "512M", "2G", "1048576".
inline uint64_t parse_size(const char* name, std::string_view text, uint64_t min, uint64_t max) {
  const std::string expected = ::tdist::detail::concat(
      "a byte count with an optional K, M, G or T suffix (e.g. 512M), from ", min, " to ", max, " bytes");
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  const std::string_view suffix = text.substr(digits);
  unsigned shift = 0;
  if (suffix.empty())
    shift = 0;
  else if (suffix == "K" || suffix == "k")
    shift = 10;
  else if (suffix == "M" || suffix == "m")
    shift = 20;
  else if (suffix == "G" || suffix == "g")
    shift = 30;
  else if (suffix == "T" || suffix == "t")
    shift = 40;
  else
    detail::invalid(__FILE__, __LINE__, name, text, expected);
  uint64_t count = 0;
  if (!detail::parse_u64(text.substr(0, digits), count)) detail::invalid(__FILE__, __LINE__, name, text, expected);
  // Checked before shifting: 17179869185G must not wrap around to a small size.
  if (count > (max >> shift)) detail::invalid(__FILE__, __LINE__, name, text, expected);
  const uint64_t value = count << shift;
  if (value < min) detail::invalid(__FILE__, __LINE__, name, text, expected);
  return value;
}

// 1/0, true/false, on/off, yes/no (lower or upper case).
inline bool parse_bool(const char* name, std::string_view text) {
  for (std::string_view t : {"1", "true", "TRUE", "True", "on", "ON", "yes", "YES"})
    if (text == t) return true;
  for (std::string_view f : {"0", "false", "FALSE", "False", "off", "OFF", "no", "NO"})
    if (text == f) return false;
  detail::invalid(__FILE__, __LINE__, name, text, "1, 0, true, false, on, off, yes or no");
}

// One of `allowed`, spelled exactly.
inline std::string parse_choice(const char* name, std::string_view text,
                                std::initializer_list<std::string_view> allowed) {
  std::string list;
  for (std::string_view a : allowed) {
    if (text == a) return std::string(text);
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  detail::invalid(__FILE__, __LINE__, name, text, "one of " + list);
}

// The settings themselves: `fallback` when unset or empty, else the parsed value.
inline int64_t integer(const char* name, int64_t fallback, int64_t min, int64_t max) {
  auto v = get(name);
  return v ? parse_int(name, *v, min, max) : fallback;
}
inline double seconds(const char* name, double fallback, double min_s, double max_s) {
  auto v = get(name);
  return v ? parse_seconds(name, *v, min_s, max_s) : fallback;
}
inline uint64_t size(const char* name, uint64_t fallback, uint64_t min, uint64_t max) {
  auto v = get(name);
  return v ? parse_size(name, *v, min, max) : fallback;
}
inline bool flag(const char* name, bool fallback = false) {
  auto v = get(name);
  return v ? parse_bool(name, *v) : fallback;
}
inline std::string choice(const char* name, std::string fallback, std::initializer_list<std::string_view> allowed) {
  auto v = get(name);
  return v ? parse_choice(name, *v, allowed) : fallback;
}
// A free-form value (a path, a secret): the raw text, or `fallback` when unset or empty.
inline std::string text(const char* name, std::string fallback = {}) {
  auto v = get(name);
  return v ? *v : fallback;
}

// Bounds shared by the settings that take them.
inline constexpr double kMinTimeoutSeconds = 0.001;
inline constexpr double kMaxTimeoutSeconds = 86400.0;  // one day: longer is a typo, not a wait

}  // namespace tdist::env
