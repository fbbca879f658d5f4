// Random benchmark sweeps: collective sizes and GEMM shapes that nobody tuned the method selectors
// on, the same list for the same seed on every rank and machine.
//
//   tdist-bench --sizes random:40 --seed 7           bench_gemm_overlap --shapes random:12 --seed 7
//   python -m tdist.bench --sizes random:40 --seed 7 (python/tdist/bench.py holds a port of this file)
//
// Integer arithmetic only (splitmix64, `next() % n`, shifts), no std:: distributions, so that the
// Python port gives the same list bit for bit; change one, change the other (tests/cpu/
// test_random_sweep.cpp compares them).
//
// "Log-uniform" is by octave: an octave is drawn uniformly, then a value uniformly inside it.
//
//   random_sizes(count, seed, elem)   bytes in [1 KB, 1 GB], each a multiple of `elem`; a third have
//                                     an odd element count (never a multiple of 16 bytes), a third
//                                     are multiples of 16 bytes, a third any multiple of `elem`. Sorted.
//   random_gemm_shapes(count, seed)   M in [128, 16384) (a quarter rounded down to a multiple of 128,
//                                     the rest any integer); N and K multiples of 8 in [1024, 28672].
//                                     N and K are whole-layer sizes, as the benches' shapes: ag_gemm
//                                     splits N over the ranks, gemm_rs / gemm_ar split K. Sorted.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "tdist/common/cli.hpp"

namespace tdist::sweep {

inline constexpr const char* kRandomPrefix = "random:";
inline constexpr int64_t kMaxCount = 100000;
inline constexpr uint64_t kMinBytes = 1ull << 10, kMaxBytes = 1ull << 30;
inline constexpr int kSizeOctaves = 20;  // 2^10 .. 2^30
inline constexpr int64_t kMinM = 128, kMaxM = 16384;
inline constexpr int kMOctaves = 7;  // 2^7 .. 2^14
inline constexpr int64_t kMinNK = 1024, kMaxNK = 28672;
inline constexpr int kNKOctaves = 5;  // 2^10 .. 2^15, the last one cut at kMaxNK

// splitmix64 (Steele, Lea, Flood 2014): one 64-bit state, every seed is good.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // In [0, n); the modulo bias (n / 2^64) is far below anything a sweep can see.
  uint64_t below(uint64_t n) { return next() % n; }
};

inline bool is_random(const std::string& spec) { return spec.rfind(kRandomPrefix, 0) == 0; }

// The N of "random:N", in [1, kMaxCount]; `what` names the option in the error.
inline int parse_random_count(const std::string& spec, const std::string& what) {
  if (!is_random(spec)) throw cli::UsageError(what + " expects random:N, got '" + spec + "'");
  const std::string n = spec.substr(std::char_traits<char>::length(kRandomPrefix));
  int64_t v = 0;
  try {
    v = cli::parse_int(n, what, 1, kMaxCount);
  } catch (const cli::UsageError&) {
    throw cli::UsageError(what + " expects random:N with N an integer in [1, " + std::to_string(kMaxCount) +
                          "], got '" + spec + "'");
  }
  return static_cast<int>(v);
}

inline std::vector<uint64_t> random_sizes(int count, uint64_t seed, uint64_t elem_size) {
  if (count < 1 || count > kMaxCount)
    throw cli::UsageError("random sweep: count expects [1, " + std::to_string(kMaxCount) + "], got " +
                          std::to_string(count));
  if (elem_size == 0 || 16 % elem_size != 0)
    throw cli::UsageError("random sweep: elem_size expects 1, 2, 4, 8 or 16, got " + std::to_string(elem_size));
  SplitMix64 r{seed};
  std::vector<uint64_t> out;
  out.reserve(count);
  for (int i = 0; i < count; ++i) {
    const uint64_t lo = kMinBytes << r.below(kSizeOctaves);
    uint64_t bytes = lo + r.below(lo);  // [lo, 2 lo)
    const uint64_t kind = r.below(3);
    if (kind == 0)
      bytes = (bytes / elem_size | 1) * elem_size;  // odd element count: bytes not a multiple of 16
    else if (kind == 1)
      bytes = bytes / elem_size * elem_size;
    else
      bytes = bytes / 16 * 16;
    out.push_back(bytes);
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct GemmShape {
  int64_t m, n, k;
  bool operator==(const GemmShape& o) const { return m == o.m && n == o.n && k == o.k; }
  bool operator<(const GemmShape& o) const { return std::tie(m, n, k) < std::tie(o.m, o.n, o.k); }
};

namespace detail {
// A multiple of 8 in [kMinNK, kMaxNK], log-uniform by octave.
inline int64_t random_nk(SplitMix64& r) {
  const int64_t lo = kMinNK << r.below(kNKOctaves);
  const int64_t hi = std::min<int64_t>(2 * lo, kMaxNK + 8);  // exclusive
  return lo + 8 * static_cast<int64_t>(r.below(static_cast<uint64_t>((hi - lo) / 8)));
}
}  // namespace detail

inline std::vector<GemmShape> random_gemm_shapes(int count, uint64_t seed) {
  if (count < 1 || count > kMaxCount)
    throw cli::UsageError("random sweep: count expects [1, " + std::to_string(kMaxCount) + "], got " +
                          std::to_string(count));
  SplitMix64 r{seed};
  std::vector<GemmShape> out;
  out.reserve(count);
  for (int i = 0; i < count; ++i) {
    const int64_t lo = kMinM << r.below(kMOctaves);
    int64_t m = lo + static_cast<int64_t>(r.below(static_cast<uint64_t>(lo)));  // [lo, 2 lo)
    if (r.below(4) == 0) m = m / 128 * 128;
    const int64_t n = detail::random_nk(r);
    const int64_t k = detail::random_nk(r);
    out.push_back({m, n, k});
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace tdist::sweep
