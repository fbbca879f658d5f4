// Low-latency expert-parallel all-to-all (MoE dispatch and combine for decode batches), over NVLink.
//
// Notation: W ranks, E experts, L = E / W local experts (expert g lives on rank g / L as local
// expert g % L), K top-k slots, T <= M tokens on this rank (M = max_tokens), H hidden channels,
// G = ceil(H / 128) FP8 scale groups. Row (t, j) is token t sent to its j-th expert topk_idx[t][j].
//
// Symmetric buffers (per rank; layout in src/ops/ep.cpp, EpLlLayout, the one place it is sized):
//   d_rows   char[2][L][W][M][2H]  parity x local expert x source rank x slot: the received row
//                                  (bf16, or H bytes of e4m3 at the start of the row)
//   d_scales f32[2][L][W][M][G]    the row's scales (FP8 only): channel c = q[c] * scale[c / 128]
//   d_route  i32[2][L][W][M]       t * K + j of the row on its source rank
//   d_count  u64[2][L][W]          (epoch << 32) | rows, raised by the source once its rows landed
//   d_ack    u64[E]                d_ack[g] = the last dispatch epoch whose rows of expert g the
//                                  owner of g has consumed (written by that owner)
//   c_rows   char[2][M][K][2H]     combine: expert output (bf16) of this rank's row (t, j)
//   c_flags  u64[2][M][K]          = combine epoch once row (t, j) has landed
//   c_ack    u64[W]                c_ack[r] = the last combine epoch whose rows rank r has consumed
// Parity = epoch & 1. A sender writes parity p at call e only after the receiver acknowledged call
// e - 2 (the previous user of p), so calls may run back to back without host synchronisation.
//
// Epochs (CUDA-graph safety): EpState.dispatch_epoch / combine_epoch count the calls in device
// memory; a call uses e = count + 1 and the last block of its sending part (of the whole grid in the
// one-kernel combine) stores e back. The send kernel also stores e into the call's epoch slot, from
// which the receive kernel (the hook) reads it, so a graph replays with fresh epochs and two
// dispatches may be in flight (two slots).
//
// Dispatch: send (a block per token: lane j of warp 0 claims slot j's row with a local atomic per
// expert, then the block's warps read the token once in 16-byte pieces, convert them to e4m3 when
// asked, and store each piece into every destination row); its last block raises the count flags.
// Receive (a block per local expert, a batch of them at once) waits for its W count flags, packs the rows source after
// source into the expert-major output recv_x[L][W * M][...], counts them in recv_count[L], and
// acknowledges. Combine: send (a warp per received row) writes the expert output row back into its
// source's c_rows[(t, j)] and raises that row's flag; receive (a block per token) waits for its
// rows' flags and sums w[t][j] * row in fp32; its last block acknowledges to every rank. Without a
// receive hook, both parts of a call run in one kernel (ep_ll_dispatch, ep_ll_combine; see there),
// and that combine reads the rows of this rank's own experts straight from y (own_row) instead of
// sending them to itself.
//
// Invalid top-k entries: -1 is a masked slot (skipped). An id outside [-1, E) or a repeat of an
// earlier slot's expert in the same token is skipped by dispatch and combine alike (so no wait can
// hang on it) and reported through the error word (EpError), which the host reads.
#pragma once

#include "tdist/kernels/ep/common.cuh"

