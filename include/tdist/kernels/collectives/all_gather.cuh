// AllGather on SMs (pull). out[r * B, (r + 1) * B) = rank r's input of B bytes (p.count = B).
//
// Block b of every rank owns the same byte range R_b of each rank's input:
//   1. copy in[R_b] into this rank's workspace slot (skipped when p.zero_copy: peers read `in`),
//      and into out[me * B + R_b];
//   2. exchange phase 0 with block b of every peer;
//   3. read R_b of every peer's slot (or input) over NVLink into out[peer * B + R_b];
//   4. zero copy only: exchange phase 1, so no peer is still reading `in` when the call returns.
// Zero copy reads the peer's input where the peer has it: the same symmetric buffer `in` on every
// rank, except in place (in == out + me * B), where rank p's input is its own part out + p * B of
// the symmetric output (translating this rank's `in` would read the peer's copy of this rank's
// part, which the peer is about to fill).
// tdist_ag_push (SM push, zero copy into a symmetric output): block b of every rank
//   1. exchanges phase 0 with block b of every peer (the peer has entered this call, so the work
//      before it on the peer's stream, which may still have used its output, is done);
//   2. stores R_b of its input into out[me * B + R_b] of every peer, and of its own output, in
//      turns of kPushChunkBytes: the local copy of one chunk runs while the NVLink stores of the
//      last drain (copying the own part after all pushes was 8-10 % slower from 64 MB,
//      bench/results/h200x2/ag_push_chunks.txt);
//   3. exchanges phase 1 (released after its stores): the peers' R_b has landed here.
// NVLink stores reach a higher rate than loads (BASELINES.md: 364 GB/s from every SM), so pushing
// beats pulling; both phases are in-kernel flag exchanges, cheaper than the copy-engine variants'
// barrier kernels between stream operations.
// The copy-engine variants (push and pull) run on the host side (src/ops/collectives.cpp) with the
// stream barrier of barrier.cuh between their phases.
#pragma once

#include "tdist/device/profile.cuh"
#include "tdist/kernels/collectives/common.cuh"

namespace tdist::kernels::coll {

constexpr u64 kPushChunkBytes = 64 << 10;

__global__ void __launch_bounds__(kThreads, 1) tdist_ag_sm(CollParams p) {
  const u64 e = begin_call(p.epoch);
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 B = p.count;
  u64 lo, hi;
  block_range(B, blockIdx.x, gridDim.x, 16, lo, hi);
  char* slot = slot_of(p, e);
  const char* in = static_cast<const char*>(p.in);
  char* out = static_cast<char*>(p.out);
  const bool in_place = in == out + me * B;
  const char* src = p.zero_copy ? in : slot;
  if (!p.zero_copy) block_copy(slot + lo, in + lo, hi - lo);
  block_copy(out + me * B + lo, in + lo, hi - lo);
  exchange(p, 0, e);
  for (int k = 1; k < n; ++k) {
    const int peer = (me + k) % n;  // staggered, so ranks do not all read one peer at once
    const char* peer_src = p.zero_copy && in_place ? out + peer * B : src;  // symmetric, peer's layout
    tdist::device::detail::group_copy<BlockGroup>(out + peer * B + lo, p.heap.symm_at(peer_src, peer) + lo, hi - lo);
  }
  if (p.zero_copy) exchange(p, 1, e);
  end_call(p.epoch, e);
}

// Profiled (device/profile.cuh): thread 0 of each block records on track 0 the two exchanges as
// waits (payload: the phase) and each chunk's stores to a peer as a copy (payload: the peer; the
// span is the block's issue of the stores as thread 0 sees it: they have landed at the peer once the
// closing exchange ends).
TDIST_DEVICE void ag_push_record(tdist::device::ProfileEvent event, u32 payload) {
  if (threadIdx.x == 0) tdist::device::profile_record(tdist::device::ProfileKernel::kAllGatherPush, 0, event, payload);
}

__global__ void __launch_bounds__(kThreads, 1) tdist_ag_push(CollParams p) {
  using tdist::device::ProfileEvent;
  const u64 e = begin_call(p.epoch);
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 B = p.count;
  u64 lo, hi;
  block_range(B, blockIdx.x, gridDim.x, 16, lo, hi);
  const char* in = static_cast<const char*>(p.in);
  char* mine = static_cast<char*>(p.out) + me * B;  // this rank's part, at the same offset on every peer
  ag_push_record(ProfileEvent::kWaitBegin, 0);
  exchange(p, 0, e);
  ag_push_record(ProfileEvent::kWaitEnd, 0);
  for (u64 c = lo; c < hi; c += kPushChunkBytes) {
    const u64 len = hi - c < kPushChunkBytes ? hi - c : kPushChunkBytes;
    for (int k = 1; k < n; ++k) {
      const int peer = (me + k) % n;  // staggered, so ranks do not all write one peer at once
      ag_push_record(ProfileEvent::kCopyIssue, static_cast<u32>(peer));
      tdist::device::detail::group_copy<BlockGroup>(p.heap.symm_at(mine, peer) + c, in + c, len);
      ag_push_record(ProfileEvent::kCopyLand, static_cast<u32>(peer));
    }
    block_copy(mine + c, in + c, len);  // no-op in place
  }
  ag_push_record(ProfileEvent::kWaitBegin, 1);
  exchange(p, 1, e);
  ag_push_record(ProfileEvent::kWaitEnd, 1);
  end_call(p.epoch, e);
}

}  // namespace tdist::kernels::coll
