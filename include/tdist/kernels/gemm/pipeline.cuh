// The shared-memory ring between the TMA producer and the wgmma consumers of the persistent GEMM:
// stage index and phase parity in one place (PipelineState), and the two mbarrier arrays around it
// (TmaPipeline). Producer and consumers advance their own PipelineState once per K block through the
// same tile list, so both see the same (stage, phase) sequence across tiles.
//
// Ring protocol, per stage s (kNumStages stages, shared memory layout in config.cuh):
//   full[s]   count 1: the producer's arrive.expect_tx(bytes) plus the TMA loads' complete_tx (with A
//             gathered by cp.async: count 1 + 128, each producer thread's loads arriving once).
//   empty[s]  count `consumer_arrivals` x kClusterM: one arrive per consumer warp of every CTA of the
//             cluster once it has finished reading (with kClusterM > 1 the CTAs load parts of each
//             other's stages, TMA multicast, so a stage is empty once every CTA's consumers freed it).
// Pass p over the ring (count / kNumStages = p) uses phase parity p & 1 of both barriers: consumers
// wait for full's phase p; the producer waits for empty's phase p - 1, i.e. parity (p & 1) ^ 1, which
// a fresh barrier reports complete at once (the first pass finds every stage empty).
//
// The state is a running count of K blocks, stage = count % kNumStages and phase = (count /
// kNumStages) & 1, as the kernel computed them before this abstraction: the same instructions.
// stage() and phase() are plain C++ (host tests check the sequence); the barrier calls are device-only.
#pragma once

#include "tdist/device/common.cuh"

#if defined(__CUDACC__)
#include "tdist/kernels/gemm/sm90_ptx.cuh"
#endif

namespace tdist::kernels::gemm {

using tdist::device::u32;

template <int kNumStages>
struct PipelineState {
  static_assert(kNumStages >= 1, "at least one stage");
  u32 count = 0;  // K blocks through the ring so far, on this side

  TDIST_HOST_DEVICE u32 stage() const { return count % kNumStages; }
  TDIST_HOST_DEVICE u32 phase() const { return (count / kNumStages) & 1; }
  TDIST_HOST_DEVICE PipelineState& operator++() {
    ++count;
    return *this;
  }
  // The state one K block back (count > 0): the stage a consumer releases after the next wait.
  TDIST_HOST_DEVICE PipelineState previous() const { return PipelineState{count - 1}; }
};

#if defined(__CUDACC__)

// The full/empty mbarrier pairs of a kNumStages ring. Addresses are shared-memory (shared::cta) ones:
// full at full_bar + 8 s, empty at empty_bar + 8 s, at the same offsets in every CTA of a cluster.
template <int kNumStages, int kClusterM = 1>
struct TmaPipeline {
  using State = PipelineState<kNumStages>;
  u32 full_bar;
  u32 empty_bar;

  TDIST_DEVICE u32 full(const State& st) const { return full_bar + 8 * st.stage(); }
  TDIST_DEVICE u32 empty(const State& st) const { return empty_bar + 8 * st.stage(); }

  // One thread, before the barrier that starts the CTA (the caller fences with fence_mbar_init).
  // `producer_arrivals`: 1 (the producer's arrive.expect_tx), plus one per thread whose cp.async
  // loads arrive on the stage (the gathered-A producer).
  TDIST_DEVICE void init(u32 consumer_arrivals, u32 producer_arrivals = 1) const {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbar_init(full_bar + 8 * s, producer_arrivals);
      ptx::mbar_init(empty_bar + 8 * s, consumer_arrivals * kClusterM);  // per consumer warp of the cluster
    }
  }

  // Producer: waits until the stage of `st` is empty (every consumer released it on the last pass).
  // (Stage, then phase, then the wait: the order the kernel's instructions had before this type.)
  TDIST_DEVICE void producer_acquire(const State& st) const {
    const u32 s = st.stage(), phase = st.phase();
    ptx::mbar_wait(empty_bar + 8 * s, phase ^ 1, "producer empty");
  }
  // Producer: arms the stage's full barrier with the bytes its loads will deliver and returns the
  // barrier the loads complete on. The arrive is part of the phase, so the phase cannot complete
  // before it whatever the order of arrive and loads; the kernel arms before issuing.
  TDIST_DEVICE u32 producer_commit(const State& st, u32 bytes) const {
    const u32 bar = full(st);
    ptx::mbar_arrive_expect_tx(bar, bytes);
    return bar;
  }
  // Consumer: waits until the stage's loads have landed.
  TDIST_DEVICE void consumer_wait(const State& st) const {
    const u32 s = st.stage(), phase = st.phase();
    ptx::mbar_wait(full_bar + 8 * s, phase, "consumer full");
  }
  // Consumer: one arrive per consumer warp on the stage's empty barrier of every CTA of the cluster,
  // each CTA's by its own lane (lane r: CTA r), so that the warp signals them in one instruction.
  // Every lane of the warp calls it.
  TDIST_DEVICE void consumer_release(const State& st, u32 lane) const {
    if constexpr (kClusterM == 1) {
      if (lane == 0) ptx::mbar_arrive(empty(st));
    } else {
      if (lane < kClusterM) ptx::mbar_arrive_cluster(empty(st), lane);
    }
  }
  // Producer, after its last load: waits until every stage has been released for good, so that no
  // arrive from a peer CTA's consumers can reach this CTA's barriers after it exits.
  TDIST_DEVICE void producer_tail(State st) const {
    for (int i = 0; i < kNumStages; ++i, ++st) producer_acquire(st);
  }
};

#endif  // __CUDACC__

}  // namespace tdist::kernels::gemm