namespace tdist::kernels::ep {

using tdist::device::u32;
using tdist::device::u64;

constexpr int kLlThreads = 512;
constexpr int kLlWarps = kLlThreads / 32;

struct EpLlParams {
  tdist::device::SymmetricHeapView heap;
  int num_tokens, max_tokens, hidden, num_experts, num_local_experts, topk;
  int fp8, ue8m0;
  // caller's operands
  const void* x;                  // bf16 [T][H] (dispatch)
  const long long* topk_idx;      // i64 [T][K]
  const float* topk_weights;      // f32 [T][K] (combine)
  const void* y;                  // bf16 [L][W * M][H] expert outputs (combine)
  void* out;                      // bf16 [T][H] combined (combine)
  // symmetric (this rank's addresses)
  char* d_rows;
  float* d_scales;
  int* d_route;
  u64* d_count;
  u64* d_ack;
  char* c_rows;
  u64* c_flags;
  u64* c_ack;
  // local device memory
  EpState* state;
  u32* send_counts;  // [E], zero between calls
  u64* epoch_slot;   // this call's slot
  int* error;        // [4]
  // dispatch outputs (local): recv_x [L][W * M][H] (bf16, or e4m3 bytes), recv_scales [L][W * M][G],
  // recv_route [L][W * M] = (src * M + t) * K + j, recv_count [L]
  char* recv_x;
  float* recv_scales;
  int* recv_route;
  int* recv_count;
  // own_row [M][K] (local): for a slot (t, j) whose expert lives on this rank, the row of that
  // expert's recv_x (and y) holding it; written by the dispatch, read by the one-kernel combine
  int* own_row;
};

TDIST_HOST_DEVICE int scale_groups(int hidden) { return (hidden + kFp8GroupSize - 1) / kFp8GroupSize; }

}  // namespace tdist::kernels::ep

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp8.h>


