// The tile hooks the persistent GEMM (sm90_gemm.cuh) runs with in the overlap ops
// (include/tdist/ops/gemm_overlap.hpp). Their other kernels are in overlap_kernels.cuh. Compiles
// under NVRTC and nvcc.
//
// Flags are u64, set to 1 by the copy engine's stream write (after its data, in stream order) or by
// the GEMM, and reset to 0 by the host before the per-call barrier; see src/ops/overlap/ for
// the buffers and their protocols.
#pragma once

#include "tdist/device/common.cuh"
#include "tdist/device/memory_order.cuh"
#include "tdist/device/profile.cuh"
#include "tdist/device/signal.cuh"
#include "tdist/kernels/gemm/overlap_params.cuh"

namespace tdist::kernels::gemm {

// Waits until *flag >= 1 (acquire, system scope) inside the GEMM kernel. No function call: a call
// anywhere in the kernel makes ptxas serialise wgmma, so a timeout records the fault without the
// device API's printed diagnostic (the host raises it from the record; compile with
// TDIST_GEMM_DEBUG=1 for a printed line too). Under the trap action it traps and the host sees the
// launch fail; after an abort it returns, and the tile computes on stale rows.
TDIST_DEVICE void gemm_wait_flag(const u64* flag, int chunk) {
  using namespace tdist::device;
  if (ld_acquire<Scope::kSystem>(flag) >= 1) return;
  SpinDeadline deadline;
  while (ld_relaxed<Scope::kSystem>(flag) < 1) {
    if (deadline.expired()) {
#if defined(TDIST_GEMM_DEBUG)
      printf("tdist gemm: wait for chunk %d timed out: block %d, flag %p\n", chunk, static_cast<int>(blockIdx.x), flag);
#else
      (void)chunk;
#endif
      if (waits_trap()) __trap();
      record_fault(WaitSite::kGemmChunk, flag, Cmp::kGe, 1, ld_relaxed<Scope::kSystem>(flag));
      return;
    }
  }
  (void)ld_acquire<Scope::kSystem>(flag);
}

// AllGather-GEMM (fused): before a tile's loads, the producer waits for every chunk of A the tile
// reads, except this rank's own (written before the launch, in stream order).
// Profiled (device/profile.cuh, sm90_gemm.cuh): each wait is a span on the producer's track
// (payload: the chunk), inside the tile's.
struct AllGatherWaitHooks : AllGatherWaitParams {
  static constexpr bool kNeedsStoredTile = false;  // nothing to publish: no wait for the tile's stores
  static constexpr tdist::device::ProfileKernel kProfileKernel = tdist::device::ProfileKernel::kAllGatherGemm;

  template <typename Info>
  TDIST_DEVICE void before_loads(const Info& info) const {
    using tdist::device::ProfileEvent;
    const ChunkRange r = tile_chunks(split, info.m0, info.rows);
    for (int c = r.first; c < r.first + r.count; ++c)
      if (c != rank) {
        tdist::device::profile_record(kProfileKernel, 0, ProfileEvent::kWaitBegin, static_cast<u32>(c));
        gemm_wait_flag(chunk_flags + c, c);
        tdist::device::profile_record(kProfileKernel, 0, ProfileEvent::kWaitEnd, static_cast<u32>(c));
      }
  }
  template <typename Info>
  TDIST_DEVICE void after_store(const Info&, u32, u32) const {}
};

// MoE AllGather + grouped GEMM (fused): before a tile's loads, the producer waits for the chunks of
// the relative sources its rows come from (overlap_params.cuh), except this rank's own. List 0 holds
// this rank's tokens only and never waits.
struct MoeGatherWaitHooks : MoeGatherWaitParams {
  static constexpr bool kNeedsStoredTile = false;  // nothing to publish

  template <typename Info>
  TDIST_DEVICE void before_loads(const Info& info) const {
    if (info.list == 0) return;
    const int world = split.num_ranks;
    const int t = token_of_row[info.m0];  // the tile's first row is a real pair (-1 would mean no routing)
    const int first = t < 0 ? 1 : (split.chunk_of(static_cast<u64>(t)) - rank + world) % world;
    for (int rel = first > 1 ? first : 1; rel <= static_cast<int>(info.list); ++rel) {
      const int c = (rank + rel) % world;
      gemm_wait_flag(chunk_flags + c, c);
    }
  }
  template <typename Info>
  TDIST_DEVICE void after_store(const Info&, u32, u32) const {}
};

// GEMM-ReduceScatter (fused): counts finished tiles per row chunk; the last tile of a chunk raises
// chunk_ready[chunk], on which the copy engine's stream waits before sending the chunk to its owner.
struct ChunkPublishHooks : ChunkPublishParams {
  template <typename Info>
  TDIST_DEVICE void before_loads(const Info&) const {}
  template <typename Info>
  TDIST_DEVICE void after_store(const Info& info, u32 thread, u32) const {
    if (thread != 0) return;
    // The barrier before the hook made every consumer's stores visible to this thread; the fence
    // makes them visible to the GPU before the count (and, cumulatively, before the flag).
    __threadfence();
    const ChunkRange r = tile_chunks(split, info.m0, info.rows);
    for (int c = r.first; c < r.first + r.count; ++c) {
      const u64 begin = split.begin(c), rows = split.rows(c);
      if (rows == 0) continue;
      const u32 tiles = static_cast<u32>((begin + rows - 1) / block_m - begin / block_m + 1) * tiles_n;
      if (atomicAdd(chunk_tiles_done + c, 1u) + 1 == tiles) {
        __threadfence_system();
        tdist::device::st_release<tdist::device::Scope::kSystem>(chunk_ready + c, u64{1});
      }
    }
  }
};

}  // namespace tdist::kernels::gemm
