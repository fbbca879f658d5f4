// Decode attention (one query token per sequence) over a paged or contiguous KV cache, split along
// the sequence so that even batch 1 fills every SM (split-KV "flash decoding"), then merged; in the
// distributed form the merge also spans ranks, each holding its own part of every sequence's KV.
//
// Layouts (row-major, T = __nv_bfloat16 or __half):
//   q            T[batch][q_heads][D]
//   k_cache      T[num_pages][page_size][kv_heads][D]      (vLLM / FlashInfer paged layout; v alike),
//                                                           pages page_stride elements apart (>= a page)
//   block_table  i32[batch][max_pages]                      page of token t of sequence b:
//                                                           block_table[b][t / page_size]
//   contiguous   block_table == nullptr: num_pages = batch, page_size = the capacity per sequence,
//                page of sequence b = b, i.e. k_cache T[batch][capacity][kv_heads][D]
//   seq_lens     i32[batch]                                 in device memory (graphs replay with new ones)
//   out          T[batch][q_heads][D]
//   lse          f32[batch][q_heads]                        natural log of sum_t exp(s_t); -inf if empty
//   o_part       f32[batch][q_heads][num_splits][D]         each split's normalised output
//   lse_part     f32[batch][q_heads][num_splits]            each split's log2-sum-exp2 (-inf: empty)
//   ll           u64[2][num_ranks][max_items][D + 1]        distributed merge, symmetric: lines of
//                                                           item (b * q_heads + h), words 0..D-1 the
//                                                           rank's o (f32 bits), word D its log2-sum
//
// Logits: s = softmax_scale * q.k; with softcap > 0, s = softcap * tanh(s / softcap). Work runs in
// base 2 (exp2 of s * log2 e) with fp32 accumulation; lse is returned in natural log.
//
// Query heads h of KV head h / group (GQA). A CTA of the split kernel takes one (sequence, KV head,
// chunk of `heads` <= 16 query heads, split): it reads each K and V row of its tokens once for all
// its heads, on the tensor cores (mma.sync m16n8k16, fp32 accumulation): the heads are the M rows
// (rows past `heads` are zero), tokens the N of S = Q K^T and the K of O += P V, P rounded to T.
// Each warp owns tiles of 16 tokens (tiles warp, warp + 4, ... of the split) and its own
// decode_stages(D)-deep cp.async pipeline of K and V tiles in shared memory, gathered row by row
// through the block table, so that HBM reads stay in flight while the warp computes; the warps'
// states are merged through shared memory at the end.
//
// Bad input seen on the device sets a bit of *errors (the host reports it, naming the argument):
// kErrBlockTable (an entry outside [0, num_pages): the page is skipped), kErrSeqLen (a length
// outside [0, capacity]: clamped). Compiles under NVRTC.
#pragma once

#include "tdist/device/profile.cuh"
#include "tdist/kernels/collectives/common.cuh"  // EpochState, begin_call / end_call, from_f32

namespace tdist::kernels::attention {

using device::u32;
using device::u64;

constexpr int kDecodeThreads = 128;  // threads of a split CTA
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeTile = 16;       // tokens of a warp's tile: two n8 tiles of Q K^T, the k16 of P V
constexpr int kMaxHeadsPerCta = 16;   // the M of the MMA
constexpr int kCombineThreads = 128;  // threads of a combine CTA
constexpr u32 kErrBlockTable = 1u;    // *errors bit: a block-table entry outside the cache
constexpr u32 kErrSeqLen = 2u;        // *errors bit: a length outside [0, capacity]
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Pipeline depth of a warp's K/V tiles: 67 KiB of shared memory per CTA at D = 64 (3 CTAs per SM),
// 101 KiB at 128 (2 per SM), 201 KiB at 256 (1 per SM, its registers allow no more), so that every
// warp keeps 2-3 tiles in flight.
TDIST_HOST_DEVICE constexpr int decode_stages(int head_dim) { return head_dim == 64 ? 4 : 3; }
// Dynamic shared memory of the split kernel (bytes), laid out as
//   kv    T[kDecodeWarps][stages][2][kDecodeTile][D]   each warp's ring of K, V tiles
//   q     T[kMaxHeadsPerCta][D]                        the CTA's query rows, zero past `heads`
//   mask  u32[kDecodeWarps][stages]                    valid tokens of each staged tile (bit per token)
//   ml    f32[kDecodeWarps][kMaxHeadsPerCta][2]        each warp's final (max, sum) per head, then
//                                                      (its weight in the merge, unused)
// and, once the pipelines have drained, o f32[kDecodeWarps][kMaxHeadsPerCta][D + 8] over kv. Rows of
// kv and q are swizzled: 16-byte chunk c of row r is stored at chunk c ^ (r % 8), so that the eight
// rows an ldmatrix reads fall in distinct banks.
TDIST_HOST_DEVICE constexpr size_t decode_smem_bytes(int head_dim, int elem_bytes) {
  return static_cast<size_t>(kDecodeWarps) * decode_stages(head_dim) * 2 * kDecodeTile * head_dim * elem_bytes +
         static_cast<size_t>(kMaxHeadsPerCta) * head_dim * elem_bytes +
         static_cast<size_t>(kDecodeWarps) * decode_stages(head_dim) * 4 + kDecodeWarps * kMaxHeadsPerCta * 2 * 4;
}

// Splits whose partials a lane of the combine kernel loads in one round (64 registers of them): 32
// at head dim 64, 16 at 128, 8 at 256. Each further round is one more dependent L2 round trip.
TDIST_HOST_DEVICE constexpr int combine_batch_splits(int head_dim) { return 64 * 32 / head_dim; }

struct DecodeParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int* block_table;  // nullptr: contiguous
  const int* seq_lens;
  float* o_part;
  float* lse_part;
  void* out;   // non-null with one split and no exchange: the result, written here (no combine)
  float* lse;  // with out: the log-sum-exp (natural log), may be nullptr
  u32* errors;
  u64 num_pages;
  u64 page_stride;  // elements from a page to the next (page_size * kv_heads * D when dense)
  u32 page_size;
  u32 max_pages;  // block_table row stride
  u32 capacity;   // tokens a sequence can hold: max_pages * page_size (contiguous: page_size)
  u32 q_heads;
  u32 kv_heads;
  u32 group;        // q_heads / kv_heads
  u32 heads;        // query heads of a CTA (<= kMaxHeadsPerCta, divides group)
  u32 head_chunks;  // group / heads: CTAs per KV head
  u32 num_splits;
  float scale_log2;  // softmax_scale * log2(e), used when softcap == 0
  float softmax_scale;
  float softcap;
  float cap_in;         // softmax_scale / softcap (softcap > 0)
  float cap_out;        // softcap * log2(e)
  u32 first_wave_ctas;  // CTAs resident at once: these may start before the kernel before has ended
};

