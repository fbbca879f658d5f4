// Decode attention (one query token per sequence) over a paged or contiguous KV cache, split along
// the sequence so that even batch 1 fills every SM (split-KV "flash decoding"), then merged; in the
// distributed form the merge also spans ranks, each holding its own part of every sequence's KV.
//
// Layouts (row-major, T = __nv_bfloat16 or __half):
//   q            T[batch][q_heads][D]
//   k_cache      T[num_pages][page_size][kv_heads][D]      (vLLM / FlashInfer paged layout; v alike)
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
// chunk of G query heads, split): it reads each K and V row of its tokens once for its G heads.
// Threads: D / 8 lanes per token, each lane a 16-byte vector of the row; a warp holds 32 / (D / 8)
// tokens at once and kUnroll steps of them are loaded before any is used, so every lane has
// 2 x kUnroll 16-byte loads in flight.
//
// Bad input seen on the device sets a bit of *errors (the host reports it, naming the argument):
// kErrBlockTable (an entry outside [0, num_pages): the page is skipped), kErrSeqLen (a length
// outside [0, capacity]: clamped). Compiles under NVRTC.
#pragma once

#include "tdist/kernels/collectives/common.cuh"  // EpochState, begin_call / end_call, from_f32

namespace tdist::kernels::attention {

using device::u32;
using device::u64;

constexpr int kDecodeThreads = 128;   // threads of a split CTA (4 warps)
constexpr int kCombineThreads = 128;  // threads of a combine CTA (a warp per item)
constexpr u32 kErrBlockTable = 1u;    // *errors bit: a block-table entry outside the cache
constexpr u32 kErrSeqLen = 2u;        // *errors bit: a length outside [0, capacity]
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct DecodeParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int* block_table;  // nullptr: contiguous
  const int* seq_lens;
  float* o_part;
  float* lse_part;
  u32* errors;
  u64 num_pages;
  u32 page_size;
  u32 max_pages;  // block_table row stride
  u32 capacity;   // tokens a sequence can hold: max_pages * page_size (contiguous: page_size)
  u32 q_heads;
  u32 kv_heads;
  u32 group;        // q_heads / kv_heads
  u32 head_chunks;  // group / G: CTAs per KV head
  u32 num_splits;
  float scale_log2;  // softmax_scale * log2(e), used when softcap == 0
  float softmax_scale;
  float softcap;
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
};

}  // namespace tdist::kernels::attention

#if defined(__CUDACC__)
#include "tdist/kernels/collectives/ll.cuh"  // ll_read: the LL protocol's timed wait for a line

namespace tdist::kernels::attention {

using namespace tdist::device;

// NVRTC has no math.h: +infinity spelled by its bits.
#define kInf __int_as_float(0x7f800000)

TDIST_DEVICE void to_float8(const uint4& v, float* f, __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

TDIST_DEVICE void to_float8(const uint4& v, float* f, __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// Streaming 16-byte load: the cache is read once, so keep it out of L1.
TDIST_DEVICE uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Merges the running state (m, l, acc) with another (m2, l2, acc2), all in base 2.
template <int N>
TDIST_DEVICE void merge_state(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
  const float mn = fmaxf(m, m2);
  if (mn == -kInf) return;  // both empty
  const float a = exp2f(m - mn), b = exp2f(m2 - mn);
  l = l * a + l2 * b;
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = acc[i] * a + acc2[i] * b;
  m = mn;
}

// grid (num_splits, kv_heads * head_chunks, batch), block kDecodeThreads.
template <typename T, int D, int G>
__global__ void __launch_bounds__(kDecodeThreads) flash_decode_split(DecodeParams p) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim 64, 128 or 256");
  constexpr int kLanes = D / 8;  // lanes per token
  constexpr int kTokPerWarp = 32 / kLanes;
  constexpr int kWarps = kDecodeThreads / 32;
  constexpr int kUnroll = 4;  // steps loaded before use: 8 16-byte loads in flight per lane
  constexpr int kTokPerStep = kWarps * kTokPerWarp * kUnroll;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lg = lane / kLanes, li = lane % kLanes;  // token slot in the warp, vector in the row
  const u32 split = blockIdx.x, b = blockIdx.z;
  const u32 kv_head = blockIdx.y / p.head_chunks;
  const u32 h0 = kv_head * p.group + (blockIdx.y % p.head_chunks) * G;  // first query head

  // Launched with programmatic dependent launch: start once the kernel before it (which may write
  // q, the cache or the lengths) has completed.
  wait_for_prior_grid();
  int len = p.seq_lens[b];
  if (len < 0 || static_cast<u32>(len) > p.capacity) {
    if (threadIdx.x == 0 && split == 0 && blockIdx.y == 0) atomicOr(p.errors, kErrSeqLen);
    len = len < 0 ? 0 : static_cast<int>(p.capacity);
  }
  // This split's tokens [t0, t1): the length cut in num_splits pieces of a multiple of a step.
  u32 per = (static_cast<u32>(len) + p.num_splits - 1) / p.num_splits;
  per = (per + kTokPerStep - 1) / kTokPerStep * kTokPerStep;
  const u32 t0 = min(split * per, static_cast<u32>(len)), t1 = min(t0 + per, static_cast<u32>(len));

  // Query vectors, pre-scaled to base-2 logits when there is no cap.
  const bool capped = p.softcap > 0.f;
  const float q_mul = capped ? p.softmax_scale : p.scale_log2;
  float q[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = static_cast<const T*>(p.q) + (static_cast<u64>(b) * p.q_heads + h0 + g) * D + li * 8;
    to_float8(*reinterpret_cast<const uint4*>(qp), q[g], T{});
#pragma unroll
    for (int j = 0; j < 8; ++j) q[g][j] *= q_mul;
  }

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -kInf;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }

  const u64 row_stride = static_cast<u64>(p.kv_heads) * D;  // elements between token rows
  const T* kbase = static_cast<const T*>(p.k_cache) + static_cast<u64>(kv_head) * D + li * 8;
  const T* vbase = static_cast<const T*>(p.v_cache) + static_cast<u64>(kv_head) * D + li * 8;
  const int* table = p.block_table ? p.block_table + static_cast<u64>(b) * p.max_pages : nullptr;

  for (u32 s = t0; s < t1; s += kTokPerStep) {
    uint4 kv[kUnroll], vv[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const u32 t = s + (u * kWarps + warp) * kTokPerWarp + lg;
      valid[u] = t < t1;
      if (valid[u]) {
        const u32 slot = t / p.page_size, off = t - slot * p.page_size;
        u64 page = b;
        if (table) {
          const int e = table[slot];
          if (e < 0 || static_cast<u64>(e) >= p.num_pages) {
            atomicOr(p.errors, kErrBlockTable);
            valid[u] = false;
          }
          page = static_cast<u64>(e);
        }
        if (valid[u]) {
          const u64 row = (page * p.page_size + off) * row_stride;
          kv[u] = load_stream(kbase + row);
          vv[u] = load_stream(vbase + row);
        }
      }
    }
    float sc[kUnroll][G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[8];
      to_float8(valid[u] ? kv[u] : make_uint4(0, 0, 0, 0), kf, T{});
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) d = fmaf(q[g][j], kf[j], d);
#pragma unroll
        for (int o = kLanes / 2; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (capped) d = p.softcap * tanhf(d / p.softcap) * kLog2e;
        sc[u][g] = valid[u] ? d : -kInf;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) mn = fmaxf(mn, sc[u][g]);
      if (mn == -kInf) continue;  // nothing valid yet in this slot
      const float a = exp2f(m[g] - mn);
      l[g] *= a;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] *= a;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!valid[u]) continue;
        const float pr = exp2f(sc[u][g] - mn);
        float vf[8];
        to_float8(vv[u], vf, T{});
        l[g] += pr;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(pr, vf[j], acc[g][j]);
      }
      m[g] = mn;
    }
  }

  // Merge the token slots of the warp (lanes li, li + kLanes, ... hold the same dims).
