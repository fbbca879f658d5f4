// NVRTC loaded on first use, so that libtdist loads where NVRTC is not installed.
#include <cuda.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "detail.hpp"
#include "tdist/common/error.hpp"

namespace tdist::jit::detail {
namespace {

struct Loaded {
  NvrtcApi api;
  std::string error;
  void* handle = nullptr;
};

const Loaded& load() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    std::string e = env("TDIST_NVRTC_LIBRARY");
    if (!e.empty()) candidates.push_back(e);
    // The major version tdist was built against keeps the ABI of nvrtc.h.
    std::string soname = "libnvrtc.so." + std::to_string(CUDA_VERSION / 1000);
    candidates.push_back(soname);
    for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
      std::string home = env(var);
      if (!home.empty()) {
        candidates.push_back(join(home, "lib64/" + soname));
        candidates.push_back(join(home, "lib/" + soname));
      }
    }
    candidates.push_back("/usr/local/cuda/lib64/" + soname);
    candidates.push_back("libnvrtc.so");
    std::string tried;
    for (const auto& c : candidates) {
      loaded.handle = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (loaded.handle) break;
      const char* err = ::dlerror();
      tried += "\n  " + c + ": " + (err ? err : "not found");
    }
    if (!loaded.handle) {
      loaded.error = "cannot load NVRTC (set TDIST_NVRTC_LIBRARY or CUDA_HOME):" + tried;
      return;
    }
    NvrtcApi& a = loaded.api;
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(loaded.handle, name));
      if (!fn) {
        ok = false;
        loaded.error += std::string("NVRTC lacks ") + name + "; ";
      }
    };
    sym(a.Version, "nvrtcVersion");
    sym(a.GetErrorString, "nvrtcGetErrorString");
    sym(a.CreateProgram, "nvrtcCreateProgram");
    sym(a.DestroyProgram, "nvrtcDestroyProgram");
    sym(a.CompileProgram, "nvrtcCompileProgram");
    sym(a.AddNameExpression, "nvrtcAddNameExpression");
    sym(a.GetLoweredName, "nvrtcGetLoweredName");
    sym(a.GetProgramLogSize, "nvrtcGetProgramLogSize");
    sym(a.GetProgramLog, "nvrtcGetProgramLog");
    sym(a.GetCUBINSize, "nvrtcGetCUBINSize");
    sym(a.GetCUBIN, "nvrtcGetCUBIN");
    sym(a.GetPTXSize, "nvrtcGetPTXSize");
    sym(a.GetPTX, "nvrtcGetPTX");
    if (!ok) return;
    a.Version(&a.major, &a.minor);
    Dl_info info{};
    if (::dladdr(reinterpret_cast<const void*>(a.Version), &info) && info.dli_fname) {
      char buf[4096];
      a.path = ::realpath(info.dli_fname, buf) ? buf : info.dli_fname;
    }
  });
  return loaded;
}

}  // namespace

const NvrtcApi& nvrtc() {
  const Loaded& l = load();
  if (!l.error.empty()) TDIST_FAIL(l.error);
  return l.api;
}

std::string nvrtc_library_path() {
  const Loaded& l = load();
  return l.error.empty() ? l.api.path : std::string();
}

}  // namespace tdist::jit::detail