namespace tdist::kernels::ep {

// Lane j < K: the expert of slot j if it is to be sent, else -1 (warp-wide; ep/common.cuh's rule).
TDIST_DEVICE int slot_expert(const EpLlParams& p, int t, int lane, bool report) {
  return warp_slot_expert(p.topk_idx, p.topk, p.num_experts, t, lane, report ? p.error : nullptr);
}

// The largest of v over each aligned group of 8 lanes.
TDIST_DEVICE float warp_max8(float v) {
#pragma unroll
  for (int m = 4; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// The scale of a group whose largest magnitude is `amax`; UE8M0: the next power of two up.
TDIST_DEVICE float fp8_scale(float amax, bool ue8m0) {
  float s = amax > 0.f ? amax / kFp8Max : 1.f;
  if (ue8m0) s = exp2f(ceilf(log2f(s)));
  return s;
}

// Dispatch, sending part (every block of the grid, each a share of the tokens; returns once the
// block's rows are stored, unfenced: last_block fences them).
TDIST_DEVICE void ll_dispatch_store_rows(const EpLlParams& p, u64 e) {
  const u64 par = e & 1;
  const int W = p.heap.num_ranks, me = p.heap.rank, L = p.num_local_experts, M = p.max_tokens, H = p.hidden;
  const int K = p.topk, G = scale_groups(H);
  const u64 row_stride = 2ull * H;
  // A block per token (grid-stride): warp 0 claims the rows while every warp loads its first piece of
  // the token, then every warp stores its pieces into every destination row, 16 bytes per lane: a
  // piece is 256 channels in bf16 and 512 in FP8 (16 channels, two loads, one e4m3 store per lane).
  // A piece holds whole FP8 scale groups, so the warps need not meet again.
  __shared__ char* dst_rows[kMaxTopk];
  __shared__ float* dst_scales[kMaxTopk];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int piece = p.fp8 ? 512 : 256, per_lane = piece / 32;
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x);
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const __nv_bfloat16* src = x + static_cast<u64>(t) * H;
    int c0 = warp * piece;  // warp-uniform
    uint4 v0 = make_uint4(0, 0, 0, 0), v1 = make_uint4(0, 0, 0, 0);
    if (c0 + lane * per_lane < H) {
      v0 = *reinterpret_cast<const uint4*>(src + c0 + lane * per_lane);
      if (p.fp8) v1 = *reinterpret_cast<const uint4*>(src + c0 + lane * per_lane + 8);
    }
    if (warp == 0) {
      const int g = slot_expert(p, t, lane, true);
      char* dst = nullptr;
      float* dst_s = nullptr;
      if (g >= 0) {
        const int r = g / L, le = g % L;
        // The claim is local and needs no acknowledgement: issued first, its latency overlaps the wait.
        const u32 slot = atomicAdd(p.send_counts + g, 1u);  // < M: one row per token and expert
        if (e > 2) wait_epoch(p.d_ack + g, e - 2);  // parity `par` of expert g is free again
        if (r == me) {
          // This rank's own rows go straight into the packed output, first among the expert's rows
          // (the receive copies only the peers' rows, after them).
          const u64 row = le * static_cast<u64>(W) * M + slot;
          dst = p.recv_x + row * (p.fp8 ? static_cast<u64>(H) : row_stride);
          if (p.fp8) dst_s = p.recv_scales + row * G;
          p.recv_route[row] = (me * M + t) * K + lane;
          p.own_row[t * K + lane] = static_cast<int>(slot);
        } else {
          const u64 row = ((par * L + le) * W + me) * static_cast<u64>(M) + slot;
          dst = peer_ptr(p.heap, p.d_rows + row * row_stride, r);
          if (p.fp8) dst_s = peer_ptr(p.heap, p.d_scales + row * G, r);
          *peer_ptr(p.heap, p.d_route + row, r) = t * K + lane;
        }
      }
      if (lane < K) {
        dst_rows[lane] = dst;
        dst_scales[lane] = dst_s;
      }
    }
    __syncthreads();
    for (; c0 < H; c0 += kLlWarps * piece) {
      const int c = c0 + lane * per_lane;  // this lane's channels
      const bool active = c < H;
      if (c0 != warp * piece && active) {
        v0 = *reinterpret_cast<const uint4*>(src + c);
        if (p.fp8) v1 = *reinterpret_cast<const uint4*>(src + c + 8);
      }
      if (!p.fp8) {
        for (int k = 0; k < K; ++k) {
          char* d = dst_rows[k];
          if (d != nullptr && active) *reinterpret_cast<uint4*>(d + 2ull * c) = v0;
        }
      } else {
        float f[16], amax = 0.f;
        const __nv_bfloat16* h0 = reinterpret_cast<const __nv_bfloat16*>(&v0);
        const __nv_bfloat16* h1 = reinterpret_cast<const __nv_bfloat16*>(&v1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          f[i] = __bfloat162float(h0[i]);
          f[8 + i] = __bfloat162float(h1[i]);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
        amax = warp_max8(amax);  // each 8 lanes cover one group of 128 channels
        const float scale = fp8_scale(amax, p.ue8m0 != 0), inv = 1.f / scale;
        uint4 q;
        unsigned short* qs = reinterpret_cast<unsigned short*>(&q);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          qs[i] = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * i] * inv, f[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
        for (int k = 0; k < K; ++k) {
          char* d = dst_rows[k];
          if (d != nullptr && active) {
            *reinterpret_cast<uint4*>(d + c) = q;
            if ((lane & 7) == 0) dst_scales[k][c / kFp8GroupSize] = scale;
          }
        }
      }
    }
    __syncthreads();  // the next token's rows replace dst_rows
  }
}

// Dispatch, the last block of the sending part (after last_block: every row of this call has been
// stored and fenced): raises the count flag of every (expert, this rank), then stores the epoch.
TDIST_DEVICE void ll_dispatch_raise_counts(const EpLlParams& p, u64 e) {
  const u64 par = e & 1;
  const int W = p.heap.num_ranks, me = p.heap.rank, L = p.num_local_experts;
  for (int g = threadIdx.x; g < p.num_experts; g += blockDim.x) {
    const int r = g / L, le = g % L;
    const u32 n = ld_relaxed<Scope::kGpu>(p.send_counts + g);
    if (e > 2) wait_epoch(p.d_ack + g, e - 2);
    put_signal(p.heap, p.d_count + (par * L + le) * W + me, (e << 32) | n, r);
    p.send_counts[g] = 0;
  }
  if (threadIdx.x == 0) {
    p.state->dispatch_done = 0;
    st_relaxed<Scope::kGpu>(&p.state->dispatch_epoch, e);
  }
}

// Dispatch, receiving part: a block takes local experts blockIdx.x, blockIdx.x + gridDim.x, ...,
// up to kLlPackBatch of them at once (when there are more local experts than blocks): it waits for
// their W count flags each, copies the peers' rows after this rank's own (which the send stored in
// place), source after source, then acknowledges to every source.
// A batch pays one flag wait, one copy latency and one acknowledgement fence for all its experts.
constexpr int kLlPackBatch = 8;
// 16-byte loads a lane has in flight in the pack: 14 covers a 7168-channel FP8 row in one pass per
// warp (a bf16 one in two); 16 spills registers in the kernels as they stand.
constexpr int kLlPackUnroll = 14;

TDIST_DEVICE void ll_dispatch_pack(const EpLlParams& p, u64 e) {
  // offsets[b][o]: the first packed row of source (me + o) % W in the batch's expert b (o = W: its
  // row count; offsets[b][1]: this rank's own rows, already in place); batch_begin[b]: the first of
  // expert b's peer rows in the batch's peer rows (b = nb: their count).
  __shared__ int offsets[kLlPackBatch][kMaxLsaRanks + 1];
  __shared__ int batch_begin[kLlPackBatch + 1];
  const u64 par = e & 1;
  const int W = p.heap.num_ranks, me = p.heap.rank, L = p.num_local_experts, M = p.max_tokens, H = p.hidden;
  const int K = p.topk, G = scale_groups(H);
  const u64 row_stride = 2ull * H, rows_per_expert = static_cast<u64>(W) * M;
  const u64 row_bytes = p.fp8 ? static_cast<u64>(H) : 2ull * H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int grid = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);
  const int mine = block < L ? (L - 1 - block) / grid + 1 : 0;  // this block's experts
  const int batch = max(1, min(kLlPackBatch, kLlThreads / W));  // b * W + o < kLlThreads
  for (int k0 = 0; k0 < mine; k0 += batch) {
    const int nb = min(batch, mine - k0);
    auto expert = [&](int b) { return block + (k0 + b) * grid; };
    // Thread b * W + o waits for the count of expert b from source (me + o) % W: the packed order is
    // this rank's rows (stored there by the send), then the peers' in rank order after this one.
    const int tb = static_cast<int>(threadIdx.x) / W, ts = static_cast<int>(threadIdx.x) % W;
    if (tb < nb) {
      const u64* flag = p.d_count + (par * L + expert(tb)) * W + (me + ts) % W;
      offsets[tb][ts + 1] = static_cast<int>(wait_count_flag(flag, e));
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < nb) {
      int* o = offsets[threadIdx.x];
      o[0] = 0;
      for (int s = 0; s < W; ++s) o[s + 1] += o[s];
      p.recv_count[expert(threadIdx.x)] = o[W];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      batch_begin[0] = 0;
      for (int b = 0; b < nb; ++b) batch_begin[b + 1] = batch_begin[b] + offsets[b][W] - offsets[b][1];
    }
    __syncthreads();
    const int total = batch_begin[nb];  // the peers' rows of the batch
    for (int q = warp; q < total; q += kLlWarps) {
      int b = 0;
      while (batch_begin[b + 1] <= q) ++b;
      const int le = expert(b), i = offsets[b][1] + (q - batch_begin[b]);  // packed row
      int o = 1;
      while (offsets[b][o + 1] <= i) ++o;
      const int s = (me + o) % W;
      const u64 src_row = ((par * L + le) * W + s) * static_cast<u64>(M) + (i - offsets[b][o]);
      const u64 dst_row = le * rows_per_expert + i;
      const uint4* from = reinterpret_cast<const uint4*>(p.d_rows + src_row * row_stride);
      uint4* to = reinterpret_cast<uint4*>(p.recv_x + dst_row * row_bytes);  // packed rows
      warp_copy16<kLlPackUnroll>(to, from, static_cast<long long>(row_bytes / 16), lane);
      if (row_bytes % 16 != 0 && lane == 0) {  // FP8 rows of H = 8 (mod 16) bytes
        reinterpret_cast<uint2*>(to)[row_bytes / 8 - 1] = reinterpret_cast<const uint2*>(from)[row_bytes / 8 - 1];
      }
      if (p.fp8)
        for (int g = lane; g < G; g += 32) p.recv_scales[dst_row * G + g] = p.d_scales[src_row * G + g];
      if (lane == 0) p.recv_route[dst_row] = (s * M) * K + p.d_route[src_row];
    }
    __syncthreads();  // every read of the batch's parity-`par` rows is done (and offsets may be rewritten)
    if (tb < nb) put_signal(p.heap, p.d_ack + (me * L + expert(tb)), e, ts);
  }
}

constexpr int kLlScanExperts = 2 * kLlThreads;  // local experts whose row counts a block scans at once

// A warp per received row: the expert output goes back to its source's c_rows[(t, j)]. Every block
// scans the local experts' row counts in shared memory, and the grid's warps take the rows that
// exist, whichever expert they belong to (one hot expert's rows spread over every SM). Beyond
// kLlScanExperts local experts, blocks take experts (bpe blocks per expert when there are more blocks
// than experts) and their warps the experts' rows. kSkipOwn: rows whose source is this rank are left
// where they are (the one-kernel combine reads them from y).
template <bool kSkipOwn>
TDIST_DEVICE void ll_combine_send_rows(const EpLlParams& p, u64 e) {
  __shared__ int row_begin[kLlScanExperts + 1];
  __shared__ int warp_sums[kLlWarps];
  const u64 par = e & 1;
  const int W = p.heap.num_ranks, L = p.num_local_experts, M = p.max_tokens, H = p.hidden;
  const u64 rows_per_expert = static_cast<u64>(W) * M, row_bytes = 2ull * H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const u64 slots = static_cast<u64>(M) * p.topk;
  // Parity `par` of rank s's c_rows is free again once s acknowledged call e - 2 (every rank
  // acknowledges to every rank). Thread s < W waits once per block, while the block loads the counts,
  // not once per row after the row's route; a block barrier follows before any row is sent.
  auto wait_acks = [&] {
    if (e > 2 && static_cast<int>(threadIdx.x) < W) wait_epoch(p.c_ack + threadIdx.x, e - 2);
  };
  auto send_row = [&](int le, int i) {
    const u64 f = le * rows_per_expert + i;
    const int route = p.recv_route[f];
    const int s = static_cast<int>(route / slots);
    if (kSkipOwn && s == p.heap.rank) return;  // warp-uniform
    const u64 tk = route % slots;
    const uint4* from = reinterpret_cast<const uint4*>(static_cast<const char*>(p.y) + f * row_bytes);
    uint4* to = peer_ptr(p.heap, reinterpret_cast<uint4*>(p.c_rows + (par * slots + tk) * row_bytes), s);
    warp_copy16<16>(to, from, static_cast<long long>(row_bytes / 16), lane);
    __syncwarp();
    if (lane == 0) put_signal(p.heap, p.c_flags + par * slots + tk, e, s);
  };
  if (L <= kLlScanExperts) {
    // Exclusive prefix of the counts: thread i holds experts 2i and 2i + 1.
    const int x0 = 2 * static_cast<int>(threadIdx.x), x1 = x0 + 1;
    const int a = x0 < L ? p.recv_count[x0] : 0, b = x1 < L ? p.recv_count[x1] : 0;
    wait_acks();  // beside the count loads; the scan's barriers publish it
    int incl = a + b;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int ws = lane < kLlWarps ? warp_sums[lane] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, ws, d);
        if (lane >= d) ws += v;
      }
      if (lane < kLlWarps) warp_sums[lane] = ws;  // inclusive, over warps
    }
    __syncthreads();
    const int before = incl - (a + b) + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (x0 < L) row_begin[x0] = before;
    if (x1 < L) row_begin[x1] = before + a;
    if (threadIdx.x == 0) row_begin[L] = warp_sums[kLlWarps - 1];
    __syncthreads();
    const int total = row_begin[L];
    for (int q = blockIdx.x * kLlWarps + warp; q < total; q += gridDim.x * kLlWarps) {
      int lo = 0, hi = L - 1;  // the last expert whose first row is <= q: the one holding row q
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (row_begin[mid] <= q)
          lo = mid;
        else
          hi = mid - 1;
      }
      send_row(lo, q - row_begin[lo]);
    }
  } else {
    wait_acks();
    __syncthreads();
    const int bpe = max(1, static_cast<int>(gridDim.x) / L), groups = static_cast<int>(gridDim.x) / bpe;
    const int group = static_cast<int>(blockIdx.x) / bpe, part = static_cast<int>(blockIdx.x) % bpe;
    for (int le = group; group < groups && le < L; le += groups) {
      const int n = p.recv_count[le];
      for (int i = part * kLlWarps + warp; i < n; i += bpe * kLlWarps) send_row(le, i);
    }
  }
}

