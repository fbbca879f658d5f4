// High-throughput expert-parallel all-to-all (MoE dispatch and combine for prefill and training
// batches), over NVLink: each token crosses to a rank once, whatever the number of its experts
// there, and the combine reduces on the expert side before sending one row per token and rank back.
//
// Notation as in ll.cuh: W ranks, E experts, L = E / W local experts, K top-k slots, T <= M tokens
// per rank, H hidden channels; A = the expert-major alignment (rows per expert padded to it).
// Compact row: one received token; expert-major row: one (token, local expert) pair.
//
// Symmetric buffers (per rank; layout in src/ops/ep.cpp, EpHtLayout):
//   counts   u64[2][W][W + E]  counts[par][s] = rank s's row: tokens it sends to each rank, then rows
//                              it sends to each expert; (epoch << 32) | count, written by s
//   recv_x   bf16[W M][H]      compact rows, source after source (source s's rows start at the sum of
//                              the earlier sources' counts to this rank), in any order within a source
//   recv_src i32[W M]          s * M + t of each compact row
//   recv_idx i32[W M][K]       local expert of each slot, -1 when the slot's expert lives elsewhere
//   recv_w   f32[W M][K]       the slot's weight
//   recv_pos i32[W M][K]       the expert-major row of each local slot, -1 elsewhere
//   done     u64[W]            done[s] = the dispatch epoch whose compact rows from s have all landed
//   comb     bf16[W][M][H]     combine: rank r's partial sum for this rank's token t at [r][t]
//   c_ready  u64[W]            c_ready[r] = the combine epoch rank r has begun (its previous combine
//                              has read comb, so peers may write it again)
//   c_done   u64[W]            c_done[r] = the combine epoch whose partial rows from r have landed
// Local: send_base i32[W] (this rank's first compact row on each rank), exp_base i32[E] (its first
// expert-major row of each expert, at the expert's rank), rank_ctr u32[W], exp_ctr u32[E] (zero
// between calls: the layout step's blocks add their counts there, its last block reads and clears
// them, then they count the slots claimed in the running dispatch, whose last block clears them), info i32[2 + 2L + 1]: rows received, expert-major rows (padded),
// rows of each local expert, first expert-major row of each local expert and the end;
// expert_x bf16[cap][H] and expert_src i32[cap] (the compact row of each expert-major row, -1 for
// padding).
//
// Steps of a dispatch (epoch e = HT dispatch count, device side):
//   layout (one block): per-rank and per-expert counts of this rank's tokens, the row broadcast to
//     every rank, then every rank's row awaited; from the full count matrix, where this rank's rows
//     go on each rank and what this rank receives. A peer's row of epoch e also says the peer has
//     begun call e, so it is done with the compact buffers of call e - 1: the exchange is the
//     buffers' reuse handshake, and no host synchronisation is needed anywhere.
//   dispatch (a warp per token): a row slot per destination rank and an expert-major slot per expert
//     claimed with local atomics; num_sms blocks send the token's row once to each other rank with
//     its routing, while the other blocks write the tokens that stay here into their compact row and
//     expert-major rows; the last block raises done[this rank] on every rank.
//   receive (every SM): waits for done from every rank, copies each compact row from a peer to its
//     expert-major rows, marks the padding.
// Combine (epoch c): send (a warp per compact row) sums the row's local slots w * y[pos] in fp32
// (or takes y_compact's row as it is: dispatch's backward) and writes one bf16 row into its source's
// comb[this rank][t]; receive (a warp per token) sums comb[r][t] over the ranks the token went to.
// The outputs of a dispatch stay valid until the next HT dispatch; combine it before then.
#pragma once

#include "tdist/kernels/ep/common.cuh"

namespace tdist::kernels::ep {

constexpr int kHtThreads = 512;
constexpr int kHtWarps = kHtThreads / 32;
constexpr int kHtLayoutThreads = 1024;

struct EpHtParams {
  tdist::device::SymmetricHeapView heap;
  int num_tokens, max_tokens, hidden, num_experts, num_local_experts, topk, alignment;
  int send_blocks;             // dispatch: blocks [0, send_blocks) send to peers, the rest write local rows
  const void* x;               // bf16 [T][H]
  const long long* topk_idx;   // [T][K]
  const float* topk_weights;   // [T][K]
  const void* y;               // combine: bf16 expert-major [rows][H], or null
  const void* y_compact;       // combine: bf16 [W M][H] compact rows taken as they are, or null
  void* out;                   // combine: bf16 [T][H]
  // symmetric
  u64* counts;
  char* recv_x;
  int* recv_src;
  int* recv_idx;
  float* recv_w;
  int* recv_pos;
  u64* done;
  char* comb;
  u64* c_ready;
  u64* c_done;
  // local
  EpState* state;
  int* send_base;
  int* exp_base;
  u32* rank_ctr;
  u32* exp_ctr;
  int* info;
  char* expert_x;
  int* expert_src;
  int* error;
};

}  // namespace tdist::kernels::ep

