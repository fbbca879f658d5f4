// One-sided data movement between ranks with loads and stores: put (write a peer's symmetric
// buffer) and get (read it), at thread, warp or block scope.
//
//   putmem_<scope>(heap, dst, src, bytes, peer)       dst: symmetric (this rank's heap address),
//                                                     written on `peer`; src: any local address
//   getmem_<scope>(heap, dst, src, bytes, peer)       src: symmetric, read from `peer`; dst: local
//   putmem_signal_<scope>(heap, dst, src, bytes, flag, value, op, peer)
//                                                     put, then raise `peer`'s copy of the symmetric
//                                                     flag with release: the data is visible to a
//                                                     peer that acquires the flag
//   *_nbi_<scope>                                     the same without the closing group sync
//
// Scopes: _thread is one thread; _warp needs all 32 lanes of the warp; _block needs every thread of
// the block. Blocking forms end with a group sync: on return the group's whole transfer has been
// issued, the source may be reused by any thread of the group, and after a get the destination
// is complete for every thread of the group. _nbi forms skip that sync (each thread returns when
// its own share is issued): issue several back to back, then sync the group once.
// Visibility to other agents of a put's data needs a release: putmem_signal, signal_op after a
// group sync, or quiet() then a relaxed flag store.
//
// Any size and alignment is correct. Copies use the widest access (16, 8, 4, 2 or 1 bytes) that
// the relative alignment of dst and src allows, after a short head that aligns dst, with several
// independent loads in flight per thread before their stores.
#pragma once

#include "tdist/device/groups.cuh"
#include "tdist/device/memory_order.cuh"
#include "tdist/device/signal.cuh"
#include "tdist/device/symmetric.cuh"

namespace tdist::device {

namespace detail {

constexpr int kLoadsInFlight = 4;

template <typename V>
TDIST_DEVICE void copy_vectors(V* dst, const V* src, u64 count, u64 lane, u64 lanes) {
  u64 i = lane;
  for (; i + (kLoadsInFlight - 1) * lanes < count; i += kLoadsInFlight * lanes) {
    V staged[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) staged[u] = src[i + u * lanes];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) dst[i + u * lanes] = staged[u];
  }
  for (; i < count; i += lanes) dst[i] = src[i];
}

template <typename V>
TDIST_DEVICE void copy_aligned(char* dst, const char* src, u64 bytes, u64 lane, u64 lanes) {
  constexpr u64 kWidth = sizeof(V);
  const u64 head = ((kWidth - (reinterpret_cast<u64>(dst) & (kWidth - 1))) & (kWidth - 1)) < bytes
                       ? ((kWidth - (reinterpret_cast<u64>(dst) & (kWidth - 1))) & (kWidth - 1))
                       : bytes;
  for (u64 i = lane; i < head; i += lanes) dst[i] = src[i];
  const u64 count = (bytes - head) / kWidth;
  copy_vectors(reinterpret_cast<V*>(dst + head), reinterpret_cast<const V*>(src + head), count, lane, lanes);
  for (u64 i = head + count * kWidth + lane; i < bytes; i += lanes) dst[i] = src[i];
}

// Copies `bytes` from src to dst, shared among the threads of group G (no sync).
template <typename G>
TDIST_DEVICE void group_copy(void* dst_ptr, const void* src_ptr, u64 bytes) {
  char* dst = static_cast<char*>(dst_ptr);
  const char* src = static_cast<const char*>(src_ptr);
  const u64 lane = G::index(), lanes = G::size();
  const u64 skew = reinterpret_cast<u64>(dst) ^ reinterpret_cast<u64>(src);
  if ((skew & 15) == 0)
    copy_aligned<uint4>(dst, src, bytes, lane, lanes);
  else if ((skew & 7) == 0)
    copy_aligned<uint2>(dst, src, bytes, lane, lanes);
  else if ((skew & 3) == 0)
    copy_aligned<u32>(dst, src, bytes, lane, lanes);
  else if ((skew & 1) == 0)
    copy_aligned<unsigned short>(dst, src, bytes, lane, lanes);
  else
    copy_aligned<unsigned char>(dst, src, bytes, lane, lanes);
}

template <typename G>
TDIST_DEVICE void put_nbi(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes, int peer) {
  group_copy<G>(peer_address_or_trap(heap, dst, peer, "putmem"), src, bytes);
}

template <typename G>
TDIST_DEVICE void get_nbi(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes, int peer) {
  group_copy<G>(dst, peer_address_or_trap(heap, src, peer, "getmem"), bytes);
}

template <typename G, typename T>
TDIST_DEVICE void put_signal(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes, T* flag, T value,
                             SignalOp op, int peer) {
  put_nbi<G>(heap, dst, src, bytes, peer);
  G::sync();  // every thread's stores precede the leader's release (bar.sync is in causality order)
  if (G::index() == 0) signal_op<Scope::kSystem>(heap, flag, value, op, peer);
}

}  // namespace detail

#define TDIST_DEFINE_COPY_SCOPE(scope, Group)                                                                        \
  TDIST_DEVICE void putmem_nbi_##scope(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes,         \
                                       int peer) {                                                                   \
    detail::put_nbi<Group>(heap, dst, src, bytes, peer);                                                             \
  }                                                                                                                  \
  TDIST_DEVICE void putmem_##scope(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes, int peer) { \
    detail::put_nbi<Group>(heap, dst, src, bytes, peer);                                                             \
    Group::sync();                                                                                                   \
  }                                                                                                                  \
  TDIST_DEVICE void getmem_nbi_##scope(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes,         \
                                       int peer) {                                                                   \
    detail::get_nbi<Group>(heap, dst, src, bytes, peer);                                                             \
  }                                                                                                                  \
  TDIST_DEVICE void getmem_##scope(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes, int peer) { \
    detail::get_nbi<Group>(heap, dst, src, bytes, peer);                                                             \
    Group::sync();                                                                                                   \
  }                                                                                                                  \
  template <typename T>                                                                                              \
  TDIST_DEVICE void putmem_signal_##scope(const SymmetricHeapView& heap, void* dst, const void* src, u64 bytes,      \
                                          T* flag, T value, SignalOp op, int peer) {                                 \
    detail::put_signal<Group>(heap, dst, src, bytes, flag, value, op, peer);                                         \
  }

TDIST_DEFINE_COPY_SCOPE(thread, ThreadGroup)
TDIST_DEFINE_COPY_SCOPE(warp, WarpGroup)
TDIST_DEFINE_COPY_SCOPE(block, BlockGroup)

#undef TDIST_DEFINE_COPY_SCOPE

// fence() (memory_order.cuh, system scope by default) orders this thread's earlier puts before its
// later ones.

// Completes this thread's earlier puts: once it returns, their stores are performed at system
// scope, so a later relaxed flag store cannot overtake them. Gets complete on return already.
TDIST_DEVICE void quiet() { fence<Scope::kSystem>(); }

}  // namespace tdist::device