constexpr int kLlChunks = 2;  // 256-channel chunks a lane sums at once in the combine receive

// A block per token (grid-stride): warp 0 waits for the token's rows, then every warp sums its
// share of the 512-channel pieces: out[t] = sum over valid slots j of w[t][j] * c_rows[(t, j)], fp32.
// kOwnFromY: a slot whose expert lives on this rank is read straight from y (at own_row), without a
// copy or a flag; y is the caller's, so only the one-kernel combine does this (a hook may run after
// the caller has reused y).
template <bool kOwnFromY>
TDIST_DEVICE void ll_combine_sum(const EpLlParams& p, u64 e) {
  const u64 par = e & 1;
  const int M = p.max_tokens, H = p.hidden, K = p.topk, L = p.num_local_experts;
  const u64 slots = static_cast<u64>(M) * K, row_bytes = 2ull * H;
  const u64 rows_per_expert = static_cast<u64>(p.heap.num_ranks) * M;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  __shared__ unsigned valid_slots;
  __shared__ const char* slot_rows[kMaxTopk];
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    if (warp == 0) {
      const int g = slot_expert(p, t, lane, false);
      const u64 tk = static_cast<u64>(t) * K + lane;
      const char* row = nullptr;
      if (g >= 0 && kOwnFromY && g / L == p.heap.rank) {
        row = static_cast<const char*>(p.y) + ((g % L) * rows_per_expert + p.own_row[tk]) * row_bytes;
      } else if (g >= 0) {
        wait_epoch(p.c_flags + par * slots + tk, e);
        row = p.c_rows + (par * slots + tk) * row_bytes;
      }
      const unsigned valid = __ballot_sync(0xffffffffu, g >= 0);
      if (lane == 0) valid_slots = valid;
      if (lane < K) slot_rows[lane] = row;
    }
    __syncthreads();  // the rows the waits saw are visible to the whole block
    const unsigned valid = valid_slots;
    // Lane k: slot k's row and weight.
    const bool mine = (valid >> lane & 1u) != 0;
    const char* row = mine ? slot_rows[lane] : nullptr;
    const float wk = mine ? p.topk_weights[static_cast<u64>(t) * K + lane] : 0.f;
    char* out = static_cast<char*>(p.out) + static_cast<u64>(t) * row_bytes;
    for (int c0 = warp * 256 * kLlChunks + lane * 8; c0 - lane * 8 < H; c0 += kLlWarps * 256 * kLlChunks) {
      float acc[kLlChunks][8];
#pragma unroll
      for (int u = 0; u < kLlChunks; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
      warp_sum_rows<kLlChunks>(acc, row, wk, valid, c0, H);
      store_bf16_chunks<kLlChunks>(out, acc, c0, H);
    }
    __syncthreads();  // valid_slots and slot_rows are rewritten for the next token
  }
}