#pragma unroll
  for (int o = kLanes; o < 32; o *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
      float a2[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) a2[j] = __shfl_xor_sync(0xffffffffu, acc[g][j], o);
      merge_state<8>(m[g], l[g], acc[g], m2, l2, a2);
    }
  }

  // Then the warps, through shared memory: sm_acc[warp][g][D], sm_ml[warp][g][2].
  __shared__ float sm_acc[kWarps][G][D];
  __shared__ float sm_ml[kWarps][G][2];
  if (lg == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm_acc[warp][g][li * 8 + j] = acc[g][j];
      if (li == 0) {
        sm_ml[warp][g][0] = m[g];
        sm_ml[warp][g][1] = l[g];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    float mm = -kInf, ll = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) merge_state<1>(mm, ll, &a, sm_ml[w][g][0], sm_ml[w][g][1], &sm_acc[w][g][d]);
    const u64 part = (static_cast<u64>(b) * p.q_heads + h0 + g) * p.num_splits + split;
    p.o_part[part * D + d] = ll > 0.f ? a / ll : 0.f;
    if (d == 0) p.lse_part[part] = ll > 0.f ? mm + log2f(ll) : -kInf;
  }
}

// The merge of a warp's item: every split of this rank, weighted by exp2(lse_s - max). o[kPer]
// receives the lane's dims (lane * kPer ...); returns the log2-sum (-inf when no token).
template <int D>
TDIST_DEVICE float merge_splits(const CombineParams& p, u32 item, int lane, float* o) {
  constexpr int kPer = D / 32;
  const float* lse = p.lse_part + static_cast<u64>(item) * p.num_splits;
  float mx = -kInf;
  for (u32 s = lane; s < p.num_splits; s += 32) mx = fmaxf(mx, lse[s]);
#pragma unroll
  for (int o2 = 16; o2 > 0; o2 /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
#pragma unroll
  for (int j = 0; j < kPer; ++j) o[j] = 0.f;
  if (mx == -kInf) return -kInf;
  float sum = 0.f;
  const float* op = p.o_part + static_cast<u64>(item) * p.num_splits * D + lane * kPer;
  for (u32 s = 0; s < p.num_splits; ++s) {
    const float ls = lse[s];
    if (ls == -kInf) continue;
    const float w = exp2f(ls - mx);
    sum += w;
#pragma unroll
    for (int j = 0; j < kPer; ++j) o[j] = fmaf(w, op[static_cast<u64>(s) * D + j], o[j]);
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) o[j] /= sum;
  return mx + log2f(sum);
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

// Merges the splits of every item (warp per item) and, with p.ll, every rank's result: each rank
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
  if (p.ll == nullptr) {
    wait_for_prior_grid();  // the split kernel's partials (programmatic launch: it may still run)
    for (u32 item = first; item < p.items; item += stride) {
      const float lse2 = merge_splits<D>(p, item, lane, o);
      store_item<T, D>(p, item, lane, o, lse2);
    }
    return;
  }
  const u64 e = coll::begin_call(p.epoch);
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
    for (int k = 0; k < n * (kPer + 1); ++k) {  // one call site of the wait: no registers saved around others
      const int r = k / (kPer + 1), j = k % (kPer + 1);
      coll::ll_read(ll_line(p, par, r, item, j == kPer ? D : lane * kPer + j, D), flag);
    }
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
}

#undef kInf

}  // namespace tdist::kernels::attention
#endif  // __CUDACC__
