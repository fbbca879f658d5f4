// The size of a barrier pad (device/barrier.cuh), in a header that host code includes too, so that
// the host's allocations and the device's indexing use the one formula.
//   slot[r]              arrivals from rank r
//   slot[num_ranks]      barriers this rank has passed on this slot (the epoch)
//   slot[num_ranks + 1]  arrivals of this GPU's blocks, for barrier_all_grid
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

TDIST_HOST_DEVICE constexpr u64 barrier_pad_words(int num_ranks) { return static_cast<u64>(num_ranks) + 2; }

}  // namespace tdist::device
