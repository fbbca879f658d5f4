// Groups of threads that cooperate in one operation: each thread learns its index in the group,
// the group's size, and how to synchronise the group.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

// Thread groups that cooperate in a copy.
struct ThreadGroup {
  static TDIST_DEVICE u32 index() { return 0; }
  static TDIST_DEVICE u32 size() { return 1; }
  static TDIST_DEVICE void sync() {}
};
struct WarpGroup {
  static TDIST_DEVICE u32 index() { return threadIdx.x & 31u; }
  static TDIST_DEVICE u32 size() { return 32; }
  static TDIST_DEVICE void sync() { __syncwarp(); }
};
struct BlockGroup {
  static TDIST_DEVICE u32 index() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
  static TDIST_DEVICE u32 size() { return blockDim.x * blockDim.y * blockDim.z; }
  static TDIST_DEVICE void sync() { __syncthreads(); }
};

}  // namespace tdist::device
