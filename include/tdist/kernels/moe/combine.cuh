// The MoE ops' top-k weighted reduce ("combine"): every token's rows of the grouped GEMM's output,
// weighted by the router and summed over top-k in fp32, plus the partials other ranks reduced for
// the same tokens. Plain C++ above the kernels (host, nvcc, NVRTC).
//
// moe_combine runs after the grouped GEMM, on the caller's stream: a range of tokens, every column,
// into one output (MoE grouped GEMM + ReduceScatter / AllReduce, src/ops/overlap/moe_ops.cpp).
#pragma once

#include "tdist/kernels/moe/common.cuh"

namespace tdist::kernels::moe {

constexpr u32 kMoeCopyThreads = 256;  // the combine kernel: a warp per (token, columns)
// The combine's shape (bench/moe_combine.cu times the other choices): 16-byte column vectors per lane
// per work item, pairs' loads in flight per warp, and blocks per SM, which the launch bounds keep
// room for (registers) and the grid holds at most, so that every block of the grid-stride loop is
// resident from the start (no second, thinner wave). Four blocks with two pairs in flight beat three
// with four (one H200, top-2 to top-8 at 1024 to 16384 tokens: 0-9 % faster): more warps hide the
// gathers' latency better than more loads per warp.
constexpr u32 kCombineCols = 2;
constexpr u32 kCombinePairs = 2;
constexpr u32 kCombineBlocksPerSm = 4;

// out[i][c] = sum_k weight[t][k] d_rows[row_of_pair[t][k]][c] + sum_s extra[s][i][c], in fp32, for the
// tokens t = first_token + i, i < tokens (extra: received partials of the same rows, row stride n).
struct CombineParams {
  const void* d_rows;      // T[capacity][n], expert order
  const int* row_of_pair;  // int32[M][topk]
  const float* weights;    // fp32[M][topk]
  const void* extra[kMaxMoeRanks];
  int num_extra;
  void* out;  // T[tokens][n]
  u64 first_token, tokens;
  u32 topk, n;
};

// The combine's work items: (token, 32 kCols column vectors of its n / 8), a warp each.
TDIST_HOST_DEVICE u64 combine_items(u64 tokens, u32 n, u32 cols = kCombineCols) {
  return tokens * ((n / 8 + 32 * cols - 1) / (32 * cols));
}
// Its grid: a block of kMoeCopyThreads per kMoeCopyThreads / 32 items, blocks_per_sm per SM at most.
TDIST_HOST_DEVICE u32 combine_grid(u64 tokens, u32 n, u32 num_sms, u32 cols = kCombineCols,
                                   u32 blocks_per_sm = kCombineBlocksPerSm) {
  constexpr u64 kWarps = kMoeCopyThreads / 32;
  const u64 blocks = (combine_items(tokens, n, cols) + kWarps - 1) / kWarps, cap = u64{num_sms} * blocks_per_sm;
  return static_cast<u32>(blocks < cap ? blocks : cap);
}

}  // namespace tdist::kernels::moe

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tdist/device/grid_dependency.cuh"
#include "tdist/kernels/collectives/common.cuh"  // to_f32 / from_f32

namespace tdist::kernels::moe {

// Two 16-bit elements of a 32-bit word to fp32, and back, by value (a reinterpret_cast of a vector
// register's address would put the vector in local memory).
__device__ __forceinline__ float lo_f32(u32 bits, __nv_bfloat16) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float hi_f32(u32 bits, __nv_bfloat16) { return __uint_as_float(bits & 0xffff0000u); }
__device__ __forceinline__ float lo_f32(u32 bits, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xffffu)));
}
__device__ __forceinline__ float hi_f32(u32 bits, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits >> 16)));
}
__device__ __forceinline__ u32 bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ u32 bits_of(__half v) { return __half_as_ushort(v); }
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  return bits_of(coll::from_f32<T>(lo)) | (bits_of(coll::from_f32<T>(hi)) << 16);
}

// Adds w x (8 elements of T in a 16-byte vector) to acc.
template <typename T>
__device__ __forceinline__ void add_scaled(float* acc, float w, const uint4& x) {
  const u32 words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] += w * lo_f32(words[j], T{});
    acc[2 * j + 1] += w * hi_f32(words[j], T{});
  }
}

