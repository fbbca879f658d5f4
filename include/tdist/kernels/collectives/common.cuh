// Shared pieces of the collective kernels (all_gather.cuh, reduce_scatter.cuh, all_reduce.cuh, ll.cuh):
// the parameter block, the device-side epoch, per-block flag exchange between ranks, and fp32
// accumulation helpers. Compiles under NVRTC (no standard headers) and, for CollParams only, in
// host C++ (the host fills the struct).
//
// Epoch (CUDA-graph safety): EpochState lives in ordinary device memory of each rank. Every block of
// a collective kernel reads `epoch` at its start and uses e = epoch + 1 as this call's signal value;
// the last block to finish (counted in `arrived`) stores e back and resets the counter. A captured
// graph therefore replays with a fresh value each time, and since every rank makes the same sequence
// of calls, the ranks' epochs agree.
//
// Workspace (symmetric, per rank): two slots of `slot_bytes`; call e uses slot (e & 1). A rank only
// writes its own slot; peers read it after the rank's flag. Reuse is safe without a closing
// handshake: before a rank overwrites slot (e & 1) at call e + 2 it has completed call e + 1, which
// waited for a flag from every peer raised by the peer's call e + 1, and that call started after
// the peer's call e (the last reader of the slot) had finished.
//
// Flags (symmetric u64): flags[(phase * max_blocks + block) * num_ranks + src], raised by rank `src`
// on every peer with release semantics, value e. Blocks of the same index on every rank cover the
// same part of the data (the partition depends only on the count and the grid, which agree), so a
// block waits only for its own index's flags.
#pragma once

#include "tdist/device/common.cuh"
#include "tdist/device/symmetric.cuh"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tdist/device/barrier.cuh"
#include "tdist/device/copy.cuh"
#include "tdist/device/grid_dependency.cuh"
#include "tdist/device/memory_order.cuh"
#include "tdist/device/signal.cuh"
#endif

namespace tdist::kernels::coll {

using tdist::device::u32;
using tdist::device::u64;

// Flag phases per block.
constexpr int kPhases = 2;
// Threads per block of every collective kernel (>= the largest LSA team, kMaxLsaRanks).
constexpr int kThreads = 512;

struct EpochState {
  u64 epoch;    // calls completed by this rank
  u32 arrived;  // blocks of the running call that have finished
  u32 pad;
};

struct CollParams {
  tdist::device::SymmetricHeapView heap;
  void* out;          // local output (ordinary or symmetric memory)
  const void* in;     // local input; symmetric when zero_copy
  char* ws;           // workspace base (this rank's address; 2 slots)
  u64 slot_bytes;     // stride between the two slots
  u64 count;          // elements: see each kernel
  u64* flags;         // symmetric flag array
  u64 max_blocks;     // flag array's block dimension
  EpochState* epoch;  // this rank's epoch (ordinary device memory)
  char* ll;           // low-latency buffer base (symmetric; 2 parities x num_ranks x ll_words u64)
  u64 ll_words;       // 8-byte LL lines per (parity, source rank)
  char* ll128;        // LL128 buffer base (symmetric; 2 parities x num_ranks x ll128_lines x 128 B)
  u64 ll128_lines;    // 128-byte LL128 lines per (parity, source rank)
  int zero_copy;      // `in` is the caller's symmetric buffer: peers read it directly
  int vec;            // all pointers and per-rank strides are 16-byte aligned
};

// Slice length of the two-shot AllReduce split: ceil(count / n) rounded up to 8 elements.
TDIST_HOST_DEVICE u64 two_shot_slice(u64 count, int n) {
  const u64 s = (count + n - 1) / n;
  return (s + 7) / 8 * 8;
}

}  // namespace tdist::kernels::coll

#if defined(__CUDACC__)
namespace tdist::kernels::coll {

using namespace tdist::device;

// Converting element types to and from the fp32 accumulator.
TDIST_DEVICE float to_f32(float v) { return v; }
TDIST_DEVICE float to_f32(__half v) { return __half2float(v); }
TDIST_DEVICE float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
TDIST_DEVICE T from_f32(float v);
template <>
TDIST_DEVICE float from_f32<float>(float v) {
  return v;
}
template <>
TDIST_DEVICE __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <>
TDIST_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

TDIST_DEVICE u32 thread_index() { return threadIdx.x; }

// This call's signal value; every block reads it before any block can finish the call. The host
// may launch a collective kernel early (programmatic launch, CollectivesOptions::
// programmatic_launch): it first waits for the kernel before it on the stream, whose inputs, epoch
// and buffers this call uses, then lets the next kernel be scheduled (its blocks wait in turn).
TDIST_DEVICE u64 begin_call(const EpochState* state) {
  wait_for_prior_grid();
  allow_dependent_launch();
  return ld_relaxed<Scope::kGpu>(&state->epoch) + 1;
}

// The last block to finish publishes the epoch for the next call on this rank.
TDIST_DEVICE void end_call(EpochState* state, u64 e) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 blocks = gridDim.x * gridDim.y * gridDim.z;
    const u32 before = atomic_add<Scope::kGpu>(&state->arrived, 1u);
    if (before == blocks - 1) {
      st_relaxed<Scope::kGpu>(&state->arrived, 0u);
      st_relaxed<Scope::kGpu>(&state->epoch, e);
    }
  }
}

