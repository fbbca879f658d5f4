#include "tdist/runtime/symmetric_heap.hpp"

#include <cuda_runtime_api.h>

#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

#include "src/runtime/lsa_pointers.hpp"
#include "tdist/common/checked.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/env.hpp"
#include "tdist/runtime/device_fault.hpp"

namespace tdist {
namespace {

constexpr size_t kHeapGranularity = 2ull << 20;  // NVLink mappings are made in 2 MiB pages
constexpr size_t kDefaultCapacity = 1ull << 30;
constexpr size_t kMaxCapacity = 1ull << 40;  // 1 TiB: far above any GPU's memory, far below overflow

size_t capacity_from_env() { return env::size("TDIST_SYMMETRIC_HEAP_SIZE", kDefaultCapacity, 1, kMaxCapacity); }

// The request every rank must agree on, exchanged before a collective allocation commits.
struct AllocRequest {
  uint64_t bytes, alignment, offset;
  bool operator==(const AllocRequest&) const = default;
};

}  // namespace

size_t SymmetricHeap::parse_size(const std::string& text, const std::string& what) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string suffix = text.substr(digits);
  size_t unit = 0;
  if (suffix.empty())
    unit = 1;
  else if (suffix == "K" || suffix == "k")
    unit = 1ull << 10;
  else if (suffix == "M" || suffix == "m")
    unit = 1ull << 20;
  else if (suffix == "G" || suffix == "g")
    unit = 1ull << 30;
  if (digits == 0 || unit == 0)
    TDIST_FAIL(what, "='", text, "': expected a byte count with an optional K, M or G suffix, e.g. 512M");
  uint64_t count = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + digits, count);
  // Checked before multiplying: 17179869185G must not wrap around to 1 GiB.
  if (ec != std::errc() || ptr != text.data() + digits || count > SIZE_MAX / unit)
    TDIST_FAIL(what, "='", text, "': the size does not fit in 64 bits");
  const size_t value = count * unit;
  if (value == 0) TDIST_FAIL(what, "='", text, "': expected a size above zero");
  return value;
}

size_t SymmetricHeap::array_bytes(size_t count, size_t element_size) {
  return checked_mul(count, element_size, "the byte size of a symmetric array (count * element size)");
}

std::optional<size_t> SymmetricHeap::first_fit(const std::map<size_t, size_t>& free_blocks, size_t bytes,
                                               size_t alignment) {
  for (const auto& [block, block_bytes] : free_blocks) {
    // In differences, never sums: a size near 2^64 must not wrap around and "fit".
    const size_t end = block + block_bytes;
    const size_t rem = block % alignment;
    if (rem != 0 && alignment - rem >= block_bytes) continue;
    const size_t aligned = rem == 0 ? block : block + (alignment - rem);
    if (bytes <= end - aligned) return aligned;
  }
  return std::nullopt;
}

SymmetricHeap::SymmetricHeap(World& world, size_t capacity) : world_(world) {
  capacity_ = checked_align_up(capacity == 0 ? capacity_from_env() : capacity, kHeapGranularity,
                               "the symmetric heap capacity rounded up to 2 MiB");
  world_.check_same_on_all_ranks("symmetric heap capacity (bytes)", std::to_string(capacity_));
  TDIST_CHECK(world_.lsa_size() <= device::kMaxLsaRanks, "the load/store team has ", world_.lsa_size(),
              " ranks; SymmetricHeapView addresses at most ", device::kMaxLsaRanks);

  TDIST_CUDA_CHECK(cudaSetDevice(world_.device()));
  view_.rank = world_.rank();
  view_.num_ranks = world_.world_size();
  view_.lsa_rank = world_.lsa_rank();
  view_.lsa_size = world_.lsa_size();
  view_.size = capacity_;
  if (world_.shares_gpus()) {
    map_with_cuda_ipc();
  } else {
    ncclResult_t result = ncclMemAlloc(&base_, capacity_);
    if (result != ncclSuccess) {
      size_t free_bytes = 0, total = 0;
      cudaMemGetInfo(&free_bytes, &total);
      TDIST_FAIL("ncclMemAlloc of a ", capacity_, "-byte symmetric heap failed (", ncclGetErrorString(result), "); ",
                 free_bytes, " of ", total, " bytes of GPU memory are free");
    }
    TDIST_NCCL_CHECK(ncclCommWindowRegister(world_.comm(), base_, capacity_, &window_, NCCL_WIN_COLL_SYMMETRIC));
    // A team of one has no peer to look up, and NCCL's single-rank window is not for device use
    // (ncclGetLsaPointer on it faults): the local entry below is the whole table.
    if (view_.lsa_size > 1) detail::fetch_lsa_bases(window_, view_.lsa_size, view_.lsa_bases);
  }
  // NCCL maps the window again, this rank's own memory included, in a range of its own; the local
  // entry stays the caller-visible allocation, so that symm_at(ptr, rank) == ptr.
  view_.lsa_bases[view_.lsa_rank] = static_cast<char*>(base_);
  free_blocks_[0] = capacity_;
}

