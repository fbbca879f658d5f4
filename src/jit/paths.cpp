// Finding tdist's, CUDA's, CUTLASS's and NCCL's headers, nvcc and the cache folder.
#include "tdist/jit/paths.hpp"

#include <dlfcn.h>
#include <limits.h>
#include <nccl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <mutex>

#include "detail.hpp"
#include "tdist/common/error.hpp"

namespace tdist::jit {
namespace {

using detail::dirname;
using detail::env;
using detail::file_exists;
using detail::is_dir;
using detail::join;

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// The file of the loaded shared object that holds `addr`.
std::string library_of(const void* addr) {
  Dl_info info{};
  if (::dladdr(addr, &info) == 0 || !info.dli_fname) return "";
  return real_path(info.dli_fname);
}

constexpr const char* kTdistMarker = "tdist/jit/compiler.hpp";

bool is_cuda_include(const std::string& dir) { return file_exists(join(dir, "cuda_runtime_api.h")); }

}  // namespace

std::string tdist_include_dir() {
  std::string e = env("TDIST_INCLUDE_DIR");
  if (!e.empty()) return e;
  static std::once_flag once;
  static std::string found;
  std::call_once(once, [] {
    // Install tree: <prefix>/lib[64]/libtdist.so and <prefix>/include/tdist.
    std::string lib = library_of(reinterpret_cast<const void*>(&tdist_include_dir));
    if (!lib.empty()) {
      for (std::string d = dirname(lib); d.size() > 1; d = dirname(d)) {
        std::string cand = join(d, "include");
        if (file_exists(join(cand, kTdistMarker))) {
          found = cand;
          return;
        }
        if (d == "/") break;
      }
    }
    // Build tree: the source tree this file was compiled from (src/jit/paths.cpp -> include/).
    std::string here = __FILE__;
    if (!here.empty() && here[0] == '/') {
      std::string cand = join(dirname(dirname(dirname(here))), "include");
      if (file_exists(join(cand, kTdistMarker))) found = cand;
    }
  });
  return found;
}

std::string cuda_home() {
  for (const char* var : {"CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"}) {
    std::string e = env(var);
    if (!e.empty() && is_cuda_include(join(e, "include"))) return e;
  }
  // Next to the libnvrtc we load: <cuda>/lib64/libnvrtc.so.N or <cuda>/lib/libnvrtc.so.N.
  std::string lib = detail::nvrtc_library_path();
  if (!lib.empty()) {
    std::string root = dirname(dirname(lib));
    if (is_cuda_include(join(root, "include"))) return root;
    std::string targets = join(root, "targets/x86_64-linux");
    if (is_cuda_include(join(targets, "include"))) return root;
  }
  if (is_cuda_include("/usr/local/cuda/include")) return "/usr/local/cuda";
  return "";
}

std::string cuda_include_dir() {
  std::string home = cuda_home();
  if (home.empty()) return "";
  if (is_cuda_include(join(home, "include"))) return join(home, "include");
  std::string targets = join(home, "targets/x86_64-linux/include");
  return is_cuda_include(targets) ? targets : "";
}

std::string cutlass_include_dir() {
  auto ok = [](const std::string& d) { return file_exists(join(d, "cutlass/cutlass.h")); };
  std::string e = env("CUTLASS_INCLUDE_DIR");
  if (!e.empty() && ok(e)) return e;
  e = env("CUTLASS_HOME");
  if (!e.empty()) {
    if (ok(join(e, "include"))) return join(e, "include");
    if (ok(e)) return e;
  }
  static std::once_flag once;
  static std::string found;
  std::call_once(once, [&] {
    // pip's nvidia-cutlass ships the headers inside its cutlass_library package. Asking python
    // where it is costs a process start, so this runs only for kernels that include CUTLASS.
    std::string py = detail::find_tool("python3");
    if (py.empty()) return;
    auto r =
        detail::run_process({py, "-c",
                             "import importlib.util as u\n"
                             "s = u.find_spec('cutlass_library')\n"
                             "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')"});
    if (r.exit_code != 0) return;
    std::string pkg = r.output.substr(0, r.output.find('\n'));
    if (pkg.empty()) return;
    for (const char* sub : {"source/include", "include"}) {
      std::string cand = join(pkg, sub);
      if (ok(cand)) {
        found = cand;
        return;
      }
    }
  });
  return found;
}

std::string nccl_include_dir() {
  auto ok = [](const std::string& d) { return file_exists(join(d, "nccl_device.h")); };
  std::string e = env("NCCL_INCLUDE_DIR");
  if (!e.empty() && ok(e)) return e;
  for (const char* var : {"NCCL_HOME", "NCCL_ROOT"}) {
    e = env(var);
    if (!e.empty() && ok(join(e, "include"))) return join(e, "include");
  }
  // libtdist links libnccl: take the headers that belong to the library in use.
  std::string lib = library_of(reinterpret_cast<const void*>(&ncclGetVersion));
  if (!lib.empty()) {
    std::string cand = join(dirname(dirname(lib)), "include");
    if (ok(cand)) return cand;
  }
  std::string cuda = cuda_include_dir();
  if (!cuda.empty() && ok(cuda)) return cuda;
  for (const char* d : {"/usr/local/include", "/usr/include"})
    if (ok(d)) return d;
  return "";
}

namespace {

// The last resort when neither XDG_CACHE_HOME nor HOME is set: $TMPDIR (else /tmp)/tdist-cache-<uid>.
// That folder is shared, so another user may have created the name first (and planted kernels in
// it): it is used only when this user owns it and nobody else can enter it.
std::string private_tmp_cache_dir() {
  std::string base = env("TMPDIR");
  if (base.empty() || base[0] != '/') base = "/tmp";
  const std::string dir = join(base, "tdist-cache-" + std::to_string(::geteuid()));
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    TDIST_FAIL("cannot create the JIT cache folder '", dir, "': ", std::strerror(errno),
               "; set TDIST_CACHE_DIR to a private folder");
  struct ::stat st;
  if (::lstat(dir.c_str(), &st) != 0)
    TDIST_FAIL("cannot inspect the JIT cache folder '", dir, "': ", std::strerror(errno),
               "; set TDIST_CACHE_DIR to a private folder");
  std::string why;
  if (!S_ISDIR(st.st_mode))
    why = dir + " is not a folder (a symbolic link or a file)";
  else if (st.st_uid != ::geteuid())
    why = dir + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
          std::to_string(::geteuid()) + ")";
  else if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    why = dir + " has mode " + mode + ", expected 0700";
  }
  if (!why.empty())
    TDIST_FAIL("refusing the JIT cache folder: ", why,
               ". Kernels in it could come from another user; set TDIST_CACHE_DIR (or HOME or "
               "XDG_CACHE_HOME) to a folder of your own, or remove it and let tdist recreate it");
  return dir;
}

}  // namespace

std::string default_cache_dir() {
  std::string e = env("TDIST_CACHE_DIR");
  if (!e.empty()) return e;
  e = env("XDG_CACHE_HOME");
  if (!e.empty()) return join(e, "tdist");
  e = env("HOME");
  if (!e.empty()) return join(e, ".cache/tdist");
  return private_tmp_cache_dir();
}

std::string nvcc_path() {
  std::string e = env("TDIST_NVCC");
  if (!e.empty()) return e;
  std::string home = cuda_home();
  if (!home.empty() && file_exists(join(home, "bin/nvcc"))) return join(home, "bin/nvcc");
  return "nvcc";
}

std::vector<std::string> default_include_dirs(bool for_nvcc) {
  std::vector<std::string> dirs;
  auto add = [&](const std::string& d) {
    if (!d.empty() && is_dir(d)) dirs.push_back(d);
  };
  add(tdist_include_dir());
  std::string cuda = cuda_include_dir();
  if (for_nvcc) {
    add(nccl_include_dir());
  } else {
    add(cuda);
    // CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl; nvcc adds it by itself.
    if (!cuda.empty()) add(join(cuda, "cccl"));
  }
  return dirs;
}

}  // namespace tdist::jit