// Combine, the last block of the receiving part (after last_block): every rank's rows of this call
// have been read, so the parity is free for call e + 2.
TDIST_DEVICE void ll_combine_acknowledge(const EpLlParams& p, u64 e) {
  if (static_cast<int>(threadIdx.x) < p.heap.num_ranks)
    put_signal(p.heap, p.c_ack + p.heap.rank, e, static_cast<int>(threadIdx.x));
  if (threadIdx.x == 0) p.state->combine_done = 0;
}

// The kernels. Without a receive hook one kernel runs both parts of a call (ep_ll_dispatch,
// ep_ll_combine): a block that has sent its share goes on to receive, spinning on flags that other
// blocks of the same grid (and the peers) raise. That is safe only while every block of the grid is
// resident at once: the host launches at most one block per SM (kLlThreads threads, __launch_bounds__
// (kLlThreads, 1)), and the spins time out with a diagnostic. With a hook, the send kernel runs now
// and the receive kernel later (ep_ll_*_send, ep_ll_*_recv); the send stores its epoch in the call's
// slot, from which the receive reads it.

// This call's epoch (the calls of `completed` so far, plus one), kept in the call's slot for its
// receive kernel.
TDIST_DEVICE u64 ll_call_epoch(const EpLlParams& p, const u64* completed) {
  const u64 e = ld_relaxed<Scope::kGpu>(completed) + 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.epoch_slot = e;
  return e;
}

