// Tutorial 4: the core of AllGather-GEMM, C = allgather(A) x B. Compiled at run time by tdist's JIT.
//
// A (M x K, row-major) is split by rows over the ranks (RowChunks, tdist/kernels/gemm/tile_scheduler.cuh); B (K x N,
// row-major) and C (M x N, fp32) are this rank's own. Each rank's chunk of A travels into every rank's `a_gathered`
// (copy-engine puts from the host, or the put_chunk kernel below), and its arrival raises one flag
// per chunk. The GEMM does not wait for the whole gather: each tile waits only for the chunks that
// hold its rows, so the first tiles compute while the rest of A is still on the wire. Tiles start
// at this rank's own chunk, which arrives first (a local copy).
//
// Symmetric buffers (same offset on every rank):
//   a_gathered     T[M][K]         rows [begin(r), begin(r) + rows(r)) written by rank r
//   chunk_arrived  u64[num_ranks]  [r] = call once rank r's chunk of this call is in a_gathered here
//   barrier_pad    u64[num_ranks + 2]  (barrier_pad_words) for start_of_call_barrier
// Calls are numbered 1, 2, 3, ... and flags are raised to the call number; none is ever reset.
//
// Order of one call, on each rank:
//   compute stream:  start_of_call_barrier -> gemm_wait_flags
//   comm stream:     (after the barrier)   -> this rank's chunk into every rank, flag per chunk
// The barrier sits after the previous call's GEMM in stream order, so once every rank has passed
// it, nobody reads the previous call's a_gathered any more and the puts may overwrite it.
#include <cuda_bf16.h>
#include <tdist/device.cuh>

#include <tdist/kernels/gemm/tile_scheduler.cuh>  // RowChunks: the library's row split

using namespace tdist::device;
using tdist::kernels::gemm::RowChunks;

// Tiles: 64 x 64 outputs per block, K in steps of 16. 256 threads as 16 x 16, each computing a
// 4 x 4 set of outputs strided by 16 (so that neighbouring threads read neighbouring shared words).
constexpr int BLOCK_M = 64, BLOCK_N = 64, BLOCK_K = 16;
constexpr int kThreadsPerSide = 16, kThreads = kThreadsPerSide * kThreadsPerSide;
constexpr int kPerThread = BLOCK_M / kThreadsPerSide;  // 4

TDIST_DEVICE float to_float(float x) { return x; }
TDIST_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Persistent tile loop: block b takes tiles b, b + gridDim.x, ... of a tile order that starts at the
// m-tile holding this rank's first row and wraps around. The host keeps gridDim.x at most the SM
// count: a block that waits for a flag holds its SM, and the puts (the put_chunk kernel, when SMs
// move the data) must still find room to run.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    gemm_wait_flags(const T* a_gathered, const T* b, float* c, u64 m, u64 n, u64 k, const u64* chunk_arrived, u64 call,
                    int rank, int num_ranks) {
  __shared__ float a_tile[BLOCK_K][BLOCK_M];  // transposed: a_tile[kk][row]
  __shared__ float b_tile[BLOCK_K][BLOCK_N];
  const RowChunks split{m, num_ranks};
  const u64 tiles_m = (m + BLOCK_M - 1) / BLOCK_M, tiles_n = (n + BLOCK_N - 1) / BLOCK_N;
  const u64 first_tile_m = split.begin(rank) / BLOCK_M;
  const int tx = static_cast<int>(threadIdx.x) % kThreadsPerSide, ty = static_cast<int>(threadIdx.x) / kThreadsPerSide;

  for (u64 tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
    const u64 tile_m = (first_tile_m + tile / tiles_n) % tiles_m, tile_n = tile % tiles_n;
    const u64 m0 = tile_m * BLOCK_M, n0 = tile_n * BLOCK_N;
    const u64 m_end = m0 + BLOCK_M < m ? m0 + BLOCK_M : m;

    // The flag protocol: a tile's rows may straddle chunk boundaries (chunks need not be multiples
    // of BLOCK_M), so wait for every chunk from the one holding row m0 to the one holding the last
    // row. wait_block acquires each flag and ends with __syncthreads: every thread's loads below
    // come after the chunks' puts. Loading through a token-dependent pointer keeps the compiler
    // from hoisting any A load above the wait.
    const int first_chunk = split.chunk_of(m0), last_chunk = split.chunk_of(m_end - 1);
    const Token token = wait_block(chunk_arrived + first_chunk, last_chunk - first_chunk + 1, call);
    const T* a = consume_token(a_gathered, token);

    float acc[kPerThread][kPerThread] = {};
    for (u64 k0 = 0; k0 < k; k0 += BLOCK_K) {
      for (int i = static_cast<int>(threadIdx.x); i < BLOCK_M * BLOCK_K; i += kThreads) {
        const int row = i / BLOCK_K, kk = i % BLOCK_K;  // consecutive threads read consecutive k
        a_tile[kk][row] = m0 + row < m && k0 + kk < k ? to_float(a[(m0 + row) * k + k0 + kk]) : 0.0f;
      }
      for (int i = static_cast<int>(threadIdx.x); i < BLOCK_K * BLOCK_N; i += kThreads) {
        const int kk = i / BLOCK_N, col = i % BLOCK_N;
        b_tile[kk][col] = k0 + kk < k && n0 + col < n ? to_float(b[(k0 + kk) * n + n0 + col]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K; ++kk) {
        float a_frag[kPerThread], b_frag[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) a_frag[i] = a_tile[kk][ty + kThreadsPerSide * i];
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) b_frag[j] = b_tile[kk][tx + kThreadsPerSide * j];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i)
#pragma unroll
          for (int j = 0; j < kPerThread; ++j) acc[i][j] = fmaf(a_frag[i], b_frag[j], acc[i][j]);
      }
      __syncthreads();  // the tiles are overwritten next
    }

#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const u64 row = m0 + ty + kThreadsPerSide * i;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const u64 col = n0 + tx + kThreadsPerSide * j;
        if (row < m && col < n) c[row * n + col] = acc[i][j];
      }
    }
  }
}

// The SM transport. Grid: num_ranks blocks; block j puts this rank's chunk (`chunk_bytes` from the
// local `a_chunk`) at `offset_bytes` into rank + j's a_gathered (j = 0: this rank, so the local
// chunk lands first) and raises chunk_arrived[rank] there with release.
__global__ void put_chunk(SymmetricHeapView heap, unsigned char* a_gathered, const unsigned char* a_chunk,
                          u64 offset_bytes, u64 chunk_bytes, u64* chunk_arrived, u64 call) {
  const int peer = (heap.rank + static_cast<int>(blockIdx.x)) % heap.num_ranks;
  putmem_signal_block(heap, a_gathered + offset_bytes, a_chunk, chunk_bytes, chunk_arrived + heap.rank, call,
                      SignalOp::kSet, peer);
}

// One block per rank: every rank meets. Launched first in each call (see the order above).
__global__ void start_of_call_barrier(SymmetricHeapView heap, u64* barrier_pad) {
  barrier_all_block(heap, barrier_pad);
}