struct CombineParams {
  tdist::device::SymmetricHeapView heap;  // distributed only
  const float* o_part;
  const float* lse_part;
  void* out;
  float* lse;               // may be nullptr
  u64* ll;                  // nullptr: one rank, no exchange
  coll::EpochState* epoch;  // distributed only
  u32 items;                // batch * q_heads
  u32 max_items;            // ll's item dimension
  u32 num_splits;
  u32 cta_per_item;  // one rank: 1 = a CTA per item (merge_item_by_cta), 0 = a warp per item
};

}  // namespace tdist::kernels::attention

#if defined(__CUDACC__)
#include "tdist/kernels/collectives/ll.cuh"  // ll_read: the LL protocol's timed wait for a line

namespace tdist::kernels::attention {

using namespace tdist::device;

// NVRTC has no math.h: +infinity spelled by its bits.
#define kInf __int_as_float(0x7f800000)

// Two floats as a T pair (the lower column in the low half), the register of an MMA fragment.
TDIST_DEVICE u32 pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const u32*>(&h);
}
TDIST_DEVICE u32 pack2(float lo, float hi, __half) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const u32*>(&h);
}

// c (16 x 8, f32) += a (16 x 16) b (16 x 8), T in.
TDIST_DEVICE void mma_16816(float* c, const u32* a, u32 b0, u32 b1, __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
TDIST_DEVICE void mma_16816(float* c, const u32* a, u32 b0, u32 b1, __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

TDIST_DEVICE u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// Four 8 x 8 matrices of 16-bit elements; lanes 8i..8i+7 give matrix i's row addresses.
TDIST_DEVICE void ldmatrix_x4(u32* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
}
TDIST_DEVICE void ldmatrix_x4_trans(u32* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
}

// 16 bytes global -> shared, bypassing L1 (the cache is read once); src_bytes 0 writes zeros.
TDIST_DEVICE void cp_async16(void* dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
TDIST_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
TDIST_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Element offset of 16-byte chunk c of row r in a swizzled [rows][D] tile.
template <int D>
TDIST_DEVICE int swz(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// N elements of T moved as one access of N x sizeof(T) bytes (a partial output's floats, an
// output's four T).
template <typename T, int N>
struct alignas(N * sizeof(T)) Packed {
  T v[N];
};

// A sequence's length clamped to [0, capacity] (the bad ones are reported by the split kernel).
TDIST_DEVICE u32 clamp_len(int len, u32 capacity) { return len < 0 ? 0u : min(static_cast<u32>(len), capacity); }

// The tokens [t0, t1) of split `split` of a sequence of `len`: num_splits pieces of whole CTA steps
// (kDecodeWarps tiles), the last pieces shorter or empty.
struct Piece {
  u32 t0, t1;
};
TDIST_DEVICE Piece split_piece(u32 len, u32 split, u32 num_splits) {
  constexpr u32 kStep = kDecodeWarps * kDecodeTile;
  u32 per = (len + num_splits - 1) / num_splits;
  per = (per + kStep - 1) / kStep * kStep;
  const u32 t0 = min(split * per, len);
  return {t0, min(t0 + per, len)};
}

// Profiled (device/profile.cuh): thread 0 of each CTA records on track 0. Split kernel: a `user`
// span from entry to exit (payload: the split), inside it a `wait` for the kernel before (payload 0)
// and a `tile` span from warp 0's first landed tile to the end of its loop (payload: its tiles).
// Combine kernel: a `user` span (payload: the block), inside it a `wait` for the split kernel
// (payload 0) and, distributed, one for the peers' lines of the block's first item (payload 1).
TDIST_DEVICE void decode_record(ProfileKernel kernel, ProfileEvent event, u32 payload) {
  if (threadIdx.x == 0) profile_record(kernel, 0, event, payload);
}

// grid (kv_heads * head_chunks, num_splits, batch), block kDecodeThreads, dynamic shared memory
// decode_smem_bytes(D, sizeof(T)). The heads vary fastest, so that the CTAs of one piece of a
// sequence start side by side and read each token's row of all KV heads (contiguous in a page) at
// about the same time.
template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads) flash_decode_split(DecodeParams p) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim 64, 128 or 256");
  constexpr int kChunks = D / 8;  // 16-byte chunks of a row
  constexpr int kStages = decode_stages(D);
  constexpr int kWarps = kDecodeWarps;
  constexpr int kTileElems = kDecodeTile * D;  // a K or V tile
  constexpr u32 kFull = 0xffffffffu;
  // Tiles of each warp prefetched into L2 while the kernel before finishes: what the pipeline
  // requests first.
  constexpr int kPrefetchTiles = kStages - 1;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sm_kv = reinterpret_cast<T*>(smem);
  T* sm_q = sm_kv + kWarps * kStages * 2 * kTileElems;
  u32* sm_mask = reinterpret_cast<u32*>(sm_q + kMaxHeadsPerCta * D);
  float* sm_ml = reinterpret_cast<float*>(sm_mask + kWarps * kStages);
  float* sm_o = reinterpret_cast<float*>(smem);  // after the pipelines drain

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const u32 split = blockIdx.y, b = blockIdx.z;
  const u32 kv_head = blockIdx.x / p.head_chunks;
  const u32 h0 = kv_head * p.group + (blockIdx.x % p.head_chunks) * p.heads;  // first query head
  const int heads = static_cast<int>(p.heads);

  const u64 row_stride = static_cast<u64>(p.kv_heads) * D;  // elements between token rows
  const T* kbase = static_cast<const T*>(p.k_cache) + static_cast<u64>(kv_head) * D;
  const T* vbase = static_cast<const T*>(p.v_cache) + static_cast<u64>(kv_head) * D;
  const int* table = p.block_table ? p.block_table + static_cast<u64>(b) * p.max_pages : nullptr;

  // Launched with programmatic dependent launch, this grid may start while the kernel before it
  // runs (a step's combine kernel, say). Until that kernel completes, the rows of this warp's first
  // tiles are prefetched into L2, found through the length and block table as they are now; the
  // kernel before may still change them (a decode step appends a token), so they steer only the
  // prefetch (grid_dependency.cuh). The chain of reads a CTA starts with then hits L2. CTAs of later
  // waves start after the kernel before has ended; for them the prefetch would only add its chain.
  constexpr ProfileKernel kProfiled = ProfileKernel::kFlashDecodeSplit;
  decode_record(kProfiled, ProfileEvent::kUserBegin, split);
  const u64 cta = (static_cast<u64>(b) * gridDim.y + split) * gridDim.x + blockIdx.x;
  if (cta < p.first_wave_ctas && lane < kDecodeTile) {
    const Piece guess = split_piece(clamp_len(__ldcg(p.seq_lens + b), p.capacity), split, p.num_splits);
#pragma unroll
    for (int i = 0; i < kPrefetchTiles; ++i) {
      const u32 t = guess.t0 + static_cast<u32>(i * kWarps + warp) * kDecodeTile + lane;
      if (t >= guess.t1) break;
      const u32 slot = t / p.page_size;
      const int page = table ? __ldcg(table + slot) : static_cast<int>(b);
      if (page < 0 || static_cast<u64>(page) >= p.num_pages) break;
      const u64 row = static_cast<u64>(page) * p.page_stride + static_cast<u64>(t - slot * p.page_size) * row_stride;
#pragma unroll
      for (int c = 0; c < D * static_cast<int>(sizeof(T)); c += 128) {
        prefetch_l2(reinterpret_cast<const unsigned char*>(kbase + row) + c);
        prefetch_l2(reinterpret_cast<const unsigned char*>(vbase + row) + c);
      }
    }
  }
  // Then start once the kernel before (which may write q, the cache or the lengths) has completed;
  // the combine kernel may then be scheduled (it waits for this grid's completion itself).
  decode_record(kProfiled, ProfileEvent::kWaitBegin, 0);
  wait_for_prior_grid();
  decode_record(kProfiled, ProfileEvent::kWaitEnd, 0);
  allow_dependent_launch();
  const int len_in = p.seq_lens[b];
  if (len_in < 0 || static_cast<u32>(len_in) > p.capacity) {
    if (threadIdx.x == 0 && split == 0 && blockIdx.x == 0) atomicOr(p.errors, kErrSeqLen);
  }
  const Piece piece = split_piece(clamp_len(len_in, p.capacity), split, p.num_splits);
  const u32 t0 = piece.t0, t1 = piece.t1;  // this split's tokens [t0, t1)
  const int n_tiles = static_cast<int>((t1 - t0 + kDecodeTile - 1) / kDecodeTile);
  const int my_tiles = (n_tiles + kWarps - 1 - warp) / kWarps;  // tiles warp, warp + kWarps, ...
  T* my_kv = sm_kv + warp * kStages * 2 * kTileElems;
  u32* my_mask = sm_mask + warp * kStages;

  // The block-table entry of this lane's token in tile i (lanes 0..15; 0 where there is none). The
  // main loop loads it one tile before the tile's copies start, so that its L2 round trip overlaps
  // a tile's compute instead of stalling the warp before every issue.
  auto entry_of = [&](int i) -> int {
    if (table == nullptr || lane >= kDecodeTile || i >= my_tiles) return 0;
    const u32 t = t0 + static_cast<u32>(i * kWarps + warp) * kDecodeTile + lane;
    return t < t1 ? table[t / p.page_size] : 0;
  };
  // Starts the copies of this warp's tile i into stage i % kStages, `entry` its entry_of(i): lanes
  // 0..15 find their token's row, then every lane copies 16-byte chunks of rows (invalid rows: zeros).
  auto issue = [&](int i, int entry) {
    const int stage = i % kStages;
    const u32 base = t0 + static_cast<u32>(i * kWarps + warp) * kDecodeTile;
    u64 row = 0;
    bool valid = false;
    if (lane < kDecodeTile) {
      const u32 t = base + lane;
      valid = t < t1;
      if (valid) {
        const u32 slot = t / p.page_size, off = t - slot * p.page_size;
        u64 page = b;
        if (table) {
          if (entry < 0 || static_cast<u64>(entry) >= p.num_pages) {
            atomicOr(p.errors, kErrBlockTable);
            valid = false;
          }
          page = static_cast<u64>(entry);
        }
        row = page * p.page_stride + off * row_stride;
      }
    }
    const u32 mask = __ballot_sync(kFull, valid);
    if (lane == 0) my_mask[stage] = mask;
    T* ks = my_kv + stage * 2 * kTileElems;
    T* vs = ks + kTileElems;
#pragma unroll
    for (int j = 0; j < kDecodeTile * kChunks / 32; ++j) {
      const int idx = j * 32 + lane;
      const int r = idx / kChunks, c = idx % kChunks;
      const u64 at = __shfl_sync(kFull, row, r);
      const bool ok = (mask >> r) & 1u;
      const u64 src = ok ? at + c * 8 : 0;
      cp_async16(ks + swz<D>(r, c), kbase + src, ok ? 16u : 0u);
      cp_async16(vs + swz<D>(r, c), vbase + src, ok ? 16u : 0u);
    }
  };

  // Warp state, in MMA accumulator layout: row g = lane / 4 (elements 0, 1) and g + 8 (2, 3);
  // o[j] holds dims 8j + 2 (lane % 4) + {0, 1}. m, l per row (l this lane's part until the end).
  const int g = lane / 4, q4 = lane % 4;
  const int mi = lane / 8, mr = lane % 8;  // ldmatrix: the matrix and row this lane addresses
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-kInf, -kInf}, l[2] = {0.f, 0.f};
  const bool capped = p.softcap > 0.f;

  // The first tiles are on their way before the query rows are loaded.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_tiles) issue(s, entry_of(s));
    cp_async_commit();
  }
  int next_entry = entry_of(kStages - 1);
  // The query rows, zero past `heads` (their logits are 0 and their outputs unused).
  for (int i = threadIdx.x; i < kMaxHeadsPerCta * kChunks; i += kDecodeThreads) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < heads)
      v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + (static_cast<u64>(b) * p.q_heads + h0 + r) * D +
                                          c * 8);
    *reinterpret_cast<uint4*>(sm_q + swz<D>(r, c)) = v;
  }
  __syncthreads();

  for (int i = 0; i < my_tiles; ++i) {
    __syncwarp();  // every lane is done with the stage refilled next (tile i - 1's)
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1, next_entry);
    cp_async_commit();
    next_entry = entry_of(i + kStages);
    cp_async_wait<kStages - 1>();  // tile i's group
    __syncwarp();                  // every lane's copies of tile i visible to the warp
    if (i == 0) decode_record(kProfiled, ProfileEvent::kTileBegin, static_cast<u32>(my_tiles));
    const int stage = i % kStages;
    const T* ks = my_kv + stage * 2 * kTileElems;
    const T* vs = ks + kTileElems;
    const u32 mask = my_mask[stage];

    // S = Q K^T: s[n] tokens 8n + 2 q4 + {0, 1} of rows g, g + 8.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      u32 a[4], kb[4];
      const int qr = (mi & 1) * 8 + mr, kr = (mi >> 1) * 8 + mr;
      ldmatrix_x4(a, sm_q + swz<D>(qr, 2 * c + (mi >> 1)));
      ldmatrix_x4(kb, ks + swz<D>(kr, 2 * c + (mi & 1)));
      mma_16816(s[0], a, kb[0], kb[1], T{});
      mma_16816(s[1], a, kb[2], kb[3], T{});
    }
    // Base-2 logits (capped or scaled), -inf for tokens outside the split or on a bad page.
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e];
        x = capped ? p.cap_out * tanhf(x * p.cap_in) : x * p.scale_log2;
        s[n][e] = (mask >> (8 * n + 2 * q4 + (e & 1))) & 1u ? x : -kInf;
      }
    }
    // Online softmax per row (a row's 16 logits lie in the 4 lanes of a quad).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
      const float mn = fmaxf(m[h], mx);
      const float base = mn == -kInf ? 0.f : mn;  // no valid token yet: every p and alpha is 0
      const float alpha = exp2f(m[h] - base);
      m[h] = mn;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[n][e] = exp2f(s[n][e] - base);
          sum += s[n][e];
        }
      }
      l[h] = l[h] * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * h] *= alpha;
        o[j][2 * h + 1] *= alpha;
      }
    }
    // O += P V: P (rows x 16 tokens) as the A fragment straight from the S accumulators.
    const u32 pa[4] = {pack2(s[0][0], s[0][1], T{}), pack2(s[0][2], s[0][3], T{}), pack2(s[1][0], s[1][1], T{}),
                       pack2(s[1][2], s[1][3], T{})};
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      u32 vb[4];
      ldmatrix_x4_trans(vb, vs + swz<D>((mi & 1) * 8 + mr, 2 * j + (mi >> 1)));
      mma_16816(o[2 * j], pa, vb[0], vb[1], T{});
      mma_16816(o[2 * j + 1], pa, vb[2], vb[3], T{});
    }
  }
  if (my_tiles > 0) decode_record(kProfiled, ProfileEvent::kTileEnd, static_cast<u32>(my_tiles));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFull, l[h], 1);
    l[h] += __shfl_xor_sync(kFull, l[h], 2);
  }

  // Then the warps, through shared memory over the drained pipelines: each warp's rows below
  // `heads` to sm_o[warp][row][kORow] (rows padded by 8 floats, so that the float2 stores of a
  // half-warp fall in distinct banks) and its (max, sum) to sm_ml[warp][row].
  constexpr int kORow = D + 8;
  static_assert(sizeof(float) * kWarps * kMaxHeadsPerCta * kORow <= sizeof(T) * kWarps * kStages * 2 * kTileElems,
                "the warps' outputs fit over the drained K, V rings");
  cp_async_wait<0>();
  __syncthreads();
  float* wo = sm_o + warp * kMaxHeadsPerCta * kORow;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    if (row < heads) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<float2*>(wo + row * kORow + 8 * j + 2 * q4) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      if (q4 == 0) {
        sm_ml[(warp * kMaxHeadsPerCta + row) * 2] = m[h];
        sm_ml[(warp * kMaxHeadsPerCta + row) * 2 + 1] = l[h];
      }
    }
  }
  __syncthreads();
  // A thread per row turns the warps' (max, sum) into their weights exp2(m_w - max) / sum, in place
  // of m_w, and writes the row's log-sum-exp: the per-element merge below is then a weighted sum,
  // with no exponential or dependent chain per element.
  const u64 part0 = (static_cast<u64>(b) * p.q_heads + h0) * p.num_splits + split;  // row r: + r * num_splits
  if (threadIdx.x < heads) {
    const int r = threadIdx.x;
    float* ml = sm_ml + r * 2;  // warp w's pair at ml[w * kMaxHeadsPerCta * 2]
    float mx = -kInf, sum = 0.f, e[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ml[w * kMaxHeadsPerCta * 2]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      e[w] = mx == -kInf ? 0.f : exp2f(ml[w * kMaxHeadsPerCta * 2] - mx);
      sum += ml[w * kMaxHeadsPerCta * 2 + 1] * e[w];
    }
#pragma unroll
    for (int w = 0; w < kWarps; ++w) ml[w * kMaxHeadsPerCta * 2] = sum > 0.f ? e[w] / sum : 0.f;
    const float lse2 = sum > 0.f ? mx + log2f(sum) : -kInf;
    const u64 part = part0 + static_cast<u64>(r) * p.num_splits;
    if (p.out == nullptr)
      p.lse_part[part] = lse2;
    else if (p.lse != nullptr)
      p.lse[part] = lse2 == -kInf ? -kInf : lse2 * kLn2;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * D / 4; i += kDecodeThreads) {
    const int r = i / (D / 4), d = i % (D / 4) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = sm_ml[(w * kMaxHeadsPerCta + r) * 2];
      const float4 v = *reinterpret_cast<const float4*>(sm_o + (w * kMaxHeadsPerCta + r) * kORow + d);
      acc.x = fmaf(f, v.x, acc.x);
      acc.y = fmaf(f, v.y, acc.y);
      acc.z = fmaf(f, v.z, acc.z);
      acc.w = fmaf(f, v.w, acc.w);
    }
    const u64 at = (part0 + static_cast<u64>(r) * p.num_splits) * D + d;
    if (p.out != nullptr) {  // one split: the combine's result for it, bit for bit (part = the item)
      Packed<T, 4> v;
      v.v[0] = coll::from_f32<T>(acc.x);
      v.v[1] = coll::from_f32<T>(acc.y);
      v.v[2] = coll::from_f32<T>(acc.z);
      v.v[3] = coll::from_f32<T>(acc.w);
      *reinterpret_cast<Packed<T, 4>*>(static_cast<T*>(p.out) + at) = v;
    } else {
      *reinterpret_cast<float4*>(p.o_part + at) = acc;
    }
  }
  decode_record(kProfiled, ProfileEvent::kUserEnd, split);
}