// The sending part of a dispatch: this block's rows stored, the counts raised by the last block.
TDIST_DEVICE u64 ll_dispatch_send(const EpLlParams& p) {
  const u64 e = ll_call_epoch(p, &p.state->dispatch_epoch);
  ll_dispatch_store_rows(p, e);
  if (last_block(&p.state->dispatch_done)) ll_dispatch_raise_counts(p, e);
  return e;
}

__global__ void __launch_bounds__(kLlThreads, 1) ep_ll_dispatch_send(EpLlParams p) {
  begin_kernel();
  ll_dispatch_send(p);
}

__global__ void __launch_bounds__(kLlThreads, 1) ep_ll_dispatch_recv(EpLlParams p) {
  begin_kernel();
  ll_dispatch_pack(p, *p.epoch_slot);
}

__global__ void __launch_bounds__(kLlThreads, 1) ep_ll_dispatch(EpLlParams p) {
  begin_kernel();
  ll_dispatch_pack(p, ll_dispatch_send(p));
}

__global__ void __launch_bounds__(kLlThreads, 1) ep_ll_combine_send(EpLlParams p) {
  begin_kernel();
  const u64 e = ll_call_epoch(p, &p.state->combine_epoch);
  ll_combine_send_rows<false>(p, e);
  if (!last_block(&p.state->combine_send_done)) return;
  if (threadIdx.x == 0) {
    p.state->combine_send_done = 0;
    st_relaxed<Scope::kGpu>(&p.state->combine_epoch, e);
  }
}

__global__ void __launch_bounds__(kLlThreads, 1) ep_ll_combine_recv(EpLlParams p) {
  begin_kernel();
  const u64 e = *p.epoch_slot;
  ll_combine_sum<false>(p, e);
  if (last_block(&p.state->combine_done)) ll_combine_acknowledge(p, e);
}

// Every block reads the epoch before any block can be the last one (last_block waits for all), so
// the last block may store it back.
__global__ void __launch_bounds__(kLlThreads, 1) ep_ll_combine(EpLlParams p) {
  begin_kernel();
  const u64 e = ll_call_epoch(p, &p.state->combine_epoch);
  ll_combine_send_rows<true>(p, e);
  ll_combine_sum<true>(p, e);
  if (!last_block(&p.state->combine_done)) return;
  ll_combine_acknowledge(p, e);
  if (threadIdx.x == 0) st_relaxed<Scope::kGpu>(&p.state->combine_epoch, e);
}

}  // namespace tdist::kernels::ep
#endif  // __CUDACC__
