// Compiled for sm_80, sm_89 and sm_90a: the device API must not be Hopper-only.
#include "tdist/device.cuh"

using namespace tdist::device;

__global__ void device_api_uses(SymmetricHeapView heap, u64* flag, u32* flag32, u64* pad, char* dst, const char* src,
                                u64 bytes, int peer) {
  putmem_thread(heap, dst, src, bytes, peer);
  putmem_nbi_warp(heap, dst, src, bytes, peer);
  getmem_block(heap, dst, src, bytes, peer);
  putmem_signal_warp(heap, dst, src, bytes, flag, u64{1}, SignalOp::kAdd, peer);
  signal_op(heap, flag32, u32{2}, SignalOp::kSet, peer);
  const Token token = wait_block(flag, 1, u64{1});
  dst[0] = consume_token(src, token)[0];
  signal_wait_until<Scope::kGpu>(flag32, Cmp::kNe, u32{0});
  barrier_all_block(heap, pad);
  barrier_all_grid(heap, pad);
  quiet();
}
