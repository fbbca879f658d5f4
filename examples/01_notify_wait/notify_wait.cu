// Tutorial 1: notify and wait. Compiled at run time by tdist's JIT (NVRTC).
//
// Every rank sends one message per round to the next rank of a ring (rank r -> r + 1 mod n) and
// receives one from the previous rank. A message is a payload of `words` u32 plus a one-word
// header. Rounds are numbered 1, 2, 3, ... for the whole life of the program: the round number is
// the value every flag is raised to, so flags never need resetting (CUDA-graph safe).
//
// Symmetric buffers (every rank allocates them alike, so each sits at the same offset of every
// rank's heap; `symm_at(ptr, peer)` turns a local pointer into the peer's copy):
//   mailbox        u32[capacity]  written by the previous rank, read by this rank
//   mailbox_header u64            written by the previous rank: (sender rank << 32) | round
//   ready          u64            raised to `round` by the previous rank once the mailbox holds
//                                 that round's message
//   mailbox_free   u64            raised to `round` by the next rank once it has finished reading
//                                 round `round` from *its* mailbox: this rank may then overwrite it
//
// The two flags form the classic two-way handshake over one buffer:
//   sender (rank r)                               receiver (rank r + 1)
//   wait mailbox_free >= round - 1   (acquire)
//   write payload + header into r+1's mailbox
//   raise ready = round on r + 1     (release) -> wait ready >= round            (acquire)
//                                               read the mailbox
//   wait ...                                 <- raise mailbox_free = round on r (release)
#include <tdist/device.cuh>

using namespace tdist::device;

// One block. Sends round `round`: `words` u32 from the local `payload`, into the next rank's mailbox.
__global__ void ring_send(SymmetricHeapView heap, u32* mailbox, u64* mailbox_header, const u32* payload, u64 words,
                          u64* ready, const u64* mailbox_free, u64 round) {
  const int next = (heap.rank + 1) % heap.num_ranks;

  // 1. The next rank must be done reading the previous round from its mailbox. wait_block acquires
  //    the flag and ends with __syncthreads, so no thread's store below can overtake the reads the
  //    next rank made before releasing the flag. (Round 1 passes at once: flags start at 0.)
  wait_block(mailbox_free, 1, round - 1);

  // 2. The payload: the block's threads share the copy into the peer's mailbox (plain stores over
  //    NVLink through the peer mapping). _nbi: no closing sync; the one in step 3 serves.
  putmem_nbi_block(heap, mailbox, payload, words * sizeof(u32), next);

  // 3. A one-word value: a single store through symm_at, the device API's peer addressing.
  //    Then the release: __syncthreads puts every thread's stores before thread 0's signal, and
  //    signal_op writes the flag with st.release.sys, so a rank that acquires `ready` sees them all.
  __syncthreads();
  if (threadIdx.x == 0) {
    *symm_at(heap, mailbox_header, next) = (static_cast<u64>(heap.rank) << 32) | round;
    signal_op(heap, ready, round, SignalOp::kSet, next);
  }
}

// One block. Receives round `round` from the previous rank into the local `out` (words u32) and
// `out_header`, then hands the mailbox back.
__global__ void ring_receive(SymmetricHeapView heap, const u32* mailbox, const u64* mailbox_header, u64 words,
                             const u64* ready, u64* mailbox_free, u32* out, u64* out_header, u64 round) {
  const int prev = (heap.rank + heap.num_ranks - 1) % heap.num_ranks;

  // 1. Acquire: after wait_block every thread of the block sees what the sender wrote before its
  //    release. The flag is compared with >=, so a value a later round wrote also satisfies it; the
  //    handshake keeps the sender from getting there before this round has been read.
  const Token token = wait_block(ready, 1, round);

  // 2. Read through pointers that depend on the token: the compiler cannot issue these loads
  //    before the wait, even ones it would otherwise treat as invariant (ld.global.nc).
  const u32* message = consume_token(mailbox, token);
  for (u64 i = threadIdx.x; i < words; i += blockDim.x) out[i] = message[i];
  if (threadIdx.x == 0) *out_header = *consume_token(mailbox_header, token);

  // 3. Release the mailbox: every thread's reads come before thread 0's flag (__syncthreads, then
  //    a release store), so the sender's next round cannot overwrite data this block still reads.
  //    notify takes an address already translated with symm_at; signal_op translates it itself.
  __syncthreads();
  if (threadIdx.x == 0) notify(symm_at(heap, mailbox_free, prev), round);
}
