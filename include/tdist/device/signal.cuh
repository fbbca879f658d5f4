// Flags between ranks: waiting for them (acquire) and raising them (release).
//
// Ordering contract:
//   - notify / signal_op write the flag with release semantics at scope S: every load and store
//     the calling thread made before it (and, by cumulativity, every access other threads made
//     before a barrier the caller passed, e.g. __syncthreads) is visible to whoever later observes
//     the flag with acquire semantics. Set is st.release.S, add is red.release.S.
//   - signal_wait_until / wait read the flag with ld.acquire.S: no load or store of the calling
//     thread after the wait is performed before the flag was seen. After wait_block every thread of
//     the block is ordered after the wait (bar.sync extends the ordering to the block).
//   - The default scope is system, right for flags written over NVLink by another GPU. Use
//     Scope::kGpu only for flags that never leave one GPU.
// Flags are u32 or u64 and never reset by these calls: give each use a new value (a call count, an
// epoch) and compare with Cmp::kGe, which also tolerates a peer that runs ahead.
#pragma once

#include "tdist/device/memory_order.cuh"
#include "tdist/device/symmetric.cuh"
#include "tdist/device/timeout.cuh"

namespace tdist::device {

// Proof that a wait completed; feed it to consume_token to make addresses depend on the wait.
struct Token {
  u64 value;
};

// Spins (calling thread only) until `cmp(*flag, value)` holds, reading with acquire at scope S.
// Returns the value seen. Times out with a diagnostic (timeout.cuh); after an abort it returns
// the last value seen, which need not satisfy `cmp`.
template <Scope S = Scope::kSystem, typename T>
TDIST_DEVICE T signal_wait_until(const T* flag, Cmp cmp, T value) {
  T seen = ld_acquire<S>(flag);
  if (compare(seen, cmp, value)) return seen;
  SpinDeadline deadline;
  do {
    // Poll relaxed, then confirm with one acquire: cheaper than an acquire per poll.
    seen = ld_relaxed<S>(flag);
    if (compare(seen, cmp, value)) return ld_acquire<S>(flag);
  } while (!deadline.expired());
  wait_timed_out("signal_wait_until", WaitSite::kSignalWaitUntil, flag, cmp, static_cast<u64>(value), static_cast<u64>(seen));
  return seen;
}

// Calling thread waits until each of flags[0, n) satisfies `cmp(flag, value)` (default >=).
template <Scope S = Scope::kSystem, typename T>
TDIST_DEVICE Token wait(const T* flags, int n, T value, Cmp cmp = Cmp::kGe) {
  u64 acc = 0;
  for (int i = 0; i < n; ++i) acc += static_cast<u64>(signal_wait_until<S>(flags + i, cmp, value));
  return Token{acc};
}

// The block's threads share the n flags, then meet at __syncthreads. Every thread of the block must
// call it. All threads are ordered after all n flags.
template <Scope S = Scope::kSystem, typename T>
TDIST_DEVICE Token wait_block(const T* flags, int n, T value, Cmp cmp = Cmp::kGe) {
  u64 acc = 0;
  const int num_threads = blockDim.x * blockDim.y * blockDim.z;
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  for (int i = tid; i < n; i += num_threads) acc += static_cast<u64>(signal_wait_until<S>(flags + i, cmp, value));
  __syncthreads();
  return Token{acc};
}

// Raises the flag at `flag` (a local or an already translated peer address) with release at S.
template <Scope S = Scope::kSystem, typename T>
TDIST_DEVICE void notify(T* flag, T value, SignalOp op = SignalOp::kSet) {
  if (op == SignalOp::kSet)
    st_release<S>(flag, value);
  else
    red_add<S>(flag, value);
}

// notify on `peer`'s copy of the symmetric flag `flag` (a pointer into this rank's heap).
// Traps with a message when the peer is not load/store reachable.
template <Scope S = Scope::kSystem, typename T>
TDIST_DEVICE void signal_op(const SymmetricHeapView& heap, T* flag, T value, SignalOp op, int peer) {
  T* remote = heap.symm_at(flag, peer);
  if (remote == nullptr) {
    printf("tdist: signal_op on rank %d: peer %d is not load/store reachable (LSA team of %d)\n", heap.rank, peer,
           heap.lsa_size);
    __trap();
  }
  notify<S>(remote, value, op);
}

// Returns `ptr` with an artificial data dependency on a completed wait. The acquire already orders
// the hardware, and the asm volatile with a memory clobber stops the compiler from moving ordinary
// loads above the wait; consume_token is for addresses the compiler could compute and load early
// through paths it treats as invariant (ld.global.nc / __ldg, restrict-qualified, TMA descriptors
// fed from registers), which now cannot be issued before the token exists.
template <typename T>
TDIST_DEVICE T* consume_token(T* ptr, Token token) {
  u64 address = reinterpret_cast<u64>(ptr);
  asm volatile(
      "{\n\t.reg .u64 zero;\n\t"
      "and.b64 zero, %1, 0;\n\t"
      "add.u64 %0, %0, zero;\n\t}"
      : "+l"(address)
      : "l"(token.value)
      : "memory");
  return reinterpret_cast<T*>(address);
}

}  // namespace tdist::device
