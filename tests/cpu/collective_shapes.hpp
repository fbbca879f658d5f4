// The collective-selection CPU tests' shapes and limits: a call of `bytes` over n ranks with its
// buffers' kinds, and the default LL and LL128 buffer limits.
#pragma once

#include <cstddef>

#include "tdist/ops/detail/collective_select.hpp"

namespace tdist::test {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

inline CollectiveShape shape(size_t bytes, int n = 2, bool in_sym = false, bool out_sym = false,
                             bool aligned16 = true) {
  CollectiveShape s;
  s.bytes = bytes;
  s.world_size = n;
  s.in_symmetric = in_sym;
  s.out_symmetric = out_sym;
  s.aligned16 = aligned16;
  return s;
}

inline const CollectiveLimits kLimits{256 * MiB, 256 * KiB, 1 * MiB};  // the default LL and LL128 buffers

}  // namespace tdist::test