// o[kPer] += w x one split's partial, held as kPer / kVec vectors of the lane's dims.
template <int kPer, int kVec>
TDIST_DEVICE void add_weighted(float* o, float w, const Packed<float, kVec>* part) {
#pragma unroll
  for (int c = 0; c < kPer / kVec; ++c) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[c * kVec + e] = fmaf(w, part[c].v[e], o[c * kVec + e]);
  }
}

TDIST_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int o2 = 16; o2 > 0; o2 /= 2) x += __shfl_xor_sync(0xffffffffu, x, o2);
  return x;
}
TDIST_DEVICE float warp_max(float x) {
#pragma unroll
  for (int o2 = 16; o2 > 0; o2 /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o2));
  return x;
}

// The merge of a warp's item: every split of this rank, weighted by exp2(lse_s - max). o[kPer]
// receives the lane's dims (lane * kPer ...); returns the log2-sum (-inf when no token). Lane i
// computes the weight of split s0 + i, broadcast to the warp. The partials are read in batches of
// kBatch splits, every load of a batch issued (into its own registers, 16 or 8 bytes a lane) before
// the first is used: the merge costs a few L2 round trips, not one per split (a loop that loads
// and accumulates split by split was compiled into one round trip per split, 5-6 us at 32 splits).

template <int D>
TDIST_DEVICE float merge_splits(const CombineParams& p, u32 item, int lane, float* o) {
  constexpr int kPer = D / 32;
  constexpr int kVec = kPer >= 4 ? 4 : kPer;       // floats per load: 16 bytes (8 at D = 64)
  constexpr int kBatch = combine_batch_splits(D);  // splits per batch: 64 registers of partials a lane
  using Vec = Packed<float, kVec>;                 // 8 or 16 bytes
  const float* lse = p.lse_part + static_cast<u64>(item) * p.num_splits;
  float mx = -kInf;
  for (u32 s = lane; s < p.num_splits; s += 32) mx = fmaxf(mx, lse[s]);
  mx = warp_max(mx);
#pragma unroll
  for (int j = 0; j < kPer; ++j) o[j] = 0.f;
  if (mx == -kInf) return -kInf;
  float sum = 0.f;
  const float* op = p.o_part + static_cast<u64>(item) * p.num_splits * D + lane * kPer;
  for (u32 s0 = 0; s0 < p.num_splits; s0 += 32) {
    const u32 n = min(32u, p.num_splits - s0);
    const float w_lane = static_cast<u32>(lane) < n ? exp2f(lse[s0 + lane] - mx) : 0.f;
    sum += w_lane;
    for (u32 b0 = 0; b0 < n; b0 += kBatch) {
      Vec v[kBatch][kPer / kVec];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (b0 + i < n) {
          const Vec* src = reinterpret_cast<const Vec*>(op + static_cast<u64>(s0 + b0 + i) * D);
#pragma unroll
          for (int c = 0; c < kPer / kVec; ++c) v[i][c] = src[c];
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        // every lane takes part in the shuffle; the splits past n weigh nothing
        const float w = __shfl_sync(0xffffffffu, w_lane, static_cast<int>(b0 + i));  // b0 + i < 32: kBatch divides 32
        if (b0 + i < n) add_weighted<kPer>(o, w, v[i]);
      }
    }
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kPer; ++j) o[j] /= sum;
  return mx + log2f(sum);
}

