// What binding files other than tdist_python.cpp need of the Python runtime (tdist._C.Runtime, made
// by tdist.init): its World and SymmetricHeap, and a way to tear their own objects down before the
// heap goes (tdist.finalize is collective, and so is freeing a symmetric buffer).
#pragma once

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "tdist/common/cuda_check.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

namespace tdist_python {

struct RuntimeParts {
  tdist::World* world = nullptr;
  tdist::SymmetricHeap* heap = nullptr;
};

// The World and heap of `runtime` (a tdist._C.Runtime); throws tdist::Error naming `op` when it is
// not one or is closed.
RuntimeParts runtime_parts(nanobind::handle runtime, const char* op);

// Runs `fn` inside the runtime's close(), on every rank, before its heap and World are destroyed. A
// runtime never closed (the process exits without tdist.finalize) never runs it and never destroys
// what `fn` holds: that would free symmetric memory collectively while peers may be gone.
void on_runtime_close(nanobind::handle runtime, std::function<void()> fn);

// Makes `device` current for a scope and gives the caller's back (torch keeps its own current device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    TDIST_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) TDIST_CUDA_CHECK(cudaSetDevice(device));
  }
  ~ScopedDevice() { cudaSetDevice(previous_); }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
};

// A device pointer that Python passed as an integer (tensor.data_ptr()).
template <typename T>
T* ptr(uint64_t p) {
  return reinterpret_cast<T*>(p);
}

// Binding objects that own collective resources keep them in a shared box with a reset() that frees
// them; the runtime's close holds the box too, so tdist.finalize frees them before the heap even
// while Python still holds the object. Registers that reset, run on `device`.
template <typename Box>
void reset_on_runtime_close(nanobind::handle runtime, std::shared_ptr<Box> box, int device) {
  on_runtime_close(runtime, [box = std::move(box), device] {
    ScopedDevice scope(device);
    box->reset();
  });
}

// The object's own (collective) close(): resets `box` on `device` with the GIL released.
template <typename Box>
void close_box(Box& box, int device) {
  nanobind::gil_scoped_release release;
  ScopedDevice scope(device);
  box.reset();
}

}  // namespace tdist_python
