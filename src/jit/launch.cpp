// Module loading and kernel launch through the CUDA driver API, opened with dlopen.
#include "tdist/jit/launch.hpp"

#include <cuda.h>
#include <dlfcn.h>

#include <map>
#include <mutex>
#include <utility>

#include "detail.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/process.hpp"
#include "tdist/runtime/kernel_profiler.hpp"
#include "tdist/runtime/wait_config.hpp"

namespace tdist::jit {
namespace {

struct Driver {
  decltype(&::cuInit) Init = nullptr;
  decltype(&::cuGetErrorName) GetErrorName = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent = nullptr;
  decltype(&::cuCtxGetDevice) CtxGetDevice = nullptr;
  decltype(&::cuLibraryLoadData) LibraryLoadData = nullptr;
  decltype(&::cuLibraryUnload) LibraryUnload = nullptr;
  decltype(&::cuLibraryGetKernel) LibraryGetKernel = nullptr;
  decltype(&::cuLibraryGetGlobal) LibraryGetGlobal = nullptr;
  decltype(&::cuLibraryGetModule) LibraryGetModule = nullptr;
  decltype(&::cuKernelGetFunction) KernelGetFunction = nullptr;
  decltype(&::cuMemcpyHtoD) MemcpyHtoD = nullptr;
  decltype(&::cuMemcpyHtoDAsync) MemcpyHtoDAsync = nullptr;
  decltype(&::cuStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&::cuKernelSetAttribute) KernelSetAttribute = nullptr;
  decltype(&::cuLaunchKernelEx) LaunchKernelEx = nullptr;
  decltype(&::cuDeviceGetName) DeviceGetName = nullptr;
  std::string error;  // why the driver is unusable, empty if fine
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      d.error = std::string("cannot open libcuda.so.1 (no NVIDIA driver on this machine?): ") + (e ? e : "");
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
      if (!fn) d.error += std::string("libcuda lacks ") + name + " (driver older than CUDA 12.0?); ";
    };
    sym(d.Init, "cuInit");
    sym(d.GetErrorName, "cuGetErrorName");
    sym(d.GetErrorString, "cuGetErrorString");
    sym(d.CtxGetCurrent, "cuCtxGetCurrent");
    sym(d.CtxGetDevice, "cuCtxGetDevice");
    sym(d.LibraryLoadData, "cuLibraryLoadData");
    sym(d.LibraryUnload, "cuLibraryUnload");
    sym(d.LibraryGetKernel, "cuLibraryGetKernel");
    sym(d.LibraryGetGlobal, "cuLibraryGetGlobal");
    sym(d.LibraryGetModule, "cuLibraryGetModule");
    sym(d.KernelGetFunction, "cuKernelGetFunction");
    sym(d.MemcpyHtoD, "cuMemcpyHtoD_v2");
    sym(d.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    sym(d.StreamSynchronize, "cuStreamSynchronize");
    sym(d.KernelSetAttribute, "cuKernelSetAttribute");
    sym(d.LaunchKernelEx, "cuLaunchKernelEx");
    sym(d.DeviceGetName, "cuDeviceGetName");
    if (!d.error.empty()) return;
    CUresult r = d.Init(0);
    if (r != CUDA_SUCCESS) {
      const char* name = nullptr;
      d.GetErrorName(r, &name);
      d.error = std::string("cuInit failed: ") + (name ? name : "?");
    }
  });
  return d;
}

const Driver& drv() {
  const Driver& d = driver();
  if (!d.error.empty()) TDIST_FAIL(d.error);
  return d;
}

[[noreturn]] void cu_fail(CUresult r, const char* what, const char* file, int line) {
  const char* name = nullptr;
  const char* desc = nullptr;
  driver().GetErrorName(r, &name);
  driver().GetErrorString(r, &desc);
  ::tdist::detail::throw_at(file, line, what, " failed: ", name ? name : "?", " (", desc ? desc : "", ")");
}

#define TDIST_JIT_CU(expr)                                                      \
  do {                                                                          \
    CUresult tdist_r_ = (expr);                                                 \
    if (tdist_r_ != CUDA_SUCCESS) cu_fail(tdist_r_, #expr, __FILE__, __LINE__); \
  } while (0)

// The runtime's primary context of the current device, made current if no context is.
CUdevice current_device() {
  const Driver& d = drv();
  CUcontext ctx = nullptr;
  TDIST_JIT_CU(d.CtxGetCurrent(&ctx));
  if (!ctx) {
    cudaError_t e = cudaFree(nullptr);  // creates and binds the runtime's primary context
    if (e != cudaSuccess) TDIST_FAIL("cannot initialise the CUDA context: ", cudaGetErrorString(e));
  }
  CUdevice dev = 0;
  TDIST_JIT_CU(d.CtxGetDevice(&dev));
  return dev;
}

}  // namespace

