// Low-latency (LL) protocol for small messages: data and flag travel in one 8-byte store, so a
// receiver needs no separate flag, fence or round trip. A line is (flag << 32) | data, with 4 bytes
// of payload and flag = the low 32 bits of the call's epoch; the store (st.relaxed.sys.u64) is
// single-copy atomic, so a reader that sees the flag sees the data of the same store.
//
// Buffer (symmetric, per rank): ll[parity][src][w], parity = epoch & 1, p.ll_words lines per source.
// Rank `src` writes word w of its message into ll[parity][src][w] on every peer (ReduceScatter: the
// message for that peer). Reuse: a rank
// writes parity (e & 1) again at call e + 2 only after its call e + 1 received a line from every
// peer, written by the peer's call e + 1, which began after the peer had read everything of call e.
//
// ll_all_gather: p.count = B bytes per rank; out[r * B, +B) = rank r's input.
// ll_all_reduce<T>: p.count = elements; every rank pushes its whole input to every peer, then sums
// all ranks' words in rank order in fp32 (one shot, bit-identical on every rank).
// ll_reduce_scatter<T>: p.count = C elements per rank (the output; the input holds num_ranks slices
// of C). Rank `me` sends peer p only slice p of its input, as lines into ll[parity][me][w] of peer p
// (w < ceil(C * sizeof(T) / 4)), then sums slice `me` over all ranks in rank order in fp32: its own
// words read from `in`, peer r's from ll[parity][r]. Each rank sends (n - 1) slices and receives
// (n - 1), one line per word; the per-source region holds one slice, so C * sizeof(T) <= ll_bytes.
// In place (out == in + me * C) is safe: slice `me` of `in` is read only by this rank, word w only by
// the thread that then writes word w of out, and the pushes read only the other slices.
// Inputs and outputs need no alignment (partial and unaligned words are read and written bytewise;
// a word never reaches past its slice, so slices of 2-byte elements at odd counts are fine).
#pragma once

#include "tdist/kernels/collectives/common.cuh"

