#include "tdist/version.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "tdist/common/log.hpp"

// CMake defines these from the VERSION file (the top-level CMakeLists.txt).
#ifndef TDIST_VERSION_STRING
#error "TDIST_VERSION_STRING must be defined by the build (from the VERSION file)"
#endif

namespace tdist {
namespace {

std::string nccl_code_to_string(int code) {
  // NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH.
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

std::string cuda_code_to_string(int code) {
  return std::to_string(code / 1000) + "." + std::to_string(code % 1000 / 10);
}

std::string loaded_nccl() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "unknown (ncclGetVersion failed)";
  return nccl_code_to_string(code);
}

std::string loaded_runtime() {
  int code = 0;
  if (cudaRuntimeGetVersion(&code) != cudaSuccess) return "unknown (cudaRuntimeGetVersion failed)";
  return cuda_code_to_string(code);
}

std::string driver() {
  int code = 0;
  if (cudaDriverGetVersion(&code) != cudaSuccess || code == 0) return "none (no CUDA driver loaded)";
  return cuda_code_to_string(code);
}

std::string gpu(int device) {
  cudaDeviceProp prop{};
  const cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: the report must not leave a sticky error behind
    return std::string("unavailable (") + cudaGetErrorString(e) + ")";
  }
  return std::to_string(device) + " " + prop.name + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
         ", " + std::to_string(prop.multiProcessorCount) + " SMs, " + std::to_string(prop.totalGlobalMem >> 20) +
         " MiB)";
}

}  // namespace

const char* version() { return TDIST_VERSION_STRING; }
int version_major() { return TDIST_VERSION_MAJOR; }
int version_minor() { return TDIST_VERSION_MINOR; }
int version_patch() { return TDIST_VERSION_PATCH; }

std::string version_report(int device) {
  std::string r;
  r += std::string("tdist: ") + version() + "\n";
  r += "NCCL built: " + nccl_code_to_string(NCCL_VERSION_CODE) + "\n";
  r += "NCCL loaded: " + loaded_nccl() + "\n";
  r += "CUDA runtime built: " + cuda_code_to_string(CUDART_VERSION) + "\n";
  r += "CUDA runtime loaded: " + loaded_runtime() + "\n";
  r += "CUDA driver: " + driver() + "\n";
  if (device >= 0) r += "GPU: " + gpu(device) + "\n";
  return r;
}

void log_startup(int device) {
  TDIST_INFO(INIT, "tdist ", version(), ", NCCL ", loaded_nccl(), " (built ", nccl_code_to_string(NCCL_VERSION_CODE),
             "), CUDA runtime ", loaded_runtime(), " (built ", cuda_code_to_string(CUDART_VERSION), "), driver ",
             driver(), ", GPU ", gpu(device));
}

}  // namespace tdist
