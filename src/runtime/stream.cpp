#include "tdist/runtime/stream.hpp"

#include <cuda.h>

#include <mutex>

#include "tdist/common/cuda_check.hpp"

namespace tdist {
namespace {

using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// Driver entry points, looked up once through the runtime (no link against libcuda).
struct StreamMemOps {
  WriteValue32 write32 = nullptr, wait32 = nullptr;
  WriteValue64 write64 = nullptr, wait64 = nullptr;
};

template <typename Fn>
void lookup(const char* name, Fn* out) {
  cudaDriverEntryPointQueryResult status;
  void* fn = nullptr;
  TDIST_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status));
  TDIST_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "the CUDA driver has no ", name,
              " (driver too old for CUDA 12 stream memory operations?)");
  *out = reinterpret_cast<Fn>(fn);
}

const StreamMemOps& ops() {
  static StreamMemOps table;
  static std::once_flag once;
  std::call_once(once, [] {
    lookup("cuStreamWriteValue32", &table.write32);
    lookup("cuStreamWaitValue32", &table.wait32);
    lookup("cuStreamWriteValue64", &table.write64);
    lookup("cuStreamWaitValue64", &table.wait64);
  });
  return table;
}

unsigned int wait_flags(StreamWaitCmp cmp) {
  switch (cmp) {
    case StreamWaitCmp::kGe: return CU_STREAM_WAIT_VALUE_GEQ;
    case StreamWaitCmp::kEq: return CU_STREAM_WAIT_VALUE_EQ;
    case StreamWaitCmp::kAnd: return CU_STREAM_WAIT_VALUE_AND;
    default: return CU_STREAM_WAIT_VALUE_NOR;
  }
}

CUdeviceptr as_device_ptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

void check_aligned(const void* address, size_t alignment) {
  TDIST_CHECK_ARG(address != nullptr && reinterpret_cast<uintptr_t>(address) % alignment == 0, "address",
                  "expected a non-null flag address aligned to ", alignment, " bytes, got ", address);
}

}  // namespace

void stream_write_value32(cudaStream_t stream, device::u32* address, device::u32 value) {
  check_aligned(address, 4);
  TDIST_CU_CHECK(ops().write32(stream, as_device_ptr(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void stream_write_value64(cudaStream_t stream, device::u64* address, device::u64 value) {
  check_aligned(address, 8);
  TDIST_CU_CHECK(ops().write64(stream, as_device_ptr(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void stream_wait_value32(cudaStream_t stream, const device::u32* address, device::u32 value, StreamWaitCmp cmp) {
  check_aligned(address, 4);
  TDIST_CU_CHECK(ops().wait32(stream, as_device_ptr(address), value, wait_flags(cmp)));
}

void stream_wait_value64(cudaStream_t stream, const device::u64* address, device::u64 value, StreamWaitCmp cmp) {
  check_aligned(address, 8);
  TDIST_CU_CHECK(ops().wait64(stream, as_device_ptr(address), value, wait_flags(cmp)));
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

void put_async(const SymmetricHeap& heap, void* dst, const void* src, size_t bytes, int peer, cudaStream_t stream) {
  TDIST_CHECK_ARG(heap.contains(dst) && heap.contains(static_cast<char*>(dst) + bytes - (bytes > 0)), "dst",
                  "expected a range inside the symmetric heap, got ", dst, " + ", bytes, " bytes");
  TDIST_CUDA_CHECK(cudaMemcpyAsync(heap.peer_ptr(dst, peer), src, bytes, cudaMemcpyDeviceToDevice, stream));
}

void get_async(const SymmetricHeap& heap, void* dst, const void* src, size_t bytes, int peer, cudaStream_t stream) {
  TDIST_CHECK_ARG(heap.contains(src) && heap.contains(static_cast<const char*>(src) + bytes - (bytes > 0)), "src",
                  "expected a range inside the symmetric heap, got ", src, " + ", bytes, " bytes");
  TDIST_CUDA_CHECK(cudaMemcpyAsync(dst, heap.peer_ptr(src, peer), bytes, cudaMemcpyDeviceToDevice, stream));
}

void put_signal_async(const SymmetricHeap& heap, void* dst, const void* src, size_t bytes, device::u64* flag,
                      device::u64 value, int peer, cudaStream_t stream) {
  put_async(heap, dst, src, bytes, peer, stream);
  stream_write_value64(stream, heap.peer_ptr(flag, peer), value);
}

SideStream::SideStream() {
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  TDIST_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
}

SideStream::~SideStream() {
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
  cudaStreamDestroy(stream_);
}

void SideStream::mark(cudaStream_t from) { TDIST_CUDA_CHECK(cudaEventRecord(fork_, from)); }

void SideStream::fork_from_mark() {
  TDIST_CUDA_CHECK(cudaStreamWaitEvent(stream_, fork_, 0));
  forked_ = true;
}

void SideStream::join(cudaStream_t into) {
  if (!forked_) return;
  forked_ = false;
  TDIST_CUDA_CHECK(cudaEventRecord(join_, stream_));
  TDIST_CUDA_CHECK(cudaStreamWaitEvent(into, join_, 0));
}

}  // namespace tdist