template <typename Fn>
void SymmetricHeap::for_each_mapping(void* ptr, Fn&& fn) const {
  for (int rank = 0; rank < view_.num_ranks; ++rank)
    if (void* p = view_.symm_at(ptr, rank)) fn(p, rank);
}

SymmetricHeap::~SymmetricHeap() {
  try {
    // No peer may still be reading or writing this heap when its memory goes away.
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
    for_each_mapping(base_, [&](void* p, int) { forget_memory_names(p, capacity_); });
    const bool out_of_step = world_.out_of_step();
    if (!out_of_step) world_.barrier("symmetric heap destruction");
    if (world_.shares_gpus()) {
      for (int i = 0; i < view_.lsa_size; ++i)
        if (i != view_.lsa_rank) TDIST_CUDA_CHECK(cudaIpcCloseMemHandle(view_.lsa_bases[i]));
      TDIST_CUDA_CHECK(cudaFree(base_));
      return;
    }
    if (out_of_step) {
      // Deregistering the window is collective: abort instead; the window and its memory go with
      // the communicator.
      world_.abort("the symmetric heap is released after a device fault");
      return;
    }
    TDIST_NCCL_CHECK(ncclCommWindowDeregister(world_.comm(), window_));
    TDIST_NCCL_CHECK(ncclMemFree(base_));
  } catch (const std::exception& e) {
    std::cerr << "tdist: rank " << world_.rank() << ": freeing the symmetric heap failed: " << e.what() << "\n";
  }
}

// Ranks that share GPUs (World::shares_gpus) are in one process each, so NCCL maps no peer memory
// for them: every rank exports its heap as a CUDA IPC handle and opens the others' (also on another
// GPU of the machine, through peer access).
void SymmetricHeap::map_with_cuda_ipc() {
  const cudaError_t err = cudaMalloc(&base_, capacity_);
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    TDIST_FAIL("cudaMalloc of a ", capacity_, "-byte symmetric heap failed (", cudaGetErrorString(err), "); ",
               free_bytes, " of ", total, " bytes of GPU memory are free");
  }
  cudaIpcMemHandle_t mine;
  TDIST_CUDA_CHECK(cudaIpcGetMemHandle(&mine, base_));
  const auto* p = reinterpret_cast<const uint8_t*>(&mine);
  const auto all = world_.all_gather("symmetric heap IPC handles", Bytes(p, p + sizeof(mine)));
  for (int i = 0; i < view_.lsa_size; ++i) {
    if (i == view_.lsa_rank) continue;
    cudaIpcMemHandle_t theirs;
    TDIST_CHECK(all[i].size() == sizeof(theirs), "rank ", i, " sent a ", all[i].size(), "-byte IPC handle, expected ",
                sizeof(theirs));
    std::memcpy(&theirs, all[i].data(), sizeof(theirs));
    void* mapped = nullptr;
    TDIST_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, theirs, cudaIpcMemLazyEnablePeerAccess));
    view_.lsa_bases[i] = static_cast<char*>(mapped);
  }
}

