// NCCL hands out LSA peer addresses only in device code; fetch them once into tdist's descriptor,
// so that kernels (NVRTC-compiled ones included) never need NCCL's device headers.
#include <nccl.h>
#include <nccl_device.h>

#include "src/runtime/lsa_pointers.hpp"
#include "tdist/common/cuda_check.hpp"

namespace tdist::detail {
namespace {

__global__ void lsa_bases_kernel(ncclWindow_t window, int lsa_size, char** out) {
  const int peer = threadIdx.x;
  if (peer < lsa_size) out[peer] = static_cast<char*>(ncclGetLsaPointer(window, 0, peer));
}

}  // namespace

void fetch_lsa_bases(ncclWindow_t window, int lsa_size, char** host_out) {
  TDIST_CHECK(lsa_size > 0 && lsa_size <= 1024, "LSA team of ", lsa_size, " ranks");
  char** dev = nullptr;
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  TDIST_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&dev), sizeof(char*) * lsa_size, stream));
  lsa_bases_kernel<<<1, lsa_size, 0, stream>>>(window, lsa_size, dev);
  TDIST_CUDA_CHECK(cudaGetLastError());
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host_out, dev, sizeof(char*) * lsa_size, cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaFreeAsync(dev, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace tdist::detail