// Sums, in fp32, weight x row over the top-k pairs of `token` (p's rows and weights), the 16-byte
// column vectors v0 + 32 c + lane (c < kCols) below v_end, into acc[c]: the pairs' (row, weight) are
// loaded by lanes 0 .. 31 (32 pairs at a time) and broadcast, kPairs pairs' loads in flight at once.
template <typename T, u32 kCols, u32 kPairs>
__device__ __forceinline__ void sum_pairs(const CombineParams& p, u64 token, u32 v0, u32 v_end, u32 lane,
                                          float (&acc)[kCols][8]) {
  const T* d_rows = static_cast<const T*>(p.d_rows);
  const u64 pair0 = token * p.topk;
#pragma unroll
  for (u32 c = 0; c < kCols; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[c][j] = 0.0f;
  for (u32 k0 = 0; k0 < p.topk; k0 += 32) {
    const u32 kn = p.topk - k0 < 32 ? p.topk - k0 : 32;
    const int my_row = lane < kn ? p.row_of_pair[pair0 + k0 + lane] : 0;
    const float my_w = lane < kn ? p.weights[pair0 + k0 + lane] : 0.0f;
    for (u32 kk = 0; kk < kn; kk += kPairs) {
      uint4 x[kPairs][kCols];
      float w[kPairs];
#pragma unroll
      for (u32 u = 0; u < kPairs; ++u) {
        const u64 row = static_cast<u64>(__shfl_sync(0xffffffffu, my_row, (kk + u) % 32));
        w[u] = __shfl_sync(0xffffffffu, my_w, (kk + u) % 32);
        const uint4* src = reinterpret_cast<const uint4*>(d_rows + row * p.n);
#pragma unroll
        for (u32 c = 0; c < kCols; ++c) {
          const u32 v = v0 + c * 32 + lane;
          x[u][c] = kk + u < kn && v < v_end ? src[v] : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (u32 u = 0; u < kPairs; ++u)
#pragma unroll
        for (u32 c = 0; c < kCols; ++c)
          if (kk + u < kn) add_scaled<T>(acc[c], w[u], x[u][c]);
    }
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&a)[8]) {
  return make_uint4(pack2<T>(a[0], a[1]), pack2<T>(a[2], a[3]), pack2<T>(a[4], a[5]), pack2<T>(a[6], a[7]));
}

// A warp per work item (token i, 32 kCols column vectors): sum_pairs, then p's extra partials,
// stored to row i of p.out. Items rather than whole tokens keep the warps evenly loaded when tokens
// are few (M = 4096, n = 2048: 16384 items). The grid: kBlocksPerSm blocks per SM at most.
template <typename T, u32 kCols = kCombineCols, u32 kPairs = kCombinePairs, u32 kBlocksPerSm = kCombineBlocksPerSm>
__global__ void __launch_bounds__(kMoeCopyThreads, kBlocksPerSm) moe_combine(CombineParams p) {
  constexpr u32 kWarps = kMoeCopyThreads / 32, kItemVectors = 32 * kCols;
  const u32 lane = threadIdx.x % 32, vectors = p.n / 8;
  const u32 chunks = (vectors + kItemVectors - 1) / kItemVectors;
  const u64 items = combine_items(p.tokens, p.n, kCols);
  device::wait_for_prior_grid();  // the grouped GEMM's rows, or the partials' arrival (a flag wait kernel)
  device::allow_dependent_launch();
  for (u64 item = static_cast<u64>(blockIdx.x) * kWarps + threadIdx.x / 32; item < items;
       item += static_cast<u64>(gridDim.x) * kWarps) {  // warp-uniform: every lane shuffles
    const u64 i = item / chunks;
    const u32 v0 = static_cast<u32>(item % chunks) * kItemVectors;
    float acc[kCols][8];
    sum_pairs<T, kCols, kPairs>(p, p.first_token + i, v0, vectors, lane, acc);
#pragma unroll
    for (int s = 0; s < static_cast<int>(kMaxMoeRanks); ++s) {  // constant indices keep p.extra in the parameters
      if (s >= p.num_extra) break;
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.extra[s]) + i * p.n);
      uint4 x[kCols];
#pragma unroll
      for (u32 c = 0; c < kCols; ++c) {
        const u32 v = v0 + c * 32 + lane;
        x[c] = v < vectors ? src[v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (u32 c = 0; c < kCols; ++c) add_scaled<T>(acc[c], 1.0f, x[c]);
    }
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + i * p.n);
#pragma unroll
    for (u32 c = 0; c < kCols; ++c) {
      const u32 v = v0 + c * 32 + lane;
      if (v < vectors) out[v] = pack8<T>(acc[c]);
    }
  }
}

}  // namespace tdist::kernels::moe
#endif
