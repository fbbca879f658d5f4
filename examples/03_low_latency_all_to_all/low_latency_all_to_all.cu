// Tutorial 3: the low-latency all-to-all of MoE dispatch. Compiled at run time by tdist's JIT (NVRTC).
//
// Each rank holds tokens, each routed to a few experts; expert e lives on rank e / experts_per_rank.
// The host has already laid the rows out by expert (one row per (token, expert) pair, rows of
// expert 0 first, then expert 1, ...) and counted them per expert (`send_splits`). One kernel
// call sends every destination rank its rows and their per-expert counts, and waits until every
// source's rows for this call have arrived here. One block per peer, one put and one flag per
// peer: the latency is about one NVLink round trip, whatever the world size.
//
// Symmetric buffers (same offset on every rank), two of everything, used by call parity:
//   recv_rows    u8 [2][num_ranks][rows_per_source][row_bytes]  [p][s]: rows from rank s, grouped by
//                                                                 this rank's local experts
//   recv_splits  i32[2][num_ranks][experts_per_rank]             [p][s][e]: how many of those rows
//                                                                 are for local expert e
//   arrived      u64[2][num_ranks]                               [p][s] = call once [p][s] of both
//                                                                 buffers hold call `call`'s data
// Call k (k = 1, 2, 3, ...) uses parity p = k % 2 and raises flags to k; nothing is ever reset.
//
// Why two buffers. Rank s may start call k + 1 as soon as it has received everything of call k,
// even though a receiver d may still be reading call k's rows (its consumer runs after this
// kernel in d's stream). With one buffer, s would overwrite them. With two, s's call k + 1 writes
// the other parity, and its call k + 2, which would write this one again, cannot start before s has
// received d's call k + 1 rows - which d sends only once its stream has moved past call k's
// consumer. So a sender is never more than one call ahead of any receiver, and >= call on the
// flags is exact.
#include <tdist/device.cuh>

using namespace tdist::device;

// Grid: num_ranks blocks. Block j sends to rank + j and receives from rank - j (j = 0 is this rank).
__global__ void all_to_all_dispatch(SymmetricHeapView heap, const unsigned char* send_rows, const int* send_splits,
                                    unsigned char* recv_rows, int* recv_splits, u64* arrived, u64 row_bytes,
                                    u64 rows_per_source, int experts_per_rank, u64 call) {
  const int n = heap.num_ranks, rank = heap.rank;
  const int dst = (rank + static_cast<int>(blockIdx.x)) % n;
  const int src = (rank + n - static_cast<int>(blockIdx.x)) % n;
  const u64 parity = call & 1;

  // dst's rows are those of experts [dst * experts_per_rank, (dst + 1) * experts_per_rank): they
  // follow every row of the experts before them.
  __shared__ u64 first_row, row_count;
  if (threadIdx.x == 0) {
    u64 before = 0, count = 0;
    for (int e = 0; e < dst * experts_per_rank; ++e) before += send_splits[e];
    for (int e = dst * experts_per_rank; e < (dst + 1) * experts_per_rank; ++e) count += send_splits[e];
    if (count > rows_per_source) {
      printf("all_to_all_dispatch: rank %d sends %llu rows to rank %d, its receive slot holds %llu\n", rank, count, dst,
             rows_per_source);
      __trap();
    }
    first_row = before;
    row_count = count;
  }
  __syncthreads();

  // Our slot on dst: [parity][rank]. The counts, then the rows with the flag. The block meets at a
  // barrier inside putmem_signal_block before one thread raises the flag with release, so the flag
  // covers both puts: dst never sees the flag without the counts and rows of this call.
  const u64 slot = parity * n + rank;
  putmem_nbi_block(heap, recv_splits + slot * experts_per_rank, send_splits + dst * experts_per_rank,
                   experts_per_rank * sizeof(int), dst);
  putmem_signal_block(heap, recv_rows + slot * rows_per_source * row_bytes, send_rows + first_row * row_bytes,
                      row_count * row_bytes, arrived + slot, call, SignalOp::kSet, dst);

  // Wait for src's rows of this call (acquire). When every block has passed, all sources are here
  // and work after this kernel in the stream (the expert GEMM; here a copy) may read them.
  wait_block(arrived + parity * n + src, 1, call);
}
