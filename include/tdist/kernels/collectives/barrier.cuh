// Stream-side barrier of the collectives context: one block per rank meets on a dedicated barrier
// pad (tdist/device/barrier.cuh, CUDA-graph safe: the pad's counters only grow). Also the fence
// between the phases of the copy-engine collectives: a copy issued earlier on the stream has
// completed before this kernel starts, so its data is in place on the peer when the peer passes.
// Inside a kernel use tdist::device::barrier_all_block / barrier_all_grid directly.
#pragma once

#include "tdist/device.cuh"  // barrier.cuh needs copy.cuh (BlockGroup) before it

extern "C" __global__ void __launch_bounds__(128)
    tdist_coll_barrier(tdist::device::SymmetricHeapView heap, tdist::device::u64* pad) {
  tdist::device::fence_sc<tdist::device::Scope::kSystem>();
  tdist::device::barrier_all_block(heap, pad);
}