#if defined(__CUDACC__)
#include <cuda_bf16.h>

namespace tdist::kernels::ep {

TDIST_DEVICE int align_up(int v, int a) { return (v + a - 1) / a * a; }

// Count `c` of rank s's row in the matrix of call e (after the wait, plain loads suffice).
TDIST_DEVICE int matrix_at(const EpHtParams& p, u64 par, int s, int c) {
  const int row = p.heap.num_ranks + p.num_experts;
  return static_cast<int>(static_cast<u32>(p.counts[(par * p.heap.num_ranks + s) * row + c]));
}

// Lane j < K holds r, the rank its slot goes to (-1: none): whether j is the token's first slot to
// that rank (a token goes to a rank once). Every lane of the warp calls it.
TDIST_DEVICE bool warp_first_slot_of_rank(int r, int K, int lane) {
  bool first = r >= 0;
  for (int k = 0; k < K; ++k) {
    const int other = __shfl_sync(0xffffffffu, r, k);
    if (k < lane && other == r) first = false;
  }
  return first;
}

// Many blocks. Each block counts its share of the tokens in shared memory and adds the counts into
// rank_ctr / exp_ctr (zero between calls); the last block to finish exchanges the counts and lays
// out the rows. Dynamic shared memory: int[W + E].
__global__ void __launch_bounds__(kHtLayoutThreads, 1) ep_ht_layout(EpHtParams p) {
  begin_kernel();
  extern __shared__ int cnt[];
  const u64 e = ld_relaxed<Scope::kGpu>(&p.state->ht_epoch) + 1, par = e & 1;
  const int W = p.heap.num_ranks, me = p.heap.rank, L = p.num_local_experts, E = p.num_experts, K = p.topk;
  const int row = W + E;
  for (int i = threadIdx.x; i < row; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * (kHtLayoutThreads / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (kHtLayoutThreads / 32);
  constexpr int kBatch = 4;  // tokens whose ids are loaded before the first is looked at
  for (int t0 = warp; t0 < p.num_tokens; t0 += kBatch * warps) {
    long long ids[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int t = t0 + u * warps;
      ids[u] = t < p.num_tokens ? load_slot_id(p.topk_idx, K, t, lane) : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int t = t0 + u * warps;
      if (t >= p.num_tokens) break;  // warp-uniform
      const int g = warp_slot_expert_of(ids[u], K, E, t, lane, p.error);
      const int r = g >= 0 ? g / L : -1;
      const bool first = warp_first_slot_of_rank(r, K, lane);
      if (g >= 0) atomicAdd(cnt + W + g, 1);
      if (first) atomicAdd(cnt + r, 1);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < W; i += blockDim.x)
    if (cnt[i] != 0) atomicAdd(p.rank_ctr + i, static_cast<u32>(cnt[i]));
  for (int i = threadIdx.x; i < E; i += blockDim.x)
    if (cnt[W + i] != 0) atomicAdd(p.exp_ctr + i, static_cast<u32>(cnt[W + i]));
  if (!last_block(&p.state->ht_layout_done)) return;
  // The totals, and the counters zero again for the dispatch's slot claims.
  for (int i = threadIdx.x; i < W; i += blockDim.x) {
    cnt[i] = static_cast<int>(ld_relaxed<Scope::kGpu>(p.rank_ctr + i));
    p.rank_ctr[i] = 0;
  }
  for (int i = threadIdx.x; i < E; i += blockDim.x) {
    cnt[W + i] = static_cast<int>(ld_relaxed<Scope::kGpu>(p.exp_ctr + i));
    p.exp_ctr[i] = 0;
  }
  __syncthreads();
  // This rank's row to every rank (itself included), then every rank's row.
  for (int i = threadIdx.x; i < W * row; i += blockDim.x) {
    const int r = i / row, c = i % row;
    put_signal(p.heap, p.counts + (par * W + me) * row + c, (e << 32) | static_cast<u32>(cnt[c]), r);
  }
  for (int i = threadIdx.x; i < W * row; i += blockDim.x) wait_count_flag(p.counts + par * W * row + i, e);
  __syncthreads();
  // cnt now holds, for each expert g, its rows from every source padded to the alignment (the
  // counts were sent above and are read back from the matrix).
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int total = 0;
    for (int s = 0; s < W; ++s) total += matrix_at(p, par, s, W + g);
    cnt[g] = align_up(total, p.alignment);
    if (g / L == me) p.info[2 + g % L] = total;  // what this rank receives
  }
  // Where this rank's rows go: after the earlier sources' rows at each rank and expert.
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    int base = 0;
    for (int s = 0; s < me; ++s) base += matrix_at(p, par, s, r);
    p.send_base[r] = base;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    const int first_expert = g / L * L;
    int first_row = 0;
    for (int l = first_expert; l < g; ++l) first_row += cnt[l];
    for (int s = 0; s < me; ++s) first_row += matrix_at(p, par, s, W + g);
    p.exp_base[g] = first_row;
  }
  if (threadIdx.x == 0) {
    int received = 0;
    for (int s = 0; s < W; ++s) received += matrix_at(p, par, s, me);
    int rows = 0;
    for (int le = 0; le < L; ++le) {
      p.info[2 + L + le] = rows;
      rows += cnt[me * L + le];
    }
    p.info[2 + 2 * L] = rows;
    p.info[0] = received;
    p.info[1] = rows;
    p.state->ht_layout_done = 0;
    st_relaxed<Scope::kGpu>(&p.state->ht_epoch, e);
  }
}

// Two roles, by block. Blocks [0, send_blocks) send each token to the other ranks it goes to: a
// warp per token claims its compact row on each such rank and its expert-major row at each of their
// experts, writes the routing, then reads the token once and stores it to every destination. The
// other blocks write the tokens that stay on this rank straight into both outputs (the compact row
// and the expert-major rows of the local experts), beside the transfer, so the receive expands only
// the rows that came from peers. The last block raises done[this rank] on every rank.
__global__ void __launch_bounds__(kHtThreads, 1) ep_ht_dispatch(EpHtParams p) {
  begin_kernel();
  const u64 e = ld_relaxed<Scope::kGpu>(&p.state->ht_epoch);
  const int W = p.heap.num_ranks, me = p.heap.rank, L = p.num_local_experts, E = p.num_experts, K = p.topk;
  const int M = p.max_tokens, H = p.hidden;
  const u64 row_bytes = 2ull * H;
  const long long row_words = static_cast<long long>(row_bytes / 16);
  const int lane = threadIdx.x & 31;
  const bool sender = static_cast<int>(blockIdx.x) < p.send_blocks;
  const int role_block = sender ? blockIdx.x : blockIdx.x - p.send_blocks;
  const int role_blocks = sender ? p.send_blocks : gridDim.x - p.send_blocks;
  const int warp = role_block * kHtWarps + threadIdx.x / 32, warps = role_blocks * kHtWarps;
  for (int t = warp; t < p.num_tokens; t += warps) {
    const int g = warp_slot_expert(p.topk_idx, K, E, t, lane, nullptr);
    const int r = g >= 0 ? g / L : -1;
    const bool first = warp_first_slot_of_rank(r, K, lane);
    const bool mine = g >= 0 && (sender ? r != me : r == me);  // this role's slots
    const unsigned mine_mask = __ballot_sync(0xffffffffu, mine);
    if (mine_mask == 0) continue;  // warp-uniform
    int compact = -1, pos = -1;
    if (first && mine) compact = p.send_base[r] + static_cast<int>(atomicAdd(p.rank_ctr + r, 1u));
    if (mine) pos = p.exp_base[g] + static_cast<int>(atomicAdd(p.exp_ctr + g, 1u));
    const float w = lane < K ? p.topk_weights[static_cast<u64>(t) * K + lane] : 0.f;
    const unsigned firsts = __ballot_sync(0xffffffffu, first && mine);
    for (unsigned m = firsts; m != 0; m &= m - 1) {  // warp-uniform
      const int k = __ffs(m) - 1;
      const int dest = __shfl_sync(0xffffffffu, r, k);
      const int dest_row = __shfl_sync(0xffffffffu, compact, k);
      if (lane < K) {
        const u64 slot = static_cast<u64>(dest_row) * K + lane;
        const bool here = r == dest;  // then this lane is one of the role's slots, and pos is claimed
        *peer_ptr(p.heap, p.recv_idx + slot, dest) = here ? g % L : -1;
        *peer_ptr(p.heap, p.recv_w + slot, dest) = w;
        *peer_ptr(p.heap, p.recv_pos + slot, dest) = here ? pos : -1;
      }
      if (lane == 0) *peer_ptr(p.heap, p.recv_src + dest_row, dest) = me * M + t;
    }
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) + t * row_bytes);
    if (sender) {
      char* to = first && mine ? peer_ptr(p.heap, p.recv_x + static_cast<u64>(compact) * row_bytes, r) : nullptr;
      warp_copy16_multi<8>(to, firsts, src, row_words, lane);
    } else {
      // One compact row (at the token's first slot here) and an expert-major row per local slot.
      const int row = __shfl_sync(0xffffffffu, compact, __ffs(firsts) - 1);
      char* to_compact = first && mine ? p.recv_x + static_cast<u64>(compact) * row_bytes : nullptr;
      char* to_expert = mine ? p.expert_x + static_cast<u64>(pos) * row_bytes : nullptr;
      if (mine) p.expert_src[pos] = row;
      warp_copy16_multi<4>(to_compact, firsts, to_expert, mine_mask, src, row_words, lane);
    }
  }
  if (!last_block(&p.state->ht_dispatch_done)) return;
  if (static_cast<int>(threadIdx.x) < W) put_signal(p.heap, p.done + me, e, static_cast<int>(threadIdx.x));
  // The slot counters are zero again for the next call's layout step.
  for (int i = threadIdx.x; i < W; i += blockDim.x) p.rank_ctr[i] = 0;
  for (int i = threadIdx.x; i < E; i += blockDim.x) p.exp_ctr[i] = 0;
  if (threadIdx.x == 0) p.state->ht_dispatch_done = 0;
}