namespace tdist::kernels::coll {

TDIST_DEVICE u32 load_word(const char* base, u64 bytes, u64 w) {
  const u64 off = w * 4;
  const char* p = base + off;
  if (off + 4 <= bytes && (reinterpret_cast<u64>(p) & 3) == 0) return *reinterpret_cast<const u32*>(p);
  u32 v = 0;
  for (u64 i = 0; i < 4 && off + i < bytes; ++i) v |= static_cast<u32>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

TDIST_DEVICE void store_word(char* base, u64 bytes, u64 w, u32 v) {
  const u64 off = w * 4;
  char* p = base + off;
  if (off + 4 <= bytes && (reinterpret_cast<u64>(p) & 3) == 0) {
    *reinterpret_cast<u32*>(p) = v;
    return;
  }
  for (u64 i = 0; i < 4 && off + i < bytes; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

TDIST_DEVICE u64* ll_region(const CollParams& p, u64 parity, int src) {
  return reinterpret_cast<u64*>(p.ll) + (parity * p.heap.num_ranks + src) * p.ll_words;
}

// Spins until the line carries `flag`; returns its data word. Times out with a diagnostic.
TDIST_DEVICE u32 ll_read(const u64* line, u32 flag) {
  u64 v = ld_relaxed<Scope::kSystem>(line);
  if (static_cast<u32>(v >> 32) != flag) {
    SpinDeadline deadline;
    do {
      v = ld_relaxed<Scope::kSystem>(line);
      if (static_cast<u32>(v >> 32) == flag) return static_cast<u32>(v);
    } while (!deadline.expired());
    wait_timed_out("ll_read", WaitSite::kLlRead, line, Cmp::kEq, flag, static_cast<u64>(v >> 32));
  }
  return static_cast<u32>(v);
}

TDIST_DEVICE void ll_push(const CollParams& p, u64 parity, u64 w, u32 word, u32 flag) {
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 line = (static_cast<u64>(flag) << 32) | word;
  u64* mine = ll_region(p, parity, me) + w;
  for (int k = 1; k < n; ++k) st_relaxed<Scope::kSystem>(p.heap.symm_at(mine, (me + k) % n), line);
}

// Word w of the reduction (AllReduce, ReduceScatter): the elements of every rank's word w summed in
// fp32 in rank order, so every rank gets the same bits, then packed back into T. Peer r's word is
// ll[parity][r][w]; this rank's comes from own_word(), called at its turn in the rank order (the
// caller's own data, which needs no line).
template <typename T, typename OwnWord>
TDIST_DEVICE u32 ll_reduce_word(const CollParams& p, int n, int me, u64 parity, u64 w, u32 flag, OwnWord own_word) {
  constexpr int kPer = 4 / sizeof(T);
  float acc[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc[j] = 0.f;
  for (int r = 0; r < n; ++r) {
    const u32 v = r == me ? own_word() : ll_read(ll_region(p, parity, r) + w, flag);
    const T* el = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] += to_f32(el[j]);
  }
  u32 result;
  T* rel = reinterpret_cast<T*>(&result);
#pragma unroll
  for (int j = 0; j < kPer; ++j) rel[j] = from_f32<T>(acc[j]);
  return result;
}

__global__ void __launch_bounds__(kThreads, 1) tdist_ll_all_gather(CollParams p) {
  const u64 e = begin_call(p.epoch);
  const u32 flag = static_cast<u32>(e);
  const u64 parity = e & 1;
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 B = p.count, W = (B + 3) / 4;
  const u64 g = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x, G = static_cast<u64>(gridDim.x) * blockDim.x;
  const char* in = static_cast<const char*>(p.in);
  char* out = static_cast<char*>(p.out);
  for (u64 w = g; w < W; w += G) {
    const u32 word = load_word(in, B, w);
    ll_push(p, parity, w, word, flag);
    if (out + me * B != in) store_word(out + me * B, B, w, word);
  }
  for (int k = 1; k < n; ++k) {
    const int src = (me + k) % n;
    const u64* lines = ll_region(p, parity, src);
    for (u64 w = g; w < W; w += G) store_word(out + src * B, B, w, ll_read(lines + w, flag));
  }
  end_call(p.epoch, e);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ll_all_reduce(CollParams p) {
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 B = p.count * sizeof(T), W = (B + 3) / 4;
  const u64 g = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x, G = static_cast<u64>(gridDim.x) * blockDim.x;
  const char* in = static_cast<const char*>(p.in);
  // The first word (the only one up to the LL window), loaded before the epoch so that the two
  // loads are in flight together; after the prior kernel, which may have written it.
  wait_for_prior_grid();
  const u32 word0 = g < W ? load_word(in, B, g) : 0;
  const u64 e = begin_call(p.epoch);
  const u32 flag = static_cast<u32>(e);
  const u64 parity = e & 1;
  for (u64 w = g; w < W; w += G) {
    const u32 word = w == g ? word0 : load_word(in, B, w);
    ll_push(p, parity, w, word, flag);
    const u32 sum = ll_reduce_word<T>(p, n, me, parity, w, flag, [word] { return word; });
    store_word(static_cast<char*>(p.out), B, w, sum);
  }
  end_call(p.epoch, e);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ll_reduce_scatter(CollParams p) {
  const u64 e = begin_call(p.epoch);
  const u32 flag = static_cast<u32>(e);
  const u64 parity = e & 1;
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 B = p.count * sizeof(T), W = (B + 3) / 4;
  const u64 g = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x, G = static_cast<u64>(gridDim.x) * blockDim.x;
  const char* in = static_cast<const char*>(p.in);
  // Every push first (no read waits between them), then the reduction of this rank's slice.
  u64* mine = ll_region(p, parity, me);
  for (u64 w = g; w < W; w += G) {
    for (int k = 1; k < n; ++k) {
      const int peer = (me + k) % n;
      const u64 line = (static_cast<u64>(flag) << 32) | load_word(in + peer * B, B, w);
      st_relaxed<Scope::kSystem>(p.heap.symm_at(mine + w, peer), line);
    }
  }
  const char* own = in + me * B;
  char* out = static_cast<char*>(p.out);
  for (u64 w = g; w < W; w += G) {
    const u32 sum = ll_reduce_word<T>(p, n, me, parity, w, flag, [&] { return load_word(own, B, w); });
    store_word(out, B, w, sum);
  }
  end_call(p.epoch, e);
}

}  // namespace tdist::kernels::coll
