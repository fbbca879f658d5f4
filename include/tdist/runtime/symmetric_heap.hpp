// tdist::SymmetricHeap: memory that every rank allocates alike, so that a kernel can address a
// peer's copy of any object through tdist::device::SymmetricHeapView::symm_at.
//
// Layout: one NCCL window per heap (ncclMemAlloc + ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC),
// of a capacity fixed at creation; ranks that share GPUs (World::shares_gpus, a test mode) use a
// cudaMalloc mapped into the peers with CUDA IPC instead, and have no window. allocate() carves
// buffers from it first-fit in offset order; because every rank makes the same calls in the same
// order, a buffer has the same offset on every rank. Each collective call checks that the ranks
// agree (same size, same pointer) and names the ranks that differ. Buffers come back zeroed, and
// every rank has finished zeroing before any rank returns, so a peer's first signal cannot be wiped
// by a late zeroing.
//
// Thread safety: one thread at a time per heap (the calls are collective anyway).
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "tdist/device/symmetric.cuh"
#include "tdist/runtime/world.hpp"

namespace tdist {

class SymmetricHeap {
 public:
  static constexpr size_t kDefaultAlignment = 256;

  // Collective. `capacity` bytes per rank (rounded up to 2 MiB); 0 reads TDIST_SYMMETRIC_HEAP_SIZE
  // (bytes, with an optional K/M/G suffix), default 1 GiB.
  explicit SymmetricHeap(World& world, size_t capacity = 0);
  // Collective: synchronises the device, deregisters the window and frees its memory. After a
  // device fault (World::out_of_step) it meets no other rank and aborts the communicator instead.
  ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  // Collective: a zeroed buffer of `bytes` (> 0) at the same offset on every rank.
  void* allocate(size_t bytes, size_t alignment = kDefaultAlignment);
  template <typename T>
  T* allocate_array(size_t count, size_t alignment = kDefaultAlignment) {
    return static_cast<T*>(allocate(array_bytes(count, sizeof(T)), alignment));
  }
  // Collective: zeroed flags, 32- or 64-bit, for signals and barriers (the device API's flag types).
  device::u32* allocate_signals32(size_t count) { return allocate_array<device::u32>(count); }
  device::u64* allocate_signals64(size_t count) { return allocate_array<device::u64>(count); }
  // Collective: returns a buffer from allocate(); every rank passes its pointer to the same buffer.
  // After a device fault (World::out_of_step) it only releases the block on this rank.
  void free(void* ptr);
  // Names the buffer at `ptr` (from allocate) after what owns it, in this rank's mapping and each
  // load/store peer's, so that a timed-out wait on it names its op (runtime/device_fault.hpp).
  // Local; free() forgets the name.
  void name_block(void* ptr, const std::string& owner);

  // Descriptor for kernels, taken by value.
  const device::SymmetricHeapView& view() const { return view_; }
  // Host-usable address of `peer`'s copy of `local` (a pointer into this heap), for the copy engine
  // (cudaMemcpyAsync) and stream memory operations; throws when the peer is not load/store reachable.
  void* peer_ptr(const void* local, int peer) const;
  template <typename T>
  T* peer_ptr(T* local, int peer) const {
    return static_cast<T*>(peer_ptr(static_cast<const void*>(local), peer));
  }

  bool contains(const void* ptr) const { return view_.contains(ptr); }
  size_t capacity() const { return capacity_; }
  size_t bytes_in_use() const { return in_use_; }
  size_t largest_free_block() const;
  ncclWindow_t window() const { return window_; }
  World& world() const { return world_; }

  // Parses TDIST_SYMMETRIC_HEAP_SIZE's format: "1073741824", "512M", "2G", "64K".
  // Sizes that do not fit in 64 bits are errors naming `what`, never wrapped.
  static size_t parse_size(const std::string& text, const std::string& what);
  // count * element_size; throws tdist::Error when the product overflows.
  static size_t array_bytes(size_t count, size_t element_size);
  // The offset first-fit allocation would choose for `bytes` aligned to `alignment` (a power of
  // two) among `free_blocks` (offset -> bytes), or nullopt when none has room. Pure: the heap
  // changes only after every rank agreed on this offset.
  static std::optional<size_t> first_fit(const std::map<size_t, size_t>& free_blocks, size_t bytes, size_t alignment);

 private:
  // fn(address, rank) for the copy of `ptr` at each load/store-reachable rank, this one included.
  template <typename Fn>
  void for_each_mapping(void* ptr, Fn&& fn) const;
  // The live allocation that starts at `ptr` (offset -> bytes), or an error naming `ptr` (+ `hint`).
  std::map<size_t, size_t>::iterator live_block(void* ptr, const char* hint);
  void zero_and_meet(void* ptr, size_t bytes, const char* tag);
  void map_with_cuda_ipc();

  World& world_;
  size_t capacity_ = 0;
  void* base_ = nullptr;
  ncclWindow_t window_ = nullptr;
  device::SymmetricHeapView view_{};
  std::map<size_t, size_t> free_blocks_;  // offset -> bytes, coalesced
  std::map<size_t, size_t> live_blocks_;  // offset -> bytes
  size_t in_use_ = 0;
};

}  // namespace tdist
