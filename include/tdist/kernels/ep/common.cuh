// Pieces shared by the expert-parallel kernels (ll.cuh, ht.cuh): limits, the per-rank state with
// the call counts (epochs), the device error word, the rule that decides which top-k slots are
// sent, and the last-block detection. The host part (constants, EpState) also compiles in host C++.
#pragma once

#include "tdist/device/common.cuh"
#include "tdist/device/symmetric.cuh"

namespace tdist::kernels::ep {

using tdist::device::u32;
using tdist::device::u64;

constexpr int kMaxTopk = 32;        // one lane per top-k slot
constexpr int kFp8GroupSize = 128;  // channels per FP8 scale
constexpr float kFp8Max = 448.0f;   // largest finite e4m3

// Device error word (int[4], first error wins): code, token, slot, value.
enum EpErrorCode : int { kEpOk = 0, kEpExpertOutOfRange = 1, kEpDuplicateExpert = 2 };

// Per rank, ordinary device memory, zeroed at creation and never reset by the host.
struct EpState {
  u64 dispatch_epoch;     // low-latency dispatch calls completed on this rank
  u64 combine_epoch;      // low-latency combine calls completed
  u32 dispatch_done;      // blocks of the running LL dispatch send that have finished
  u32 combine_done;       // blocks of the running LL combine receive that have finished
  u32 combine_send_done;  // blocks of the running LL combine send that have finished
  u32 ht_dispatch_done;   // blocks of the running HT dispatch that have finished
  u64 ht_epoch;           // high-throughput dispatch calls (the layout step stores it first)
  u64 ht_combine_epoch;   // high-throughput combine calls
  u32 ht_combine_done;    // blocks of the running HT combine send that have finished
  u32 pad;
};

}  // namespace tdist::kernels::ep

#if defined(__CUDACC__)
#include "tdist/kernels/ep/transport.cuh"

namespace tdist::kernels::ep {

TDIST_DEVICE void report_error(int* error, int code, int token, int slot, long long value) {
  if (atomicCAS(error, 0, code) == 0) {
    error[1] = token;
    error[2] = slot;
    error[3] = static_cast<int>(value);
  }
}

// Lane j < K: the expert of token t's slot j if that slot is sent, else -1. A slot is sent when its
// id is in [0, E) and no earlier slot of the token holds the same id; -1 is a masked slot. Other
// ids are errors (reported to `error` when given). Every lane of the warp calls it; dispatch and
// combine apply the same rule, so they agree on which rows exist.
TDIST_DEVICE int warp_slot_expert(const long long* topk_idx, int K, int E, int t, int lane, int* error) {
  long long g = -1;
  if (lane < K) g = topk_idx[static_cast<long long>(t) * K + lane];
  if (!(g >= -1 && g < E)) {
    if (error) report_error(error, kEpExpertOutOfRange, t, lane, g);
    g = -1;
  }
  int e = static_cast<int>(g);
  bool repeated = false;
  for (int k = 0; k < K; ++k) {
    const int other = __shfl_sync(0xffffffffu, e, k);
    if (k < lane && e >= 0 && other == e) repeated = true;
  }
  if (repeated) {
    if (error) report_error(error, kEpDuplicateExpert, t, lane, g);
    e = -1;
  }
  return e;
}

// The last block of a grid to call it (every thread of every block calls it) gets true, after
// every other block's earlier writes (to this GPU or, through the system fence, to peers).
TDIST_DEVICE bool last_block(u32* done) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    fence<Scope::kSystem>();
    const u32 before = atomic_add<Scope::kGpu>(done, 1u);
    is_last = before == gridDim.x - 1;
    if (is_last) fence<Scope::kSystem>();
  }
  __syncthreads();
  return is_last != 0;
}

}  // namespace tdist::kernels::ep
#endif  // __CUDACC__
