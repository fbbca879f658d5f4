// Groups of threads that cooperate in one operation: each thread learns its index in the group,
// the group's size, and how to synchronise the group.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

// One thread alone.
struct ThreadGroup {
  static TDIST_DEVICE u32 index() { return 0; }
  static TDIST_DEVICE u32 size() { return 1; }
  static TDIST_DEVICE void sync() {}
};
// The 32 lanes of a warp (all must take part). The lane comes from %laneid, so any block shape works.
struct WarpGroup {
  static TDIST_DEVICE u32 index() {
    u32 lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
  }
  static TDIST_DEVICE u32 size() { return 32; }
  static TDIST_DEVICE void sync() { __syncwarp(); }
};
// Every thread of the block.
struct BlockGroup {
  static TDIST_DEVICE u32 index() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
  static TDIST_DEVICE u32 size() { return blockDim.x * blockDim.y * blockDim.z; }
  static TDIST_DEVICE void sync() { __syncthreads(); }
};

}  // namespace tdist::device