void* SymmetricHeap::allocate(size_t bytes, size_t alignment) {
  TDIST_CHECK_ARG(bytes > 0, "bytes", "expected a positive size, got 0");
  TDIST_CHECK_ARG(alignment > 0 && (alignment & (alignment - 1)) == 0, "alignment", "expected a power of two, got ",
                  alignment);

  // First fit in offset order: the same history gives the same offset on every rank.
  const std::optional<size_t> fit = first_fit(free_blocks_, bytes, alignment);
  auto chosen = fit ? std::prev(free_blocks_.upper_bound(*fit)) : free_blocks_.end();
  const size_t offset = fit.value_or(0);
  const bool fits = chosen != free_blocks_.end();
  const AllocRequest mine{bytes, alignment, fits ? offset : UINT64_MAX};
  const auto all = world_.all_gather("symmetric allocation", Bytes(reinterpret_cast<const uint8_t*>(&mine),
                                                                   reinterpret_cast<const uint8_t*>(&mine + 1)));
  bool agree = true, all_fit = true;
  std::ostringstream seen;
  for (size_t r = 0; r < all.size(); ++r) {
    AllocRequest theirs;
    std::memcpy(&theirs, all[r].data(), sizeof(theirs));
    agree = agree && theirs == mine;
    all_fit = all_fit && theirs.offset != UINT64_MAX;
    seen << " rank " << r << ": " << theirs.bytes << " bytes aligned to " << theirs.alignment << " at offset "
         << (theirs.offset == UINT64_MAX ? std::string("none (no room)") : std::to_string(theirs.offset)) << ";";
  }
  if (!all_fit)
    TDIST_FAIL("symmetric heap out of memory: ", bytes, " bytes requested, ", capacity_ - in_use_, " of ", capacity_,
               " free, largest free block ", largest_free_block(),
               " bytes; create a larger heap (capacity argument or TDIST_SYMMETRIC_HEAP_SIZE). Requests:", seen.str());
  if (!agree)
    TDIST_FAIL("symmetric allocation differs across ranks (every rank must allocate the same sizes in the same order):",
               seen.str());

  const size_t block_offset = chosen->first, block_size = chosen->second;
  free_blocks_.erase(chosen);
  if (offset > block_offset) free_blocks_[block_offset] = offset - block_offset;
  if (offset + bytes < block_offset + block_size)
    free_blocks_[offset + bytes] = block_offset + block_size - (offset + bytes);
  live_blocks_[offset] = bytes;
  in_use_ += bytes;

  void* ptr = static_cast<char*>(base_) + offset;
  zero_and_meet(ptr, bytes, "symmetric allocation zeroed");
  return ptr;
}

std::map<size_t, size_t>::iterator SymmetricHeap::live_block(void* ptr, const char* hint) {
  TDIST_CHECK_ARG(contains(ptr), "ptr", ptr, " is not inside this symmetric heap [", base_, ", +", capacity_, ")");
  const size_t offset = static_cast<char*>(ptr) - static_cast<char*>(base_);
  auto live = live_blocks_.find(offset);
  TDIST_CHECK_ARG(live != live_blocks_.end(), "ptr", ptr, " (offset ", offset,
                  ") is not the start of a live allocation of this heap", hint);
  return live;
}

void SymmetricHeap::free(void* ptr) {
  auto live = live_block(ptr, " (double free?)");
  const size_t offset = live->first;
  // Kernels of this rank may still use the buffer, and peers' kernels may still write it. After a
  // device fault the block is only released here (World::out_of_step).
  const bool meet = !world_.out_of_step();
  if (meet) world_.check_same_on_all_ranks("offset of the symmetric buffer being freed", std::to_string(offset));
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  if (meet) world_.barrier("symmetric free");

  size_t start = offset, size = live->second;
  for_each_mapping(ptr, [&](void* p, int) { forget_memory_names(p, size); });
  in_use_ -= size;
  live_blocks_.erase(live);
  // Coalesce with the free neighbours on both sides.
  auto next = free_blocks_.lower_bound(start);
  if (next != free_blocks_.end() && next->first == start + size) {
    size += next->second;
    next = free_blocks_.erase(next);
  }
  if (next != free_blocks_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_blocks_.erase(prev);
    }
  }
  free_blocks_[start] = size;
}

void SymmetricHeap::name_block(void* ptr, const std::string& owner) {
  const auto live = live_block(ptr, "");
  for_each_mapping(ptr, [&](void* p, int rank) {
    name_memory(p, live->second, rank == view_.rank ? owner : detail::concat(owner, ", rank ", rank, "'s copy"));
  });
}

size_t SymmetricHeap::largest_free_block() const {
  size_t largest = 0;
  for (const auto& [offset, size] : free_blocks_) largest = std::max(largest, size);
  return largest;
}

void* SymmetricHeap::peer_ptr(const void* local, int peer) const {
  TDIST_CHECK_ARG(contains(local), "local", local, " is not inside this symmetric heap");
  TDIST_CHECK_ARG(peer >= 0 && peer < view_.num_ranks, "peer", "expected a rank in [0, ", view_.num_ranks, "), got ",
                  peer);
  void* p = view_.symm_at(const_cast<void*>(local), peer);
  TDIST_CHECK_ARG(p != nullptr, "peer", "rank ", peer, " is not load/store reachable from rank ", view_.rank,
                  " (LSA team of ", view_.lsa_size, " ranks)");
  return p;
}

void SymmetricHeap::zero_and_meet(void* ptr, size_t bytes, const char* tag) {
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  TDIST_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  world_.barrier(tag);
}

}  // namespace tdist