// One rank: the merge of `item` by a whole CTA, its warps taking the splits in turn (warp w: splits
// w, w + kWarps, ...), each weighing its own by exp2(lse_s - max) against the maximum over all of
// them, and summing through shared memory. Few items with many splits (batch 1: 32 items of 32
// splits) then spread over as many SMs, and each warp's partials are requested together with the
// log-sums: one L2 round trip per 32 splits, where a warp per item reads them in dependent rounds
// on a few SMs (batch 1, 32K tokens, on an H200: the combine ended 3.8 us after the split kernel
// with a warp per item, 2.0 us with a CTA per item).
template <typename T, int D>
TDIST_DEVICE void merge_item_by_cta(const CombineParams& p, u32 item, int warp, int lane, float (*sm_o)[D]) {
  constexpr int kPer = D / 32;
  constexpr int kVec = kPer >= 4 ? 4 : kPer;  // floats per load: 16 bytes (8 at D = 64)
  constexpr int kWarps = kCombineThreads / 32;
  constexpr int kMine = 32 / kWarps;  // this warp's splits of a round of 32
  using Vec = Packed<float, kVec>;
  const u32 n = p.num_splits;
  const float* lse = p.lse_part + static_cast<u64>(item) * n;
  const float* op = p.o_part + static_cast<u64>(item) * n * D + lane * kPer;
  Vec v[kMine][kPer / kVec];
  auto load_round = [&](u32 s0) {
#pragma unroll
    for (int i = 0; i < kMine; ++i) {
      const u32 s = s0 + warp + i * kWarps;
      if (s < n) {
        const Vec* src = reinterpret_cast<const Vec*>(op + static_cast<u64>(s) * D);
#pragma unroll
        for (int c = 0; c < kPer / kVec; ++c) v[i][c] = src[c];
      }
    }
  };
  load_round(0);  // before the log-sums are reduced: it does not depend on them
  const float first_lse = static_cast<u32>(lane) < n ? lse[lane] : -kInf;
  float mx = first_lse;
  for (u32 s = lane + 32; s < n; s += 32) mx = fmaxf(mx, lse[s]);
  mx = warp_max(mx);
  float o[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) o[j] = 0.f;
  float sum = 0.f;  // over every split: each warp computes the same total
  if (mx != -kInf) {
    for (u32 s0 = 0; s0 < n; s0 += 32) {
      if (s0 != 0) load_round(s0);
      const float ls = s0 == 0 ? first_lse : s0 + lane < n ? lse[s0 + lane] : -kInf;
      const float w_lane = exp2f(ls - mx);  // lane i: split s0 + i (0 past n)
      sum += w_lane;
#pragma unroll
      for (int i = 0; i < kMine; ++i) {
        const float w = __shfl_sync(0xffffffffu, w_lane, warp + i * kWarps);
        if (s0 + warp + i * kWarps < n) add_weighted<kPer>(o, w, v[i]);
      }
    }
    sum = warp_sum(sum);
  }
#pragma unroll
  for (int c = 0; c < kPer / kVec; ++c) {
    Vec w;
#pragma unroll
    for (int e = 0; e < kVec; ++e) w.v[e] = o[c * kVec + e];
    *reinterpret_cast<Vec*>(&sm_o[warp][lane * kPer + c * kVec]) = w;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + static_cast<u64>(item) * D;
  for (int d = threadIdx.x; d < D; d += kCombineThreads) {
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += sm_o[w][d];
    out[d] = coll::from_f32<T>(mx == -kInf ? 0.f : acc / sum);  // a NaN in the cache stays NaN
  }
  if (threadIdx.x == 0 && p.lse) p.lse[item] = mx == -kInf ? -kInf : (mx + log2f(sum)) * kLn2;
  __syncthreads();  // sm_o is the next item's
}

template <typename T, int D>
TDIST_DEVICE void store_item(const CombineParams& p, u32 item, int lane, const float* o, float lse2) {
  constexpr int kPer = D / 32;
  T* out = static_cast<T*>(p.out) + static_cast<u64>(item) * D + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] = coll::from_f32<T>(o[j]);
  if (lane == 0 && p.lse) p.lse[item] = lse2 == -kInf ? -kInf : lse2 * kLn2;
}

