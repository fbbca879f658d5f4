// The device-side view of a symmetric heap: which rank this is, and where every peer's copy of
// the heap is mapped in this process. Kernels take it by value (about 600 bytes of parameters).
//
// Every rank allocates the same heap (same size, same sub-allocations in the same order), so an
// object at offset o of this rank's heap sits at offset o of every peer's heap. A peer is
// load/store accessible (LSA: reachable with plain loads and stores, i.e. over NVLink or PCIe P2P)
// when it belongs to NCCL's LSA team; LSA ranks are consecutive world ranks
// [rank - lsa_rank, rank - lsa_rank + lsa_size). Peers outside it need a network path (NCCL GIN),
// and symm_at returns nullptr for them.
#pragma once

#include "tdist/device/common.cuh"

namespace tdist::device {

struct SymmetricHeapView {
  int rank;                       // this process's rank in the world
  int num_ranks;                  // world size
  int lsa_rank;                   // this process's index in its LSA team
  int lsa_size;                   // ranks in the LSA team (<= kMaxLsaRanks)
  u64 size;                       // bytes of the heap on each rank
  char* lsa_bases[kMaxLsaRanks];  // heap base of LSA member i, mapped here; [lsa_rank] is local

  TDIST_HOST_DEVICE char* local_base() const { return lsa_bases[lsa_rank]; }

  // True when `peer` (a world rank) is reachable with loads and stores.
  TDIST_HOST_DEVICE bool is_lsa_peer(int peer) const {
    int i = peer - (rank - lsa_rank);
    return i >= 0 && i < lsa_size;
  }

  // True when `ptr` points into this rank's heap.
  TDIST_HOST_DEVICE bool contains(const void* ptr) const {
    const char* p = static_cast<const char*>(ptr);
    return p >= local_base() && p < local_base() + size;
  }

  // The address of the object `ptr` (a pointer into this rank's heap) in `peer`'s heap, mapped
  // into this process; nullptr when the peer is not load/store reachable.
  template <typename T>
  TDIST_HOST_DEVICE T* symm_at(T* ptr, int peer) const {
    if (!is_lsa_peer(peer)) return nullptr;
    const char* p = reinterpret_cast<const char*>(ptr);
    char* base = lsa_bases[peer - (rank - lsa_rank)];
    return reinterpret_cast<T*>(base + (p - local_base()));
  }
};

#if defined(__CUDACC__)
namespace detail {

// The peer's address of a symmetric object, or a trap with a message naming the operation.
template <typename T>
TDIST_DEVICE T* peer_address_or_trap(const SymmetricHeapView& heap, T* symmetric, int peer, const char* op) {
  T* p = heap.symm_at(symmetric, peer);
  if (p == nullptr) {
    printf("tdist: %s on rank %d: peer %d is not load/store reachable (LSA team of %d ranks)\n", op, heap.rank, peer,
           heap.lsa_size);
    __trap();
  }
  return p;
}

}  // namespace detail
#endif

// Free-function forms, in the style of Triton-distributed's language primitives.
TDIST_HOST_DEVICE int rank(const SymmetricHeapView& heap) { return heap.rank; }
TDIST_HOST_DEVICE int num_ranks(const SymmetricHeapView& heap) { return heap.num_ranks; }
template <typename T>
TDIST_HOST_DEVICE T* symm_at(const SymmetricHeapView& heap, T* ptr, int peer) {
  return heap.symm_at(ptr, peer);
}

}  // namespace tdist::device
