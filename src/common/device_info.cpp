#include "tdist/common/device_info.hpp"

#include <cuda_runtime.h>

#include "tdist/common/cuda_check.hpp"

namespace tdist {

int current_device() {
  int device = 0;
  TDIST_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int sm_count(int device) {
  int sms = 0;
  TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

int compute_capability(int device) {
  int major = 0, minor = 0;
  TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

}  // namespace tdist
