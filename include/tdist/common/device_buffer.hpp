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
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

}  // namespace tdist
