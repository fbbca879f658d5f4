// Tutorial 2: an all-gather written by hand. Compiled at run time by tdist's JIT (NVRTC).
//
// Every rank holds `bytes` bytes of input; afterwards every rank holds all inputs concatenated in
// rank order. Each rank pushes its input into every peer (and into itself) with putmem_signal_block,
// and each transfer raises one flag on the receiver; a rank is done when all flags for this call
// are up. Calls are numbered 1, 2, 3, ...: the call number is the value flags are raised to, so no
// flag is ever reset (no host work between calls: the sequence can be captured in a CUDA graph).
//
// Symmetric buffers (same offset on every rank):
//   gathered   u8[num_ranks * bytes]        rank s's input at [s * bytes, (s + 1) * bytes): the
//                                           concatenation; written by rank s, read by this rank
//   arrived    u64[num_ranks * kMaxChunks]  arrived[s * kMaxChunks + c] = call once chunk c of rank
//                                           s's input has landed here (raised by rank s)
//   may_write  u64[num_ranks]               may_write[d] = call once rank d allows this rank to write
//                                           d's `gathered` for this call (raised by rank d)
//
// Why may_write: `gathered` is one buffer reused by every call. A fast rank starting call k + 1
// must not overwrite a peer's `gathered` while that peer still reads call k's result (here: a copy
// that follows the all-gather in the peer's stream). So each rank first tells every source "you may
// write" from inside the call, which in stream order comes after its readers of call k have
// finished. (Tutorial 3 shows the other remedy: two buffers used by call parity.)
//
// Grid: num_ranks * chunks blocks. Block (step, chunk) sends chunk `chunk` of this rank's input to
// rank + step and receives the same chunk from rank - step. Every block waits for a peer's block,
// so every block of every rank must be resident at once: the host keeps the grid at most one block
// per SM.
#include <tdist/device.cuh>

using namespace tdist::device;

constexpr int kMaxChunks = 16;  // flags per source rank; chunks <= kMaxChunks

__global__ void all_gather(SymmetricHeapView heap, unsigned char* gathered, const unsigned char* input, u64 bytes,
                           int chunks, u64* arrived, u64* may_write, u64 call) {
  const int n = heap.num_ranks, rank = heap.rank;
  const int step = static_cast<int>(blockIdx.x) / chunks, chunk = static_cast<int>(blockIdx.x) % chunks;
  const int dst = (rank + step) % n;      // this block writes into dst
  const int src = (rank + n - step) % n;  // and receives from src

  // This block's chunk of the input: ceil(bytes / chunks) bytes, the last one shorter (or empty).
  const u64 chunk_bytes = (bytes + chunks - 1) / chunks;
  const u64 begin = chunk * chunk_bytes < bytes ? chunk * chunk_bytes : bytes;
  const u64 length = bytes - begin < chunk_bytes ? bytes - begin : chunk_bytes;

  // 1. Let src write our copy of its slot. Everything this rank did with `gathered` before this
  //    launch is complete (stream order), and the release carries that to src.
  if (chunk == 0 && threadIdx.x == 0) signal_op(heap, may_write + rank, call, SignalOp::kSet, src);

  // 2. Wait until dst lets us write (acquire: our stores below come after its earlier reads).
  wait_block(may_write + dst, 1, call);

  // 3. Put the chunk into dst's slot for this rank. putmem_signal_block shares the copy among the
  //    block's threads, meets at __syncthreads, then one thread raises arrived[rank][chunk] on dst
  //    with a release store: whoever acquires the flag sees the whole chunk.
  putmem_signal_block(heap, gathered + rank * bytes + begin, input + begin, length, arrived + rank * kMaxChunks + chunk,
                      call, SignalOp::kSet, dst);

  // 4. Wait for the same chunk from src. When every block has passed this, the whole concatenation
  //    is here, and work after this kernel in the stream may read it.
  wait_block(arrived + src * kMaxChunks + chunk, 1, call);
}