TDIST_DEVICE u64* flag_slot(const CollParams& p, int phase, u64 block, int src) {
  return p.flags + (static_cast<u64>(phase) * p.max_blocks + block) * p.heap.num_ranks + src;
}

// Block-level exchange with the same block index on every peer: everything the block wrote before
// is visible to the peers' blocks after their exchange of the same phase, and vice versa.
TDIST_DEVICE void exchange(const CollParams& p, int phase, u64 e) {
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 b = blockIdx.x;
  __syncthreads();  // the block's writes precede the releases (bar.sync, then release: cumulative)
  const int t = static_cast<int>(threadIdx.x);
  if (t < n && t != me) notify<Scope::kSystem>(p.heap.symm_at(flag_slot(p, phase, b, me), t), e);
  if (t < n && t != me) signal_wait_until<Scope::kSystem>(flag_slot(p, phase, b, t), Cmp::kGe, e);
  __syncthreads();
}

// Workspace slot of call e.
TDIST_DEVICE char* slot_of(const CollParams& p, u64 e) { return p.ws + (e & 1) * p.slot_bytes; }

// [lo, hi) of `block` when `len` units are split over `blocks` in pieces of a multiple of `align`.
TDIST_DEVICE void block_range(u64 len, u64 block, u64 blocks, u64 align, u64& lo, u64& hi) {
  u64 piece = (len + blocks - 1) / blocks;
  piece = (piece + align - 1) / align * align;
  lo = block * piece;
  hi = lo + piece;
  if (lo > len) lo = len;
  if (hi > len) hi = len;
}

// Scalar part of reduce_range: out[i] for i in [lo, hi).
template <typename T>
TDIST_DEVICE void reduce_scalar(T* out, const char* const* srcs, int n, u64 lo, u64 hi) {
  for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < n; ++r) acc += to_f32(reinterpret_cast<const T*>(srcs[r])[i]);
    out[i] = from_f32<T>(acc);
  }
}

// out[i] = sum over r of srcs[r][i], i in [lo, hi) elements, accumulated in fp32 in rank order (so
// every rank computes bit-identical sums). Touches no element outside [lo, hi): callers run it on
// disjoint ranges concurrently (other blocks, other ranks' slices), and an empty range is a no-op.
// `vec`: out and every srcs[r] are 16-byte aligned at element 0; the 16-byte vectors cover the
// aligned middle of [lo, hi) and scalar loops the unaligned head and tail (lo need not be a
// multiple of the vector width: ranges clipped to the element count are not).
template <typename T>
TDIST_DEVICE void reduce_range(T* out, const char* const* srcs, int n, u64 lo, u64 hi, bool vec) {
  constexpr int kV = 16 / sizeof(T);
  constexpr int kBatch = 8;
  if (lo >= hi) return;
  if (vec) {
    const u64 vlo = (lo + kV - 1) / kV, vhi = hi / kV;
    if (vlo < vhi) {
      reduce_scalar<T>(out, srcs, n, lo, vlo * kV);
      for (u64 v = vlo + threadIdx.x; v < vhi; v += blockDim.x) {
        float acc[kV];
#pragma unroll
        for (int k = 0; k < kV; ++k) acc[k] = 0.f;
        for (int r0 = 0; r0 < n; r0 += kBatch) {
          uint4 x[kBatch];
#pragma unroll
          for (int k = 0; k < kBatch; ++k)
            if (r0 + k < n) x[k] = reinterpret_cast<const uint4*>(srcs[r0 + k])[v];
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            if (r0 + k < n) {
              const T* e = reinterpret_cast<const T*>(&x[k]);
#pragma unroll
              for (int j = 0; j < kV; ++j) acc[j] += to_f32(e[j]);
            }
          }
        }
        uint4 y;
        T* ye = reinterpret_cast<T*>(&y);
#pragma unroll
        for (int j = 0; j < kV; ++j) ye[j] = from_f32<T>(acc[j]);
        reinterpret_cast<uint4*>(out)[v] = y;
      }
      lo = vhi * kV;
    }
  }
  reduce_scalar<T>(out, srcs, n, lo, hi);
}

// srcs[r] = where rank r's data is read: this rank's `in`, a peer's `in` when zero copy
// (symmetric), else the peer's workspace slot. Block-wide, ends with __syncthreads.
TDIST_DEVICE void gather_sources(const CollParams& p, const char* in, const char* slot, const char** srcs) {
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const char* shared_src = p.zero_copy ? in : slot;
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    srcs[r] = r == me ? in : static_cast<const char*>(p.heap.symm_at(shared_src, r));
  __syncthreads();
}

// Copies [lo, hi) bytes, shared by the block (no sync).
TDIST_DEVICE void block_copy(void* dst, const void* src, u64 bytes) {
  if (bytes == 0 || dst == src) return;
  tdist::device::detail::group_copy<BlockGroup>(dst, src, bytes);
}

}  // namespace tdist::kernels::coll

#endif  // __CUDACC__
