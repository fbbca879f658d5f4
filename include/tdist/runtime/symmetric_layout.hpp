// Typed layouts of symmetric memory: an op describes its buffers once, as regions of one
// allocation, and that one description gives both the host's heap size (bytes()) and the addresses
// the kernels and copies use (SymmetricBlock::operator[]), so the two cannot drift apart.
//
//   struct MyLayout {
//     SymmetricLayout layout;
//     SymmetricLayout::Region<u64> flags;   // u64[world]: flags[r] = 1 once rank r's rows landed
//     SymmetricLayout::Region<char> rows;   // T[max_m][K]
//     MyLayout(int world, size_t row_bytes, int64_t max_m)
//         : flags(layout.add<u64>(world)), rows(layout.add<char>(max_m * row_bytes)) {}
//   };
//   MyLayout l(world, ...);
//   size_t heap_bytes = l.layout.bytes();          // what the constructor will take
//   SymmetricBlock block(heap, l.layout);          // collective: one allocation
//   u64* flags = block[l.flags];                   // this rank's copy; heap.peer_ptr for a peer's
//
// Every region starts at a multiple of its alignment (default SymmetricHeap::kDefaultAlignment) and
// the sizes are computed with overflow checks: a layout that does not fit in size_t throws
// tdist::Error naming the region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "tdist/common/error.hpp"
#include "tdist/runtime/symmetric_heap.hpp"

namespace tdist {

class SymmetricLayout {
 public:
  template <typename T>
  struct Region {
    size_t offset = 0;  // bytes from the start of the allocation
    size_t count = 0;   // elements of T
    size_t bytes() const { return count * sizeof(T); }
    T* at(void* base) const { return reinterpret_cast<T*>(static_cast<char*>(base) + offset); }
  };

  // A region of `count` elements of T after the ones added before; `what` names it in errors.
  template <typename T>
  Region<T> add(size_t count, const char* what = "buffer", size_t alignment = SymmetricHeap::kDefaultAlignment) {
    TDIST_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0 && alignment % alignof(T) == 0,
                "SymmetricLayout: the alignment of '", what, "' must be a power of two and a multiple of ", alignof(T),
                ", got ", alignment);
    TDIST_CHECK(count <= (SIZE_MAX - alignment) / sizeof(T), "SymmetricLayout: '", what, "' of ", count,
                " elements of ", sizeof(T), " bytes does not fit in a size_t");
    const size_t bytes = count * sizeof(T);
    const size_t offset = round_up(bytes_, alignment, what);
    TDIST_CHECK(offset <= SIZE_MAX - bytes, "SymmetricLayout: '", what, "' ends beyond SIZE_MAX");
    bytes_ = offset + bytes;
    return Region<T>{offset, count};
  }

  // The bytes of one allocation that holds every region (a multiple of the heap's alignment, at
  // least one alignment unit so that an empty layout still allocates).
  size_t bytes() const {
    const size_t a = SymmetricHeap::kDefaultAlignment;
    return bytes_ == 0 ? a : round_up(bytes_, a, "layout");
  }

 private:
  static size_t round_up(size_t x, size_t a, const char* what) {
    TDIST_CHECK(x <= SIZE_MAX - (a - 1), "SymmetricLayout: '", what, "' ends beyond SIZE_MAX");
    return (x + a - 1) / a * a;
  }
  size_t bytes_ = 0;
};

// One allocation of a layout on a heap (collective), returned to the heap when destroyed
// (collective too), named after its `owner` for fault messages (SymmetricHeap::name_block).
// Move-only.
class SymmetricBlock {
 public:
  SymmetricBlock() = default;
  SymmetricBlock(SymmetricHeap& heap, const SymmetricLayout& layout, const std::string& owner)
      : heap_(&heap), base_(heap.allocate(layout.bytes())) {
    heap.name_block(base_, owner);
  }
  ~SymmetricBlock() { reset(); }
  SymmetricBlock(SymmetricBlock&& o) noexcept : heap_(o.heap_), base_(o.base_) { o.base_ = nullptr; }
  SymmetricBlock& operator=(SymmetricBlock&& o) noexcept {
    if (this != &o) {
      reset();
      heap_ = o.heap_;
      base_ = o.base_;
      o.base_ = nullptr;
    }
    return *this;
  }
  SymmetricBlock(const SymmetricBlock&) = delete;
  SymmetricBlock& operator=(const SymmetricBlock&) = delete;

  template <typename T>
  T* operator[](const SymmetricLayout::Region<T>& region) const {
    TDIST_CHECK(base_ != nullptr, "SymmetricBlock: no allocation");
    return region.at(base_);
  }
  void* base() const { return base_; }

 private:
  void reset() noexcept {
    if (!base_) return;
    try {
      heap_->free(base_);
    } catch (const std::exception& e) {  // a destructor must not throw: say it and leak the block
      std::fprintf(stderr, "tdist: returning a symmetric block to the heap failed: %s\n", e.what());
    }
    base_ = nullptr;
  }
  SymmetricHeap* heap_ = nullptr;
  void* base_ = nullptr;
};

}  // namespace tdist
