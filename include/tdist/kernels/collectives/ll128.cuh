// LL128 protocol for messages from a few hundred KB to about a megabyte: like LL (ll.cuh), data and
// flag travel together and the receiver needs no separate flag, fence or round trip, but a line is
// 128 bytes, 120 of payload and an 8-byte flag (the call's epoch), so it carries 94 % payload
// instead of LL's 50 %.
//
// Why a flag at the end of 128 bytes is enough: eight consecutive lanes of one warp write a line with
// one 16-byte vector store each, issued as one instruction; on NVLink such a 128-byte aligned warp
// store reaches the peer's memory as one transaction, and the receiver reads the line back the same
// way, so a reader that sees the flag sees the data of the same store (NCCL's LL128 protocol rests on
// the same property of NVLink GPUs). Lane 8j + 7 carries bytes 112-119 of line j and the flag.
//
// Buffer (symmetric, per rank): ll128[parity][src][line][16 u64], parity = epoch & 1,
// p.ll128_lines lines per source; line L holds bytes [120 L, 120 L + 120) of rank src's message.
// Reuse follows LL's argument: a rank writes parity (e & 1) again at call e + 2 only after its call
// e + 1 read every line of every peer's call e + 1, which began after the peer had read all of call e.
// A line of an older call, or one of a longer message left past this one's end, carries another epoch.
//
// ll128_all_reduce<T>: p.count = elements. Every rank pushes its whole input to every peer, then sums
// all ranks' payloads in rank order in fp32 (one shot, bit-identical on every rank, the same sums as
// ll_all_reduce). Warp w of the grid owns lines 4w..4w+3 of every 4 x warps; the lane that pushes a
// 16-byte part later reduces and writes the same part, so in place (out == in) is safe. Inputs and
// outputs need no alignment (parts off 8-byte alignment or past the end go bytewise).
#pragma once

#include "tdist/kernels/collectives/common.cuh"

namespace tdist::kernels::coll {

constexpr u64 kLl128LineBytes = 128;
constexpr u64 kLl128Payload = 120;  // bytes of message per line
constexpr u64 kLl128LineWords = kLl128LineBytes / 8;
constexpr u64 kLl128LinesPerWarp = 4;  // 32 lanes x 16 bytes
constexpr int kLl128Threads = 128;     // per block
constexpr int kLl128BlocksPerSm = 6;   // the most blocks per SM a launch uses (all resident)

TDIST_HOST_DEVICE constexpr u64 ll128_lines(u64 bytes) { return (bytes + kLl128Payload - 1) / kLl128Payload; }

}  // namespace tdist::kernels::coll

