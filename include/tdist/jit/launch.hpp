// Loading compiled kernels and launching them through the CUDA driver API.
//
// libcuda is opened with dlopen on first use: libtdist and every CPU-only path (compile, cache,
// tdist-compile) work on machines without a GPU driver.
//
//   auto compiled = tdist::jit::compile(req);
//   auto module = tdist::jit::Module::load(compiled);
//   tdist::jit::Kernel k = module->kernel("my_kernel<128, __nv_bfloat16>");
//   tdist::jit::KernelArgs args;
//   args.add(d_out).add(d_in).add(n);
//   tdist::jit::LaunchConfig cfg{.grid = {132}, .block = {256}, .shared_bytes = 200 * 1024, .stream = s};
//   tdist::jit::launch(k, cfg, args);
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "tdist/jit/compiler.hpp"

namespace tdist::jit {

// Kernel arguments in the form cuLaunchKernel takes (an array of pointers to the values).
// Each add() copies the value, so temporaries are fine; values keep their own alignment.
class KernelArgs {
 public:
  template <typename T>
  KernelArgs& add(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel arguments must be trivially copyable");
    add_bytes(&value, sizeof(T), alignof(T));
    return *this;
  }
  void add_bytes(const void* data, std::size_t size, std::size_t align);
  // Widest alignment a kernel parameter needs (float4, double2, ...).
  static constexpr std::size_t kMaxAlign = 16;
  // The void** array; valid until the next add().
  void** data();
  std::size_t size() const { return offsets_.size(); }

 private:
  // Raw 16-byte-aligned storage: std::vector<std::max_align_t> makes nvcc 13's front end fail
  // with an internal error in CUDA translation units that include this header.
  struct alignas(kMaxAlign) Slot {
    unsigned char bytes[kMaxAlign];
  };
  std::vector<Slot> storage_;
  std::size_t used_ = 0;
  std::vector<std::size_t> offsets_;
  std::vector<void*> pointers_;
};

template <typename... Ts>
KernelArgs make_args(const Ts&... values) {
  KernelArgs a;
  (a.add(values), ...);
  return a;
}

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
  Dim3() = default;
  Dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct LaunchConfig {
  Dim3 grid{};
  Dim3 block{};
  std::size_t shared_bytes = 0;                // dynamic shared memory; > 48 KiB raises the kernel's limit
  Dim3 cluster{};                              // thread block cluster (1,1,1: none)
  bool programmatic_dependent_launch = false;  // may start before the previous kernel on the stream ends
  cudaStream_t stream = nullptr;
};

class Module;

// One kernel of a loaded module (a context-independent CUkernel handle).
class Kernel {
 public:
  Kernel() = default;
  const std::string& name() const { return name_; }
  void* handle() const { return handle_; }  // CUkernel
  explicit operator bool() const { return handle_ != nullptr; }

 private:
  friend class Module;
  friend void launch(const Kernel&, const LaunchConfig&, void**);
  std::shared_ptr<const Module> module_;  // keeps the library loaded
  void* handle_ = nullptr;
  std::string name_;
};

// A loaded cubin (cuLibraryLoadData: loaded into each context on first use there).
class Module : public std::enable_shared_from_this<Module> {
 public:
  static std::shared_ptr<Module> load(std::shared_ptr<const CompiledKernel> compiled);
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // By name expression given at compile time, or by symbol (mangled or extern "C").
  Kernel kernel(const std::string& name) const;
  const CompiledKernel& compiled() const { return *compiled_; }

 private:
  friend void launch(const Kernel&, const LaunchConfig&, void**);
  Module() = default;
  std::shared_ptr<const CompiledKernel> compiled_;
  void* library_ = nullptr;  // CUlibrary
  // Dynamic shared memory each (kernel, device) has been opened to. Kept here, with the library: a
  // process-wide table keyed by CUkernel would outlive an unloaded library, and a later library's
  // kernel at the same address would skip its own opt-in.
  mutable std::mutex smem_mu_;
  mutable std::map<std::pair<void*, int>, std::size_t> smem_raised_;
  // Address of the module's tdist_profile_config (0: compiled without the profiler) and the
  // KernelProfiler::generation() last written there (under smem_mu_).
  unsigned long long profile_config_ = 0;
  mutable std::uint64_t profile_generation_ = 0;
};

void launch(const Kernel& kernel, const LaunchConfig& cfg, void** args);
inline void launch(const Kernel& kernel, const LaunchConfig& cfg, KernelArgs& args) {
  launch(kernel, cfg, args.data());
}
inline void launch(const Kernel& kernel, const LaunchConfig& cfg, KernelArgs&& args) {
  launch(kernel, cfg, args.data());
}

// True when libcuda.so.1 can be opened and cuInit succeeds (never throws).
bool driver_available();
// Name of the current device ("NVIDIA H200"); throws tdist::Error without a GPU.
std::string current_device_name();

}  // namespace tdist::jit
