// Barriers across ranks, inside kernels: one block per rank (barrier_all_block) or a whole grid per
// rank (barrier_all_grid). Both are CUDA-graph safe: counters only grow, nothing is reset.
//
// Barrier pad: a symmetric array of u64, zeroed at allocation, barrier_pad_words(num_ranks) words per
// slot. Concurrent barriers (different blocks, different streams) need different slots.
//   slot[r]              arrivals from rank r; rank r adds 1 per barrier (a remote red.release.sys)
//   slot[num_ranks]      barriers this rank has passed on this slot (the epoch), touched only locally
//   slot[num_ranks + 1]  arrivals of this GPU's blocks, for barrier_all_grid
// Ordering: everything the participating threads did before the barrier is visible to every thread
// of every rank after it (release by the arriving rank, acquire by the waiting one, bar.sync around).
#pragma once

#include "tdist/device/barrier_pad.cuh"
#include "tdist/device/groups.cuh"
#include "tdist/device/memory_order.cuh"
#include "tdist/device/signal.cuh"
#include "tdist/device/symmetric.cuh"

namespace tdist::device {

namespace detail {

// The cross-rank part, run by every thread of one block per rank.
TDIST_DEVICE void barrier_ranks(const SymmetricHeapView& heap, u64* slot) {
  const int n = heap.num_ranks;
  const u32 tid = BlockGroup::index(), threads = BlockGroup::size();
  const u64 epoch = ld_relaxed<Scope::kGpu>(slot + n) + 1;  // read by all before thread 0 updates it
  __syncthreads();
  if (tid == 0) st_relaxed<Scope::kGpu>(slot + n, epoch);
  for (u32 p = tid; p < static_cast<u32>(n); p += threads)
    red_add<Scope::kSystem>(peer_address_or_trap(heap, slot + heap.rank, static_cast<int>(p), "barrier_all"), u64{1});
  for (u32 p = tid; p < static_cast<u32>(n); p += threads) signal_wait_until<Scope::kSystem>(slot + p, Cmp::kGe, epoch);
  __syncthreads();
}

// All blocks of this grid meet; they must be co-resident (a persistent or cooperative launch).
TDIST_DEVICE void grid_sync(u64* arrivals) {
  __syncthreads();
  if (BlockGroup::index() == 0) {
    const u64 blocks = static_cast<u64>(gridDim.x) * gridDim.y * gridDim.z;
    const u64 arrived_before = atomic_add<Scope::kSystem>(arrivals, u64{1});
    const u64 target = (arrived_before / blocks + 1) * blocks;
    signal_wait_until<Scope::kSystem>(arrivals, Cmp::kGe, target);
  }
  __syncthreads();
}

}  // namespace detail

// Every thread of exactly one block per rank calls it with the same slot.
TDIST_DEVICE void barrier_all_block(const SymmetricHeapView& heap, u64* slot) {
  __syncthreads();  // the block's earlier accesses precede the arrival signals
  detail::barrier_ranks(heap, slot);
}

// Every thread of every block of the grid, on every rank, calls it with the same slot. The grid's
// blocks must all be resident at once (persistent kernels, cooperative launches).
TDIST_DEVICE void barrier_all_grid(const SymmetricHeapView& heap, u64* slot) {
  const bool leader_block = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
  detail::grid_sync(slot + heap.num_ranks + 1);
  if (leader_block) detail::barrier_ranks(heap, slot);
  detail::grid_sync(slot + heap.num_ranks + 1);
}

}  // namespace tdist::device