// The data word of a line already seen with this call's epoch.
TDIST_DEVICE float line_value(const u64* line) {
  return __uint_as_float(static_cast<u32>(ld_relaxed<Scope::kSystem>(line)));
}

// Line w of `item` from rank src, parity `par`, in this rank's buffer.
TDIST_DEVICE u64* ll_line(const CombineParams& p, u64 par, int src, u32 item, u32 w, int d) {
  return p.ll + ((par * p.heap.num_ranks + src) * p.max_items + item) * (d + 1) + w;
}

// Merges the splits of every item, a warp per item (on one rank, with cta_per_item, a CTA per item:
// merge_item_by_cta) and, with p.ll, every rank's result: each rank
// pushes its merged item to every peer as LL lines {f32 bits, epoch} (data and flag in one 8-byte
// store, so no reset and no barrier is needed; parity = epoch & 1 rotates the buffer), then merges
// the ranks' lines in rank order, so every rank computes the same bits. Grid: at most what is
// resident at once, grid-striding over items, every push of a CTA before any of its waits, so a
// waiting CTA never holds back a push that a peer waits for.
template <typename T, int D>
__global__ void __launch_bounds__(kCombineThreads) flash_decode_combine(CombineParams p) {
  constexpr int kPer = D / 32;
  constexpr int kWarps = kCombineThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const u32 first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
  float o[kPer];
  constexpr ProfileKernel kProfiled = ProfileKernel::kFlashDecodeCombine;
  decode_record(kProfiled, ProfileEvent::kUserBegin, blockIdx.x);
  if (p.ll == nullptr) {
    __shared__ __align__(16) float sm_o[kWarps][D];
    decode_record(kProfiled, ProfileEvent::kWaitBegin, 0);
    wait_for_prior_grid();  // the split kernel's partials (programmatic launch: it may still run)
    decode_record(kProfiled, ProfileEvent::kWaitEnd, 0);
    // The next kernel (the next step's split kernel, say) may be scheduled onto the SMs this small
    // grid leaves idle; it waits for this grid on the device before it touches memory.
    allow_dependent_launch();
    if (p.cta_per_item) {
      for (u32 item = blockIdx.x; item < p.items; item += gridDim.x) merge_item_by_cta<T, D>(p, item, warp, lane, sm_o);
    } else {
      for (u32 item = first; item < p.items; item += stride) {
        const float lse2 = merge_splits<D>(p, item, lane, o);
        store_item<T, D>(p, item, lane, o, lse2);
      }
    }
    decode_record(kProfiled, ProfileEvent::kUserEnd, blockIdx.x);
    return;
  }
  decode_record(kProfiled, ProfileEvent::kWaitBegin, 0);
  const u64 e = coll::begin_call(p.epoch);  // waits for the split kernel
  decode_record(kProfiled, ProfileEvent::kWaitEnd, 0);
  const u32 flag = static_cast<u32>(e);
  const u64 par = e & 1;
  const int n = p.heap.num_ranks, me = p.heap.rank;
  for (u32 item = first; item < p.items; item += stride) {
    const float lse2 = merge_splits<D>(p, item, lane, o);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const u64 line = (static_cast<u64>(flag) << 32) | __float_as_uint(o[j]);
      u64* mine = ll_line(p, par, me, item, lane * kPer + j, D);
      for (int k = 0; k < n; ++k) st_relaxed<Scope::kSystem>(p.heap.symm_at(mine, (me + k) % n), line);
    }
    if (lane == 0) {
      const u64 line = (static_cast<u64>(flag) << 32) | __float_as_uint(lse2);
      u64* mine = ll_line(p, par, me, item, D, D);
      for (int k = 0; k < n; ++k) st_relaxed<Scope::kSystem>(p.heap.symm_at(mine, (me + k) % n), line);
    }
  }
  __syncwarp();
  for (u32 item = first; item < p.items; item += stride) {
    // First wait until every line this lane reads carries the call's epoch (nothing else live across
    // the waits), then read them: a line keeps its value until this rank has finished the call.
    if (item == first) decode_record(kProfiled, ProfileEvent::kWaitBegin, 1);
    for (int k = 0; k < n * (kPer + 1); ++k) {  // one call site of the wait: no registers saved around others
      const int r = k / (kPer + 1), j = k % (kPer + 1);
      coll::ll_read(ll_line(p, par, r, item, j == kPer ? D : lane * kPer + j, D), flag);
    }
    if (item == first) decode_record(kProfiled, ProfileEvent::kWaitEnd, 1);
    float mx = -kInf;
    for (int r = 0; r < n; ++r) mx = fmaxf(mx, line_value(ll_line(p, par, r, item, D, D)));
    float acc[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] = 0.f;
    float sum = 0.f;
    if (mx != -kInf) {
      for (int r = 0; r < n; ++r) {
        const float ls = line_value(ll_line(p, par, r, item, D, D));
        if (ls == -kInf) continue;
        const float w = exp2f(ls - mx);
        sum += w;
#pragma unroll
        for (int j = 0; j < kPer; ++j)
          acc[j] = fmaf(w, line_value(ll_line(p, par, r, item, lane * kPer + j, D)), acc[j]);
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[j] /= sum;
    }
    store_item<T, D>(p, item, lane, acc, mx == -kInf ? -kInf : mx + log2f(sum));
  }
  coll::end_call(p.epoch, e);
  decode_record(kProfiled, ProfileEvent::kUserEnd, blockIdx.x);
}

#undef kInf

}  // namespace tdist::kernels::attention
#endif  // __CUDACC__