void KernelArgs::add_bytes(const void* data, std::size_t size, std::size_t align) {
  if (align == 0 || align > kMaxAlign) align = kMaxAlign;
  std::size_t off = (used_ + align - 1) / align * align;
  std::size_t need = (off + size + sizeof(Slot) - 1) / sizeof(Slot);
  if (need > storage_.size()) storage_.resize(std::max(need, storage_.size() * 2));
  std::memcpy(reinterpret_cast<char*>(storage_.data()) + off, data, size);
  used_ = off + size;
  offsets_.push_back(off);
}

void** KernelArgs::data() {
  pointers_.resize(offsets_.size());
  for (std::size_t i = 0; i < offsets_.size(); ++i)
    pointers_[i] = reinterpret_cast<char*>(storage_.data()) + offsets_[i];
  return pointers_.data();
}

std::shared_ptr<Module> Module::load(std::shared_ptr<const CompiledKernel> compiled) {
  TDIST_CHECK_ARG(compiled && !compiled->cubin.empty(), "compiled", "no cubin to load");
  const Driver& d = drv();
  std::shared_ptr<Module> m(new Module());
  m->compiled_ = std::move(compiled);
  CUlibrary lib = nullptr;
  CUresult r = d.LibraryLoadData(&lib, m->compiled_->cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    d.GetErrorName(r, &name);
    TDIST_FAIL("cannot load the cubin of ", m->compiled_->file_name, " (", m->compiled_->arch, "): ", name ? name : "?",
               r == CUDA_ERROR_NO_BINARY_FOR_GPU ? " - it was compiled for another GPU architecture" : "");
  }
  m->library_ = lib;
  // Load into the current context now (Module::kernel loads each function the same way).
  current_device();
  CUmodule loaded = nullptr;
  TDIST_JIT_CU(d.LibraryGetModule(&loaded, lib));
  // Modules that include tdist's device API carry their own wait timeout and rank. Only those whose
  // cubin names the symbol are asked for it: a failing lookup is an API error that tools such as
  // compute-sanitizer report.
  CUdeviceptr config_ptr = 0;
  size_t config_bytes = 0;
  const std::string& cubin = m->compiled_->cubin;
  if (cubin.find(device::kWaitConfigSymbol) != std::string::npos &&
      d.LibraryGetGlobal(&config_ptr, &config_bytes, lib, device::kWaitConfigSymbol) == CUDA_SUCCESS) {
    TDIST_CHECK(config_bytes == sizeof(device::WaitConfig), "module ", m->compiled_->file_name, " has a ",
                device::kWaitConfigSymbol, " of ", config_bytes, " bytes, expected ", sizeof(device::WaitConfig));
    const device::WaitConfig config = make_wait_config(process_rank(), wait_timeout_seconds_from_env());
    TDIST_JIT_CU(d.MemcpyHtoD(config_ptr, &config, sizeof(config)));
  }
  // Modules compiled with the intra-kernel profiler: launch() points them at its buffer.
  if (cubin.find(device::kProfileConfigSymbol) != std::string::npos &&
      d.LibraryGetGlobal(&config_ptr, &config_bytes, lib, device::kProfileConfigSymbol) == CUDA_SUCCESS) {
    TDIST_CHECK(config_bytes == sizeof(device::ProfileConfig), "module ", m->compiled_->file_name, " has a ",
                device::kProfileConfigSymbol, " of ", config_bytes, " bytes, expected ", sizeof(device::ProfileConfig));
    m->profile_config_ = static_cast<unsigned long long>(config_ptr);
  }
  return m;
}

Module::~Module() {
  if (library_ && driver().error.empty()) driver().LibraryUnload(static_cast<CUlibrary>(library_));
}

Kernel Module::kernel(const std::string& name) const {
  std::string symbol = name;
  for (const auto& [expr, sym] : compiled_->lowered_names)
    if (expr == name) symbol = sym;
  CUkernel k = nullptr;
  CUresult r = drv().LibraryGetKernel(&k, static_cast<CUlibrary>(library_), symbol.c_str());
  if (r != CUDA_SUCCESS) {
    std::string known;
    for (const auto& [expr, sym] : compiled_->lowered_names) known += "\n  " + expr + " -> " + sym;
    TDIST_FAIL("no kernel '", name, "' in ", compiled_->file_name,
               "; compiled name expressions:", known.empty() ? std::string(" none") : known);
  }
  // Under lazy loading (CUDA's default) a function is loaded at its first launch, and that load can
  // wait for kernels already running: a kernel spinning until this one runs would deadlock. Load
  // it into the current context now.
  current_device();
  CUfunction loaded = nullptr;
  TDIST_JIT_CU(drv().KernelGetFunction(&loaded, k));
  Kernel out;
  out.module_ = shared_from_this();
  out.handle_ = k;
  out.name_ = name;
  return out;
}