// Copies the compact rows that came from peers to their expert-major rows (a warp per compact row,
// read once and stored to each of its local experts' rows; this rank's own rows were placed by the
// dispatch); marks the padding rows.
__global__ void __launch_bounds__(kHtThreads, 1) ep_ht_dispatch_recv(EpHtParams p) {
  begin_kernel();
  const u64 e = ld_relaxed<Scope::kGpu>(&p.state->ht_epoch), par = e & 1;
  const int W = p.heap.num_ranks, me = p.heap.rank, L = p.num_local_experts, K = p.topk, H = p.hidden;
  const u64 row_bytes = 2ull * H;
  for (int r = threadIdx.x; r < W; r += blockDim.x) wait_epoch(p.done + r, e);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * kHtWarps + threadIdx.x / 32, warps = gridDim.x * kHtWarps;
  // This rank's own compact rows, [own_begin, own_begin + own): skipped.
  const int own_begin = p.send_base[me], own = matrix_at(p, par, me, me);
  const int from_peers = p.info[0] - own;
  for (int j = warp; j < from_peers; j += warps) {
    const int i = j < own_begin ? j : j + own;
    const int pos = lane < K ? p.recv_pos[static_cast<u64>(i) * K + lane] : -1;
    const unsigned dests = __ballot_sync(0xffffffffu, pos >= 0);
    char* to = pos >= 0 ? p.expert_x + static_cast<u64>(pos) * row_bytes : nullptr;
    if (pos >= 0) p.expert_src[pos] = i;
    const uint4* from = reinterpret_cast<const uint4*>(p.recv_x + static_cast<u64>(i) * row_bytes);
    warp_copy16_multi<4>(to, dests, from, static_cast<long long>(row_bytes / 16), lane);
  }
  const int thread = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
  for (int le = 0; le < L; ++le) {
    const int begin = p.info[2 + L + le] + p.info[2 + le], end = p.info[2 + L + le + 1];
    for (int q = begin + thread; q < end; q += threads) p.expert_src[q] = -1;
  }
}

