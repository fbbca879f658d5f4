// The transport seam of the expert-parallel kernels: every access of a peer's memory goes through
// these few calls, so a second transport (NCCL GIN for ranks outside the NVLink domain) replaces
// them without touching the kernels.
//
//   peer_ptr(heap, local, r)   where `local` (a pointer into this rank's symmetric heap) lives on
//                              rank r; the kernels then put with plain (16-byte) stores through it
//   put_signal(heap, f, v, r)  raises r's copy of the u64 flag f to v with release at system scope:
//                              every store of the calling thread, and of the threads it synchronised
//                              with before (bar.sync / bar.warp.sync), is visible on r before the flag
//   wait_signal(f, pred)       spins on a local flag (acquire, system scope) with a timeout
//
// Over NVLink (LSA) a put is a store and a counter is a flag written by the sender. Through GIN a put
// would become a one-sided write of the staged row and put_signal a write-with-signal that the NIC
// orders after the data; the receiver's waits stay as they are.
#pragma once

#include "tdist/device/common.cuh"
#include "tdist/device/symmetric.cuh"

#if defined(__CUDACC__)
#include "tdist/device/memory_order.cuh"
#include "tdist/device/signal.cuh"
#include "tdist/device/timeout.cuh"

namespace tdist::kernels::ep {

using namespace tdist::device;

template <typename T>
TDIST_DEVICE T* peer_ptr(const SymmetricHeapView& heap, T* local, int rank) {
  return tdist::device::detail::peer_address_or_trap(heap, local, rank, "ep put");
}

TDIST_DEVICE void put_signal(const SymmetricHeapView& heap, u64* flag, u64 value, int rank) {
  st_release<Scope::kSystem>(peer_ptr(heap, flag, rank), value);
}

// Spins until the high 32 bits of *flag equal the low 32 bits of `epoch` (a count flag: epoch in the
// high half, payload in the low half); returns the payload, or 0 after an aborted wait (timeout.cuh:
// a count read then is not trusted).
TDIST_DEVICE u32 wait_count_flag(const u64* flag, u64 epoch) {
  const u32 want = static_cast<u32>(epoch);
  u64 v = ld_acquire<Scope::kSystem>(flag);
  if (static_cast<u32>(v >> 32) != want) {
    SpinDeadline deadline;
    for (;;) {
      v = ld_relaxed<Scope::kSystem>(flag);
      if (static_cast<u32>(v >> 32) == want) {
        v = ld_acquire<Scope::kSystem>(flag);
        break;
      }
      if (deadline.expired()) {
        wait_timed_out("ep count flag", WaitSite::kEpCountFlag, flag, Cmp::kEq, want, v >> 32);
        return 0;
      }
    }
  }
  return static_cast<u32>(v);
}

// Spins until *flag >= value (an epoch flag).
TDIST_DEVICE void wait_epoch(const u64* flag, u64 value) { signal_wait_until<Scope::kSystem>(flag, Cmp::kGe, value); }

}  // namespace tdist::kernels::ep
#endif  // __CUDACC__
