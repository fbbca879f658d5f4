// Synchronising loads, stores and atomics with an explicit PTX scope and semantic.
//
// Contract (PTX memory model):
//   ld_acquire<S>    ld.acquire.S     : no later load or store of this thread is performed before it.
//   st_release<S>    st.release.S     : every earlier load/store of this thread (and, by cumulativity,
//                                       everything those observed) is visible at scope S before it.
//   atomic_add<S>    atom.acq_rel.S   : both of the above, read-modify-write.
//   red_add<S>       red.release.S    : release, no value returned (cheaper).
//   fence<S>         fence.acq_rel.S  : orders this thread's earlier and later accesses at scope S.
//   fence_sc<S>      fence.sc.S       : sequentially consistent fence.
// Relaxed variants (ld_relaxed, st_relaxed) are single-copy atomic and never cached stale in
// L1 (.relaxed), but order nothing; use them only to poll before an acquire.
// S is Scope::kSystem for memory another GPU writes or reads over NVLink, Scope::kGpu for memory
// shared by the blocks of one GPU only. Generic addressing: any global, peer or host pointer.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

template <Scope S = Scope::kSystem>
TDIST_DEVICE u64 ld_acquire(const u64* p) {
  u64 v;
  if constexpr (S == Scope::kSystem)
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE u32 ld_acquire(const u32* p) {
  u32 v;
  if constexpr (S == Scope::kSystem)
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE u64 ld_relaxed(const u64* p) {
  u64 v;
  if constexpr (S == Scope::kSystem)
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE u32 ld_relaxed(const u32* p) {
  u32 v;
  if constexpr (S == Scope::kSystem)
    asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void st_release(u64* p, u64 v) {
  if constexpr (S == Scope::kSystem)
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void st_release(u32* p, u32 v) {
  if constexpr (S == Scope::kSystem)
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void st_relaxed(u64* p, u64 v) {
  if constexpr (S == Scope::kSystem)
    asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void st_relaxed(u32* p, u32 v) {
  if constexpr (S == Scope::kSystem)
    asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.relaxed.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Returns the value before the addition.
template <Scope S = Scope::kSystem>
TDIST_DEVICE u64 atomic_add(u64* p, u64 v) {
  u64 old;
  if constexpr (S == Scope::kSystem)
    asm volatile("atom.acq_rel.sys.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  else
    asm volatile("atom.acq_rel.gpu.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE u32 atomic_add(u32* p, u32 v) {
  u32 old;
  if constexpr (S == Scope::kSystem)
    asm volatile("atom.acq_rel.sys.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  else
    asm volatile("atom.acq_rel.gpu.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void red_add(u64* p, u64 v) {
  if constexpr (S == Scope::kSystem)
    asm volatile("red.release.sys.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("red.release.gpu.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void red_add(u32* p, u32 v) {
  if constexpr (S == Scope::kSystem)
    asm volatile("red.release.sys.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("red.release.gpu.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void fence() {
  if constexpr (S == Scope::kSystem)
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  else
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

template <Scope S = Scope::kSystem>
TDIST_DEVICE void fence_sc() {
  if constexpr (S == Scope::kSystem)
    asm volatile("fence.sc.sys;" ::: "memory");
  else
    asm volatile("fence.sc.gpu;" ::: "memory");
}

}  // namespace tdist::device
