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
  u32 ht_layout_done;     // blocks of the running HT layout step that have finished
};

}  // namespace tdist::kernels::ep

#if defined(__CUDACC__)
#include <cuda_bf16.h>

#include "tdist/device/grid_dependency.cuh"
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
// warp_slot_expert_of takes lane j's id already loaded (-1 on lanes >= K), so a caller can issue the
// loads of several tokens before it needs the first.
TDIST_DEVICE int warp_slot_expert_of(long long g, int K, int E, int t, int lane, int* error) {
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

TDIST_DEVICE long long load_slot_id(const long long* topk_idx, int K, int t, int lane) {
  return lane < K ? topk_idx[static_cast<long long>(t) * K + lane] : -1;
}

TDIST_DEVICE int warp_slot_expert(const long long* topk_idx, int K, int E, int t, int lane, int* error) {
  return warp_slot_expert_of(load_slot_id(topk_idx, K, t, lane), K, E, t, lane, error);
}

// Row copies. A warp that copies a row 16 bytes per lane and waits for each load before its store
// pays one memory latency (about a microsecond from HBM or a peer) per 512 bytes: 28 latencies for
// a 14 KB row. These issue kUnroll loads per lane before the first store, so a row costs
// n / (32 kUnroll) latencies.

// Copies n 16-byte words from `from` to `to` (every lane of the warp calls it).
template <int kUnroll = 8>
TDIST_DEVICE void warp_copy16(uint4* to, const uint4* from, long long n, int lane) {
  for (long long base = lane; base < n; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) v[u] = from[base + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) to[base + 32 * u] = v[u];
  }
}

// Copies n 16-byte words from `from` to several rows: lane k of `dests_a` (a warp-uniform lane mask)
// holds a destination in `to_a`, lane k of `dests_b` one in `to_b` (two sets, as a lane may have two
// rows to fill). The source is read once, whatever the number of destinations.
template <int kUnroll = 4>
TDIST_DEVICE void warp_copy16_multi(void* to_a, unsigned dests_a, void* to_b, unsigned dests_b, const uint4* from,
                                    long long n, int lane) {
  if ((dests_a | dests_b) == 0) return;
  for (long long base = lane; base - lane < n; base += 32 * kUnroll) {  // warp-uniform bound (shuffles)
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) v[u] = from[base + 32 * u];
#pragma unroll
    for (int set = 0; set < 2; ++set) {
      const unsigned long long mine = reinterpret_cast<unsigned long long>(set == 0 ? to_a : to_b);
      for (unsigned m = set == 0 ? dests_a : dests_b; m != 0; m &= m - 1) {
        uint4* to = reinterpret_cast<uint4*>(__shfl_sync(0xffffffffu, mine, __ffs(m) - 1));
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + 32 * u < n) to[base + 32 * u] = v[u];
      }
    }
  }
}

template <int kUnroll = 4>
TDIST_DEVICE void warp_copy16_multi(void* to_of_lane, unsigned dests, const uint4* from, long long n, int lane) {
  warp_copy16_multi<kUnroll>(to_of_lane, dests, nullptr, 0u, from, n, lane);
}

// acc[u][i] += sum over the lanes k of `rows` (a warp-uniform lane mask) of w_k * row_k[c0 + 256 u + i]
// for i < 8 and the kChunks chunks below H, in order of k (so the sum is the plain serial one); lane
// k holds row_k (bf16, 16-byte aligned) in `row_of_lane` and w_k in `w_of_lane`. The loads of four
// rows and kChunks chunks are in flight at once.
template <int kChunks>
TDIST_DEVICE void warp_sum_rows(float (&acc)[kChunks][8], const void* row_of_lane, float w_of_lane, unsigned rows,
                                int c0, int H) {
  constexpr int kBatch = 4;
  for (unsigned m = rows; m != 0;) {  // warp-uniform
    const char* row[kBatch];
    float w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int k = m != 0 ? __ffs(m) - 1 : 0;
      const unsigned long long r = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row_of_lane), k);
      const float wk = __shfl_sync(0xffffffffu, w_of_lane, k);
      row[b] = m != 0 ? reinterpret_cast<const char*>(r) : nullptr;
      w[b] = m != 0 ? wk : 0.f;
      m &= m - 1;
    }
    uint4 v[kBatch][kChunks];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
        const int c = c0 + 256 * u;
        v[b][u] = make_uint4(0, 0, 0, 0);
        if (row[b] != nullptr && c < H) v[b][u] = *reinterpret_cast<const uint4*>(row[b] + 2ll * c);
      }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[b][u]);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] += w[b] * __bfloat162float(h[i]);
      }
  }
}

// Stores acc[u] as 8 bf16 at out + c0 + 256 u (16-byte stores), for the chunks below H.
template <int kChunks>
TDIST_DEVICE void store_bf16_chunks(void* out, const float (&acc)[kChunks][8], int c0, int H) {
#pragma unroll
  for (int u = 0; u < kChunks; ++u) {
    const int c = c0 + 256 * u;
    if (c >= H) continue;
    uint4 r;
    __nv_bfloat16* rh = reinterpret_cast<__nv_bfloat16*>(&r);
#pragma unroll
    for (int i = 0; i < 8; ++i) rh[i] = __float2bfloat16_rn(acc[u][i]);
    *reinterpret_cast<uint4*>(static_cast<char*>(out) + 2ll * c) = r;
  }
}

// First call of every EP kernel. The kernels are launched with programmatic dependent launch, so
// one may be scheduled while the kernel before it on the stream still runs (its launch latency hidden
// behind that kernel's tail): it waits here for that grid to complete and its writes to be visible,
// before touching anything (EpState, the flags, the caller's operands), then lets the next kernel be
// scheduled the same way.
TDIST_DEVICE void begin_kernel() {
  wait_for_prior_grid();
  allow_dependent_launch();
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