#if defined(__CUDACC__)
namespace tdist::kernels::coll {

// Plain (volatile) 16-byte accesses: one instruction per lane, so a warp covers whole lines at once.
TDIST_DEVICE void st_line_part(u64* p, u64 a, u64 b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
TDIST_DEVICE void ld_line_part(const u64* p, u64& a, u64& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

TDIST_DEVICE u64* ll128_region(const CollParams& p, u64 parity, int src) {
  return reinterpret_cast<u64*>(p.ll128) + (parity * p.heap.num_ranks + src) * p.ll128_lines * kLl128LineWords;
}

// Bytes [off, off + len) of a message of `bytes` bytes into (a, b) (len 8 or 16), zero past its end.
TDIST_DEVICE void load_part(const char* base, u64 bytes, u64 off, u64 len, u64& a, u64& b) {
  a = b = 0;
  if (off >= bytes) return;
  const char* p = base + off;
  if (off + len <= bytes && (reinterpret_cast<u64>(p) & 7) == 0) {
    a = *reinterpret_cast<const u64*>(p);
    if (len == 16) b = *reinterpret_cast<const u64*>(p + 8);
    return;
  }
  for (u64 i = 0; i < len && off + i < bytes; ++i) {
    const u64 byte = static_cast<unsigned char>(p[i]);
    if (i < 8)
      a |= byte << (8 * i);
    else
      b |= byte << (8 * (i - 8));
  }
}

TDIST_DEVICE void store_part(char* base, u64 bytes, u64 off, u64 len, u64 a, u64 b) {
  if (off >= bytes) return;
  char* p = base + off;
  if (off + len <= bytes && (reinterpret_cast<u64>(p) & 7) == 0) {
    *reinterpret_cast<u64*>(p) = a;
    if (len == 16) *reinterpret_cast<u64*>(p + 8) = b;
    return;
  }
  for (u64 i = 0; i < len && off + i < bytes; ++i) p[i] = static_cast<char>(((i < 8 ? a : b) >> (8 * (i % 8))) & 0xFF);
}

// Warp-collective: every lane calls it. A lane with `valid` reads its part of a line; the warp spins
// until every valid flag lane sees `flag`. Times out with a diagnostic.
TDIST_DEVICE void ll128_read(const u64* part, bool valid, bool flag_lane, u64 flag, u64& a, u64& b) {
  a = b = 0;
  if (valid) ld_line_part(part, a, b);
  bool waiting = valid && flag_lane && b != flag;
  if (!__any_sync(0xFFFFFFFFu, waiting)) return;
  SpinDeadline deadline;
  do {
    if (__any_sync(0xFFFFFFFFu, deadline.expired())) {
      if (waiting) wait_timed_out("ll128_read", WaitSite::kLl128Read, part + 1, Cmp::kEq, flag, b);
      return;  // aborted: the whole warp leaves with what it read
    }
    if (valid) ld_line_part(part, a, b);
    waiting = valid && flag_lane && b != flag;
  } while (__any_sync(0xFFFFFFFFu, waiting));
}

template <typename T>
__global__ void __launch_bounds__(kLl128Threads, kLl128BlocksPerSm) ll128_all_reduce(CollParams p) {
  const int n = p.heap.num_ranks, me = p.heap.rank;
  const u64 B = p.count * sizeof(T), lines = ll128_lines(B);
  const u32 lane = threadIdx.x & 31u, part = lane & 7u;
  const bool flag_lane = part == 7;
  const u64 len = flag_lane ? 8 : 16;  // payload bytes of this lane's part
  const u64 warp = (blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x) / 32;
  const u64 warps = static_cast<u64>(gridDim.x) * blockDim.x / 32;
  const u64 first0 = warp * kLl128LinesPerWarp, stride = warps * kLl128LinesPerWarp;
  const char* in = static_cast<const char*>(p.in);
  // This lane's part of its first line (the only one up to 1 MB at two ranks), loaded before the
  // epoch so that the two loads are in flight together, and kept for the reduction.
  auto own_part = [&](u64 first, u64 own[2]) {
    const u64 line = first + lane / 8;
    own[0] = own[1] = 0;
    if (line < lines) load_part(in, B, line * kLl128Payload + part * 16, len, own[0], own[1]);
  };
  u64 own0[2];
  wait_for_prior_grid();  // the input may be the prior kernel's output
  own_part(first0, own0);
  const u64 e = begin_call(p.epoch);
  const u64 parity = e & 1;
  u64* mine = ll128_region(p, parity, me);
  // Every push first (no read waits between them), then the reduction.
  for (u64 first = first0; first < lines; first += stride) {
    const u64 line = first + lane / 8;
    u64 v[2] = {own0[0], own0[1]};
    if (first != first0) own_part(first, v);
    if (flag_lane) v[1] = e;
    u64* dst = mine + line * kLl128LineWords + part * 2;
    __syncwarp();  // the line's eight lanes store together, in one instruction
    for (int k = 1; k < n; ++k)
      if (line < lines) st_line_part(p.heap.symm_at(dst, (me + k) % n), v[0], v[1]);
  }
  constexpr int kPer = 16 / sizeof(T);
  for (u64 first = first0; first < lines; first += stride) {
    const u64 line = first + lane / 8;
    const bool valid = line < lines;
    u64 own[2] = {own0[0], own0[1]};
    if (first != first0) own_part(first, own);  // before the waits, to hide its latency behind them
    float acc[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] = 0.f;
    for (int r = 0; r < n; ++r) {
      u64 v[2] = {own[0], own[1]};
      if (r != me)
        ll128_read(ll128_region(p, parity, r) + line * kLl128LineWords + part * 2, valid, flag_lane, e, v[0], v[1]);
      if (flag_lane) v[1] = 0;  // the flag, not data
      const T* el = reinterpret_cast<const T*>(v);
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[j] += to_f32(el[j]);
    }
    u64 res[2];
    T* rel = reinterpret_cast<T*>(res);
#pragma unroll
    for (int j = 0; j < kPer; ++j) rel[j] = from_f32<T>(acc[j]);
    if (valid) store_part(static_cast<char*>(p.out), B, line * kLl128Payload + part * 16, len, res[0], res[1]);
  }
  end_call(p.epoch, e);
}

}  // namespace tdist::kernels::coll
#endif
