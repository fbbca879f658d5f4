// tdist::DeviceBuffer: device memory from cudaMalloc, owned (freed when the object goes), movable.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "tdist/common/cuda_check.hpp"

namespace tdist {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // At least 256 bytes, so that even an empty buffer has a valid, aligned address.
  explicit DeviceBuffer(size_t bytes) { TDIST_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 256))); }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  // Zero-filled, and the fill complete before any stream's later work: cudaMemset is ordered only
  // with the legacy default stream, not with the non-blocking streams kernels may run on.
  static DeviceBuffer zeroed(size_t bytes) {
    DeviceBuffer b(bytes);
    zero_now(b.p_, bytes);
    return b;
  }
  // Sets bytes at p to zero, complete on return (see zeroed).
  static void zero_now(void* p, size_t bytes) {
    TDIST_CUDA_CHECK(cudaMemset(p, 0, bytes));
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

}  // namespace tdist