constexpr int kHtChunks = 2;  // 256-channel chunks a lane sums at once (their loads in flight together)

// A warp per compact row: its partial sum to its source's comb[this rank][t].
__global__ void __launch_bounds__(kHtThreads, 1) ep_ht_combine_send(EpHtParams p) {
  begin_kernel();
  const u64 c = ld_relaxed<Scope::kGpu>(&p.state->ht_combine_epoch) + 1;
  const int W = p.heap.num_ranks, me = p.heap.rank, K = p.topk, M = p.max_tokens, H = p.hidden;
  const u64 row_bytes = 2ull * H;
  // Every block raises it (the same value), so no block waits on another block of this grid; then
  // every rank's flag is awaited once here rather than once per row (combine is collective, and a
  // peer's first block raises its flag before it waits for anything).
  for (int r = threadIdx.x; r < W; r += blockDim.x) put_signal(p.heap, p.c_ready + me, c, r);
  for (int r = threadIdx.x; r < W; r += blockDim.x) wait_epoch(p.c_ready + r, c);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * kHtWarps + threadIdx.x / 32, warps = gridDim.x * kHtWarps;
  const int received = p.info[0];
  const __nv_bfloat16* y = static_cast<const __nv_bfloat16*>(p.y);
  const char* yc = static_cast<const char*>(p.y_compact);
  for (int i = warp; i < received; i += warps) {
    const int src = p.recv_src[i], s = src / M, t = src % M;
    char* to = peer_ptr(p.heap, p.comb + (static_cast<u64>(me) * M + t) * row_bytes, s);
    if (yc != nullptr) {
      warp_copy16<8>(reinterpret_cast<uint4*>(to), reinterpret_cast<const uint4*>(yc + i * row_bytes),
                     static_cast<long long>(row_bytes / 16), lane);
      continue;
    }
    // Lane k: slot k's expert-major row and weight; the rows summed are the local slots.
    const int pos = lane < K ? p.recv_pos[static_cast<u64>(i) * K + lane] : -1;
    const float w = lane < K ? p.recv_w[static_cast<u64>(i) * K + lane] : 0.f;
    const unsigned rows = __ballot_sync(0xffffffffu, pos >= 0);
    const __nv_bfloat16* row = pos >= 0 ? y + static_cast<u64>(pos) * H : nullptr;
    for (int c0 = lane * 8; c0 - lane * 8 < H; c0 += 256 * kHtChunks) {  // warp-uniform bound
      float acc[kHtChunks][8];
#pragma unroll
      for (int u = 0; u < kHtChunks; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
      warp_sum_rows<kHtChunks>(acc, row, w, rows, c0, H);
      store_bf16_chunks<kHtChunks>(to, acc, c0, H);
    }
  }
  if (!last_block(&p.state->ht_combine_done)) return;
  if (static_cast<int>(threadIdx.x) < W) put_signal(p.heap, p.c_done + me, c, static_cast<int>(threadIdx.x));
  if (threadIdx.x == 0) {
    p.state->ht_combine_done = 0;
    st_relaxed<Scope::kGpu>(&p.state->ht_combine_epoch, c);
  }
}

// A warp per token: out[t] = sum of comb[r][t] over the ranks its slots were sent to, in fp32.
__global__ void __launch_bounds__(kHtThreads, 1) ep_ht_combine_recv(EpHtParams p) {
  begin_kernel();
  const u64 c = ld_relaxed<Scope::kGpu>(&p.state->ht_combine_epoch);
  const int W = p.heap.num_ranks, L = p.num_local_experts, E = p.num_experts, K = p.topk, M = p.max_tokens;
  const int H = p.hidden;
  const u64 row_bytes = 2ull * H;
  for (int r = threadIdx.x; r < W; r += blockDim.x) wait_epoch(p.c_done + r, c);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * kHtWarps + threadIdx.x / 32, warps = gridDim.x * kHtWarps;
  for (int t = warp; t < p.num_tokens; t += warps) {
    const int g = warp_slot_expert(p.topk_idx, K, E, t, lane, nullptr);
    const int r = g >= 0 ? g / L : -1;
    const bool first = warp_first_slot_of_rank(r, K, lane);
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    // Lane k (a first slot of rank r): rank r's partial row of this token; summed in slot order.
    const char* row = first ? p.comb + (static_cast<u64>(r) * M + t) * row_bytes : nullptr;
    char* out = static_cast<char*>(p.out) + static_cast<u64>(t) * row_bytes;
    for (int c0 = lane * 8; c0 - lane * 8 < H; c0 += 256 * kHtChunks) {  // warp-uniform bound
      float acc[kHtChunks][8];
#pragma unroll
      for (int u = 0; u < kHtChunks; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
      warp_sum_rows<kHtChunks>(acc, row, 1.f, firsts, c0, H);
      store_bf16_chunks<kHtChunks>(out, acc, c0, H);
    }
  }
}

}  // namespace tdist::kernels::ep
#endif  // __CUDACC__
