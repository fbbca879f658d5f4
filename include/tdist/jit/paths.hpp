// Where the JIT finds headers, compilers and its cache. Each lookup honours an environment
// override first; an empty string means "not found".
#pragma once

#include <string>
#include <vector>

namespace tdist::jit {

// tdist's include dir (holding tdist/...): TDIST_INCLUDE_DIR, else next to the loaded libtdist
// (<prefix>/lib/libtdist.so -> <prefix>/include), else the source tree libtdist was built from.
std::string tdist_include_dir();
// CUDA's include dir: CUDA_HOME / CUDA_PATH, next to the loaded libnvrtc, /usr/local/cuda.
std::string cuda_include_dir();
// CUDA's root (holding bin/nvcc), from the same places.
std::string cuda_home();
// CUTLASS/CuTe headers: CUTLASS_HOME (or CUTLASS_INCLUDE_DIR), else a pip-installed nvidia-cutlass
// package of the python3 on PATH (its include dir holds cute/ and cutlass/). Empty if absent.
std::string cutlass_include_dir();
// NCCL's include dir (holding nccl_device.h): NCCL_INCLUDE_DIR, NCCL_HOME/include, next to the
// loaded libnccl, then the system dirs. Used for nvcc-compiled kernels only.
std::string nccl_include_dir();
// The cache root: TDIST_CACHE_DIR, else $XDG_CACHE_HOME/tdist, else $HOME/.cache/tdist, else
// $TMPDIR (or /tmp)/tdist-cache-<uid>, created 0700; that last one is refused (tdist::Error naming
// TDIST_CACHE_DIR) unless this user owns it and its mode is 0700.
std::string default_cache_dir();
// nvcc: TDIST_NVCC, else <cuda_home>/bin/nvcc, else "nvcc" from PATH.
std::string nvcc_path();

// The include dirs given to the compiler for every kernel, after the request's own: tdist's, then
// for NVRTC CUDA's and CUDA's cccl/ (nvcc adds those itself), for nvcc NCCL's. CUTLASS's dir is
// added only for kernels whose includes name cutlass/ or cute/ headers.
std::vector<std::string> default_include_dirs(bool for_nvcc);

}  // namespace tdist::jit
