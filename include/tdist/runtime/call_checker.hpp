// tdist::CallChecker: when the ranks must compare a collective or overlapped op's call before it
// runs (TDIST_CHECK_CALLS), so that ranks calling different ops, counts, dtypes, methods or buffer
// kinds raise an error naming each rank's call instead of timing out on the device.
//
// The setting, read once per World:
//   first  (default)  compare a call the first time this rank sees its signature; later calls of
//                     the same signature cost one hash and one set lookup (15 ns measured,
//                     docs/security.md);
//   always            compare every call (one host round trip each: a debugging setting);
//   off               never compare.
// 1 and 0 are accepted as always and off (the values of earlier releases).
//
// A signature is a 64-bit key hashed from the call's fields (CallKey); the text compared across
// ranks is built only when a comparison runs. The checker remembers at most kMaxRemembered keys:
// a new key past that clears the set first (every rank clears at the same call, since all see the
// same calls in the same order), so a job with very many signatures compares a recurring one again
// after each clear instead of comparing every unremembered call forever. A key is remembered only
// after a comparison found every rank alike.
//
// Not thread-safe: the calls of one World are made from one thread at a time, as its host
// collectives already require.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <unordered_set>

namespace tdist {

enum class CallCheckMode : uint8_t { kOff, kFirst, kAlways };

inline constexpr const char* kCheckCallsEnv = "TDIST_CHECK_CALLS";

const char* to_string(CallCheckMode mode);
// TDIST_CHECK_CALLS's value: first, always, off, or 1 / 0 for always / off. Anything else throws
// tdist::Error naming TDIST_CHECK_CALLS, the value and the accepted ones.
CallCheckMode parse_call_check_mode(std::string_view text);
// TDIST_CHECK_CALLS from the process environment; kFirst when unset or empty.
CallCheckMode call_check_mode_from_env();

// A call's signature as a 64-bit key: an FNV-1a style hash of its fields, in the order added. Two
// calls with equal fields have equal keys; distinct signatures collide with a chance of about
// 2^-64 per pair (a collision only skips one comparison under `first`).
class CallKey {
 public:
  explicit CallKey(std::string_view op) { add(op); }
  CallKey& add(std::string_view text) {
    for (char c : text) h_ = (h_ ^ static_cast<uint8_t>(c)) * kPrime;
    h_ = (h_ ^ 0xffu) * kPrime;  // end of the field: ("ab", "c") differs from ("a", "bc")
    return *this;
  }
  CallKey& add(uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h_ = (h_ ^ (v & 0xffu)) * kPrime;
    return *this;
  }
  CallKey& add(int64_t v) { return add(static_cast<uint64_t>(v)); }
  CallKey& add(int v) { return add(static_cast<uint64_t>(static_cast<int64_t>(v))); }
  CallKey& add(bool v) { return add(static_cast<uint64_t>(v ? 1 : 0)); }
  uint64_t value() const { return h_; }

 private:
  static constexpr uint64_t kPrime = 0x100000001b3ull;  // FNV-1a 64-bit
  uint64_t h_ = 0xcbf29ce484222325ull;
};

class CallChecker {
 public:
  static constexpr size_t kMaxRemembered = 4096;

  explicit CallChecker(CallCheckMode mode = CallCheckMode::kFirst, size_t max_remembered = kMaxRemembered);

  CallCheckMode mode() const { return mode_; }
  // Keeps the remembered signatures: turning checks off for a while (the collectives tuner's timed
  // calls) and back on does not compare the calls seen before again. Every rank alike.
  void set_mode(CallCheckMode mode) { mode_ = mode; }

  // Whether the call with signature `key` must be compared across ranks now.
  bool must_compare(uint64_t key) const {
    switch (mode_) {
      case CallCheckMode::kOff: return false;
      case CallCheckMode::kAlways: return true;
      case CallCheckMode::kFirst: return seen_.find(key) == seen_.end();
    }
    return true;
  }
  // After a comparison that found every rank alike: remembers `key` (clearing the set first when
  // it holds max_remembered() keys and `key` is new).
  void record(uint64_t key);
  // Forgets every signature: the next call of each is compared again (under `first`).
  void forget() { seen_.clear(); }

  size_t remembered() const { return seen_.size(); }
  size_t max_remembered() const { return max_remembered_; }
  // How often the bound cleared the set.
  uint64_t clears() const { return clears_; }

 private:
  CallCheckMode mode_;
  size_t max_remembered_;
  uint64_t clears_ = 0;
  std::unordered_set<uint64_t> seen_;
};

}  // namespace tdist
