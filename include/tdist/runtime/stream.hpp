// Stream-ordered helpers that use no SM: copy-engine puts and gets into a peer's symmetric buffer,
// and flag writes and waits executed by the GPU's front end (cuStreamWriteValue / WaitValue).
//
// Ordering: a flag write runs after all earlier work of its stream and makes that work's writes
// visible first (the default write flags include a memory barrier); work after a flag wait does
// not start before the flag holds. Stream waits cannot time out: a flag that is never written
// stalls the stream, and with it cudaStreamSynchronize; tdist's in-kernel waits do time out.
// The CUDA driver is reached through the runtime's entry-point query, so no libcuda link is needed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tdist/runtime/symmetric_heap.hpp"

namespace tdist {

enum class StreamWaitCmp { kGe, kEq, kAnd, kNor };

void stream_write_value32(cudaStream_t stream, device::u32* address, device::u32 value);
void stream_write_value64(cudaStream_t stream, device::u64* address, device::u64 value);
void stream_wait_value32(cudaStream_t stream, const device::u32* address, device::u32 value,
                         StreamWaitCmp cmp = StreamWaitCmp::kGe);
void stream_wait_value64(cudaStream_t stream, const device::u64* address, device::u64 value,
                         StreamWaitCmp cmp = StreamWaitCmp::kGe);

// Whether `stream` is capturing a CUDA graph. A query the driver refuses (the legacy stream while
// another stream captures in global mode) counts as capturing: nothing that must not run under a
// capture runs then either.
bool stream_is_capturing(cudaStream_t stream);

// Copy engine: `bytes` from local `src` to `peer`'s copy of the symmetric buffer `dst`.
void put_async(const SymmetricHeap& heap, void* dst, const void* src, size_t bytes, int peer, cudaStream_t stream);
// Copy engine: `bytes` from `peer`'s copy of the symmetric buffer `src` to local `dst`.
void get_async(const SymmetricHeap& heap, void* dst, const void* src, size_t bytes, int peer, cudaStream_t stream);
// Copy engine put followed, in stream order, by writing `value` into `peer`'s copy of `flag`.
void put_signal_async(const SymmetricHeap& heap, void* dst, const void* src, size_t bytes, device::u64* flag,
                      device::u64 value, int peer, cudaStream_t stream);

// A second stream for work beside a caller's stream within one call (copies next to kernels): fork()
// starts it after what the caller's stream holds so far, join() makes the caller's stream wait for
// it. Under CUDA-graph capture this records as a fork and a join. mark() + fork_from_mark() split a
// fork, so that work enqueued on the caller's stream in between is not waited for. join() without a
// fork since the last join does nothing (a capture may not wait on work recorded outside it).
class SideStream {
 public:
  SideStream();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t get() const { return stream_; }
  void fork(cudaStream_t from) {
    mark(from);
    fork_from_mark();
  }
  void mark(cudaStream_t from);
  void fork_from_mark();
  void join(cudaStream_t into);

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool forked_ = false;
};

}  // namespace tdist