void launch(const Kernel& kernel, const LaunchConfig& cfg, void** args) {
  TDIST_CHECK_ARG(kernel.handle_ != nullptr, "kernel", "empty kernel handle");
  check_device_faults();  // after an aborted wait, nothing more is launched on out-of-step flags
  const Driver& d = drv();
  CUdevice dev = current_device();
  auto k = static_cast<CUkernel>(kernel.handle_);
  if (cfg.shared_bytes > 48 * 1024) {
    // Above 48 KiB a kernel must opt in; its module remembers the limit set per (kernel, device).
    const Module& module = *kernel.module_;
    std::lock_guard<std::mutex> lock(module.smem_mu_);
    std::size_t& cur = module.smem_raised_[{kernel.handle_, static_cast<int>(dev)}];
    if (cur < cfg.shared_bytes) {
      TDIST_JIT_CU(
          d.KernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(cfg.shared_bytes), k, dev));
      cur = cfg.shared_bytes;
    }
  }
  if (kernel.module_->profile_config_ != 0) {
    // The profiler's buffer changed since this module last saw it (enable, disable): write it first,
    // in this stream's order, and wait for the write, so that launches on other streams see it too.
    const Module& module = *kernel.module_;
    const uint64_t generation = KernelProfiler::generation();
    std::lock_guard<std::mutex> lock(module.smem_mu_);
    if (module.profile_generation_ != generation) {
      const device::ProfileConfig config = KernelProfiler::config();
      const auto stream = reinterpret_cast<CUstream>(cfg.stream);
      TDIST_JIT_CU(
          d.MemcpyHtoDAsync(static_cast<CUdeviceptr>(module.profile_config_), &config, sizeof(config), stream));
      TDIST_JIT_CU(d.StreamSynchronize(stream));
      module.profile_generation_ = generation;
    }
  }
  CUlaunchAttribute attrs[2];
  unsigned n = 0;
  if (cfg.cluster.x * cfg.cluster.y * cfg.cluster.z > 1) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[n].value.clusterDim.x = cfg.cluster.x;
    attrs[n].value.clusterDim.y = cfg.cluster.y;
    attrs[n].value.clusterDim.z = cfg.cluster.z;
    ++n;
  }
  // TDIST_JIT_PROGRAMMATIC_LAUNCH=0 launches every kernel in plain stream order (griddepcontrol then
  // does nothing): to rule the early start in or out when a result is in doubt. Read once.
  static const bool programmatic_allowed = tdist::env::flag("TDIST_JIT_PROGRAMMATIC_LAUNCH", true);
  if (cfg.programmatic_dependent_launch && programmatic_allowed) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[n].value.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  CUlaunchConfig lc{};
  lc.gridDimX = cfg.grid.x;
  lc.gridDimY = cfg.grid.y;
  lc.gridDimZ = cfg.grid.z;
  lc.blockDimX = cfg.block.x;
  lc.blockDimY = cfg.block.y;
  lc.blockDimZ = cfg.block.z;
  lc.sharedMemBytes = unsigned(cfg.shared_bytes);
  lc.hStream = reinterpret_cast<CUstream>(cfg.stream);
  lc.attrs = n ? attrs : nullptr;
  lc.numAttrs = n;
  // A CUkernel launches as a CUfunction in the current context (context-independent loading).
  CUresult r = d.LaunchKernelEx(&lc, reinterpret_cast<CUfunction>(k), args, nullptr);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    d.GetErrorName(r, &name);
    TDIST_FAIL("launch of ", kernel.name_, " failed: ", name ? name : "?", " (grid ", cfg.grid.x, "x", cfg.grid.y, "x",
               cfg.grid.z, ", block ", cfg.block.x, "x", cfg.block.y, "x", cfg.block.z, ", smem ", cfg.shared_bytes,
               ", cluster ", cfg.cluster.x, "x", cfg.cluster.y, "x", cfg.cluster.z, ")");
  }
}

bool driver_available() { return driver().error.empty(); }

std::string current_device_name() {
  if (!driver_available()) TDIST_FAIL(driver().error);
  CUdevice dev = current_device();
  char name[256] = {};
  TDIST_JIT_CU(drv().DeviceGetName(name, sizeof name, dev));
  return name;
}

}  // namespace tdist::jit
