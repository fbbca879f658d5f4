// Device primitives across ranks: put/get at every scope (blocking and nbi) for sizes from 1 byte to
// 256 MB at odd alignments, put-with-signal ordering, signals with every comparison, gpu-scope
// notify/wait, and barriers. Run with tdistrun -n N (N >= 2), one GPU per rank.
#include <algorithm>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "tdist/runtime/kernel_loading.hpp"

using namespace tdist;
using namespace tdist::device;
using tdist::test::MismatchCounter;

namespace {

constexpr u64 kMaxBytes = 256ull << 20;
constexpr u64 kSlack = 4096;  // room for offsets and guard bytes around each transfer
constexpr u64 kGuard = 64;
constexpr unsigned char kPoison = 0xCD;

enum class Group { kThread, kWarp, kBlock };
enum class Op { kPut, kGet };

const char* group_name(Group g) { return g == Group::kThread ? "thread" : g == Group::kWarp ? "warp" : "block"; }

template <Group G, bool kNbi, Op kOp>
TDIST_DEVICE void one_copy(const SymmetricHeapView& heap, char* dst, const char* src, u64 bytes, int peer) {
  if constexpr (kOp == Op::kPut) {
    if constexpr (G == Group::kThread)
      kNbi ? putmem_nbi_thread(heap, dst, src, bytes, peer) : putmem_thread(heap, dst, src, bytes, peer);
    if constexpr (G == Group::kWarp)
      kNbi ? putmem_nbi_warp(heap, dst, src, bytes, peer) : putmem_warp(heap, dst, src, bytes, peer);
    if constexpr (G == Group::kBlock)
      kNbi ? putmem_nbi_block(heap, dst, src, bytes, peer) : putmem_block(heap, dst, src, bytes, peer);
  } else {
    if constexpr (G == Group::kThread)
      kNbi ? getmem_nbi_thread(heap, dst, src, bytes, peer) : getmem_thread(heap, dst, src, bytes, peer);
    if constexpr (G == Group::kWarp)
      kNbi ? getmem_nbi_warp(heap, dst, src, bytes, peer) : getmem_warp(heap, dst, src, bytes, peer);
    if constexpr (G == Group::kBlock)
      kNbi ? getmem_nbi_block(heap, dst, src, bytes, peer) : getmem_block(heap, dst, src, bytes, peer);
  }
}

template <Group G>
TDIST_DEVICE void unit_of(u64& unit, u64& units) {
  const u64 tid = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  if constexpr (G == Group::kThread) {
    unit = tid;
    units = static_cast<u64>(gridDim.x) * blockDim.x;
  }
  if constexpr (G == Group::kWarp) {
    unit = tid / 32;
    units = static_cast<u64>(gridDim.x) * blockDim.x / 32;
  }
  if constexpr (G == Group::kBlock) {
    unit = blockIdx.x;
    units = gridDim.x;
  }
}

// Each unit (thread, warp or block) moves chunks of `chunk` bytes; chunks are odd-sized, so most
// calls start and end unaligned.
template <Group G, bool kNbi, Op kOp>
__global__ void copy_kernel(SymmetricHeapView heap, char* dst, const char* src, u64 bytes, u64 chunk, int peer) {
  u64 unit, units;
  unit_of<G>(unit, units);
  for (u64 start = unit * chunk; start < bytes; start += units * chunk)
    one_copy<G, kNbi, kOp>(heap, dst + start, src + start, bytes - start < chunk ? bytes - start : chunk, peer);
}

template <Group G>
__global__ void put_signal_kernel(SymmetricHeapView heap, char* dst, const char* src, u64 bytes, u64 chunk, u64* flags,
                                  u64 epoch, int peer) {
  u64 unit, units;
  unit_of<G>(unit, units);
  for (u64 c = unit; c * chunk < bytes; c += units) {
    const u64 start = c * chunk, len = bytes - start < chunk ? bytes - start : chunk;
    if constexpr (G == Group::kThread)
      putmem_signal_thread(heap, dst + start, src + start, len, flags + c, epoch, SignalOp::kSet, peer);
    if constexpr (G == Group::kWarp)
      putmem_signal_warp(heap, dst + start, src + start, len, flags + c, epoch, SignalOp::kSet, peer);
    if constexpr (G == Group::kBlock)
      putmem_signal_block(heap, dst + start, src + start, len, flags + c, epoch, SignalOp::kSet, peer);
  }
}

// Each thread puts its own chunk, completes it with quiet(), then raises its flag with a relaxed
// store: the fence inside quiet() makes the store a release of the thread's puts.
__global__ void put_quiet_flag_kernel(SymmetricHeapView heap, char* dst, const char* src, u64 bytes, u64 chunk,
                                      u64* flags, u64 epoch, int peer) {
  const u64 c = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  if (c * chunk >= bytes) return;
  const u64 start = c * chunk, len = bytes - start < chunk ? bytes - start : chunk;
  putmem_nbi_thread(heap, dst + start, src + start, len, peer);
  quiet();
  st_relaxed<Scope::kSystem>(heap.symm_at(flags + c, peer), epoch);
}

// Waits for each chunk's flag, then reads the chunk (through a token-dependent pointer) into `out`.
__global__ void receive_kernel(const char* data, char* out, u64 bytes, u64 chunk, const u64* flags, u64 epoch) {
  const u64 num_chunks = (bytes + chunk - 1) / chunk;
  for (u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Token token = wait_block(flags + c, 1, epoch);
    const char* ready = consume_token(data, token);
    const u64 start = c * chunk, end = start + chunk < bytes ? start + chunk : bytes;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) out[i] = ready[i];
    __syncthreads();
  }
}

// The calling rank's flag is raised by the previous rank; `seen` records what the wait returned.
template <typename T>
__global__ void wait_cmp_kernel(const T* flag, Cmp cmp, T value, T* seen) {
  *seen = signal_wait_until(flag, cmp, value);
}

template <typename T>
__global__ void signal_kernel(SymmetricHeapView heap, T* flag, T value, SignalOp op, int peer) {
  signal_op(heap, flag, value, op, peer);
}

// Every thread adds 1 to counter[0] of every rank, `reps` times.
__global__ void add_all_kernel(SymmetricHeapView heap, u64* counter, int reps) {
  for (int r = 0; r < reps; ++r)
    for (int p = 0; p < heap.num_ranks; ++p) signal_op(heap, counter, u64{1}, SignalOp::kAdd, p);
}

__global__ void wait_threads_kernel(const u64* flags, int n, u64 value, u64* seen_sum) {
  *seen_sum = wait(flags, n, value, Cmp::kGe).value;
}

__global__ void raise_flags_kernel(SymmetricHeapView heap, u64* flags, int n, u64 value, int peer) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) signal_op(heap, flags + i, value, SignalOp::kSet, peer);
}

// Block 0 produces data and notifies at gpu scope; block 1 waits and checks it, `rounds` times. The
// ack flag keeps the producer from overwriting data the consumer has not read.
__global__ void gpu_scope_kernel(u32* data, u64 words, u64* ready, u64* ack, int rounds, unsigned long long* errors) {
  for (int round = 1; round <= rounds; ++round) {
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0 && round > 1) signal_wait_until<Scope::kGpu>(ack, Cmp::kGe, static_cast<u64>(round - 1));
      __syncthreads();
      for (u64 i = threadIdx.x; i < words; i += blockDim.x) data[i] = static_cast<u32>(i * 2654435761u + round);
      __syncthreads();
      if (threadIdx.x == 0) notify<Scope::kGpu>(ready, static_cast<u64>(round));
    } else {
      const Token token = wait_block<Scope::kGpu>(ready, 1, static_cast<u64>(round));
      const u32* ready_data = consume_token(data, token);
      for (u64 i = threadIdx.x; i < words; i += blockDim.x)
        if (ready_data[i] != static_cast<u32>(i * 2654435761u + round)) atomicAdd(errors, 1ull);
      __syncthreads();
      if (threadIdx.x == 0) notify<Scope::kGpu>(ack, static_cast<u64>(round));
    }
  }
}

// Each round every block writes (round, rank) into a cell of every peer, meets at the barrier, checks
// the cells the peers wrote, and meets again before the next round overwrites them.
template <bool kGrid>
__global__ void barrier_kernel(SymmetricHeapView heap, u64* pad, u64* cells, int rounds, unsigned long long* errors) {
  const int n = heap.num_ranks;
  const u64 block = blockIdx.x;
  for (int round = 1; round <= rounds; ++round) {
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      u64* cell = heap.symm_at(cells + block * n + heap.rank, p);
      *cell = static_cast<u64>(round) * 1000 + heap.rank;
    }
    if constexpr (kGrid)
      barrier_all_grid(heap, pad);
    else
      barrier_all_block(heap, pad);
    for (int p = threadIdx.x; p < n; p += blockDim.x)
      if (cells[block * n + p] != static_cast<u64>(round) * 1000 + p) atomicAdd(errors, 1ull);
    if constexpr (kGrid)
      barrier_all_grid(heap, pad);
    else
      barrier_all_block(heap, pad);
  }
}

struct Context {
  World& world;
  SymmetricHeap& heap;
  char* src;
  char* dst;
  MismatchCounter counter;
  int next() const { return (world.rank() + 1) % world.world_size(); }
  int prev() const { return (world.rank() + world.world_size() - 1) % world.world_size(); }
};

u64 odd_chunk(u64 bytes, u64 units) {
  if (bytes <= 4096) return bytes;
  return ((bytes + units - 1) / units) | 1;
}

template <Group G, bool kNbi, Op kOp>
void run_copy(Context& ctx, u64 bytes, u64 dst_off, u64 src_off) {
  const int blocks = 132, threads = 256;
  const u64 units = G == Group::kThread ? blocks * threads : G == Group::kWarp ? blocks * threads / 32 : blocks;
  const u64 seed = tdist::test::fresh_seed(ctx.world.rank());
  const auto seeds = tdist::test::all_gather_u64(ctx.world, "copy seeds", seed);
  tdist::test::fill_device(ctx.dst, kPoison, dst_off + bytes + kGuard);
  tdist::test::fill_pattern(ctx.src, src_off + bytes, seed);
  tdist::test::sync_all(ctx.world, "copy ready");
  // Put: this rank writes the next rank's dst. Get: this rank reads the next rank's src.
  const int peer = ctx.next();
  copy_kernel<G, kNbi, kOp><<<blocks, threads>>>(ctx.heap.view(), ctx.dst + dst_off, ctx.src + src_off, bytes,
                                                 odd_chunk(bytes, units), peer);
  TDIST_CUDA_CHECK(cudaGetLastError());
  tdist::test::sync_all(ctx.world, "copy done");
  const int data_from = kOp == Op::kPut ? ctx.prev() : ctx.next();
  const std::string what =
      tdist::detail::concat(kOp == Op::kPut ? "put" : "get", "_", group_name(G), kNbi ? "_nbi" : "", " of ", bytes,
                            " bytes, dst+", dst_off, " src+", src_off);
  ctx.counter.expect_pattern(ctx.dst + dst_off, bytes, seeds[data_from], src_off, what + " data");
  ctx.counter.expect_value(ctx.dst, dst_off, kPoison, what + " guard before");
  ctx.counter.expect_value(ctx.dst + dst_off + bytes, kGuard, kPoison, what + " guard after");
}

template <Group G>
void run_copy_sweep(Context& ctx, tdist::test::Suite& suite) {
  const std::vector<u64> sizes = {1,        2, 3, 15, 16, 17, 100, 4095, 65543, (1ull << 20) + 3, (16ull << 20) + 9,
                                  kMaxBytes};
  const std::vector<std::pair<u64, u64>> offsets = {{0, 0}, {1, 1}, {5, 13}, {8, 0}, {4, 12}, {2, 6}};
  for (bool nbi : {false, true}) {
    for (Op op : {Op::kPut, Op::kGet}) {
      const std::string name =
          tdist::detail::concat(op == Op::kPut ? "putmem_" : "getmem_", nbi ? "nbi_" : "", group_name(G));
      suite.run(name + " sizes 1 B .. 256 MB, unaligned", [&] {
        for (u64 bytes : sizes) {
          for (auto [dst_off, src_off] : offsets) {
            if (bytes == kMaxBytes && dst_off > 1) continue;  // the largest size once aligned, once not
            if (op == Op::kPut)
              nbi ? run_copy<G, true, Op::kPut>(ctx, bytes, dst_off, src_off)
                  : run_copy<G, false, Op::kPut>(ctx, bytes, dst_off, src_off);
            else
              nbi ? run_copy<G, true, Op::kGet>(ctx, bytes, dst_off, src_off)
                  : run_copy<G, false, Op::kGet>(ctx, bytes, dst_off, src_off);
          }
        }
      });
    }
  }
}

template <Group G>
void run_put_signal(Context& ctx, u64* flags, u64& epoch, char* out, tdist::test::Suite& suite) {
  suite.run(tdist::detail::concat("putmem_signal_", group_name(G), " data visible after the flag"), [&] {
    cudaStream_t receiver, sender;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&receiver, cudaStreamNonBlocking));
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&sender, cudaStreamNonBlocking));
    for (u64 bytes : {u64{1}, u64{4099}, (1ull << 20) + 5, 64ull << 20}) {
      for (int round = 0; round < 3; ++round) {
        ++epoch;  // flags are never reset: each round waits for a larger value
        const u64 chunk = bytes <= 4096 ? bytes : ((bytes / 512) | 1);
        const u64 seed = tdist::test::fresh_seed(ctx.world.rank());
        const auto seeds = tdist::test::all_gather_u64(ctx.world, "signal seeds", seed);
        tdist::test::fill_pattern(ctx.src, bytes, seed);
        tdist::test::fill_device(out, kPoison, bytes);
        tdist::test::sync_all(ctx.world, "signal ready");
        receive_kernel<<<32, 256, 0, receiver>>>(ctx.dst, out, bytes, chunk, flags, epoch);
        put_signal_kernel<G>
            <<<66, 256, 0, sender>>>(ctx.heap.view(), ctx.dst, ctx.src, bytes, chunk, flags, epoch, ctx.next());
        TDIST_CUDA_CHECK(cudaGetLastError());
        tdist::test::sync_all(ctx.world, "signal done");
        ctx.counter.expect_pattern(out, bytes, seeds[ctx.prev()], 0,
                                   tdist::detail::concat("data read after the flag, ", bytes, " bytes, round ", round));
      }
    }
    TDIST_CUDA_CHECK(cudaStreamDestroy(receiver));
    TDIST_CUDA_CHECK(cudaStreamDestroy(sender));
  });
}

void run_put_quiet(Context& ctx, u64* flags, u64& epoch, char* out, tdist::test::Suite& suite) {
  suite.run("putmem_nbi_thread + quiet + relaxed flag store: data visible after the flag", [&] {
    cudaStream_t receiver, sender;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&receiver, cudaStreamNonBlocking));
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&sender, cudaStreamNonBlocking));
    const u64 bytes = (32ull << 20) + 3, chunk = (bytes / 2048) | 1, threads = 256;
    const u64 blocks = ((bytes + chunk - 1) / chunk + threads - 1) / threads;
    for (int round = 0; round < 3; ++round) {
      ++epoch;
      const auto seeds =
          tdist::test::all_gather_u64(ctx.world, "quiet seeds", tdist::test::fresh_seed(ctx.world.rank()));
      tdist::test::fill_pattern(ctx.src, bytes, seeds[ctx.world.rank()]);
      tdist::test::fill_device(out, kPoison, bytes);
      tdist::test::sync_all(ctx.world, "quiet ready");
      receive_kernel<<<32, 256, 0, receiver>>>(ctx.dst, out, bytes, chunk, flags, epoch);
      put_quiet_flag_kernel<<<blocks, threads, 0, sender>>>(ctx.heap.view(), ctx.dst, ctx.src, bytes, chunk, flags,
                                                            epoch, ctx.next());
      TDIST_CUDA_CHECK(cudaGetLastError());
      tdist::test::sync_all(ctx.world, "quiet done");
      ctx.counter.expect_pattern(out, bytes, seeds[ctx.prev()], 0, tdist::detail::concat("round ", round));
    }
    TDIST_CUDA_CHECK(cudaStreamDestroy(receiver));
    TDIST_CUDA_CHECK(cudaStreamDestroy(sender));
  });
}

template <typename T>
void expect_wait(Context& ctx, T* flag, T* seen, T initial, T value, SignalOp op, Cmp cmp, T target, T expect_seen) {
  cudaStream_t waiter, signaler;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&waiter, cudaStreamNonBlocking));
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&signaler, cudaStreamNonBlocking));
  test::copy_to_device(flag, &initial, sizeof(T));
  tdist::test::sync_all(ctx.world, "flag initialised");
  wait_cmp_kernel<T><<<1, 1, 0, waiter>>>(flag, cmp, target, seen);
  signal_kernel<T><<<1, 1, 0, signaler>>>(ctx.heap.view(), flag, value, op, ctx.next());
  TDIST_CUDA_CHECK(cudaGetLastError());
  tdist::test::sync_all(ctx.world, "flag waited");
  T host_seen;
  TDIST_CUDA_CHECK(cudaMemcpy(&host_seen, seen, sizeof(T), cudaMemcpyDeviceToHost));
  if (host_seen != expect_seen)
    TDIST_FAIL("wait ", cmp_name(cmp), " ", static_cast<u64>(target), " after ", op == SignalOp::kSet ? "set " : "add ",
               static_cast<u64>(value), " on ", static_cast<u64>(initial), ": saw ", static_cast<u64>(host_seen),
               ", expected ", static_cast<u64>(expect_seen));
  TDIST_CUDA_CHECK(cudaStreamDestroy(waiter));
  TDIST_CUDA_CHECK(cudaStreamDestroy(signaler));
}

template <typename T>
void run_signal_cmp(Context& ctx, tdist::test::Suite& suite, const char* type) {
  suite.run(tdist::detail::concat("signal_op set/add + signal_wait_until, every comparison, ", type), [&] {
    T* flag = ctx.heap.allocate_array<T>(1);
    T* seen;
    TDIST_CUDA_CHECK(cudaMalloc(&seen, sizeof(T)));
    expect_wait<T>(ctx, flag, seen, 0, 7, SignalOp::kSet, Cmp::kEq, 7, 7);
    expect_wait<T>(ctx, flag, seen, 0, 7, SignalOp::kSet, Cmp::kGe, 5, 7);
    expect_wait<T>(ctx, flag, seen, 0, 7, SignalOp::kSet, Cmp::kGt, 6, 7);
    expect_wait<T>(ctx, flag, seen, 0, 7, SignalOp::kSet, Cmp::kNe, 0, 7);
    expect_wait<T>(ctx, flag, seen, 100, 3, SignalOp::kSet, Cmp::kLt, 10, 3);
    expect_wait<T>(ctx, flag, seen, 100, 3, SignalOp::kSet, Cmp::kLe, 3, 3);
    expect_wait<T>(ctx, flag, seen, 40, 2, SignalOp::kAdd, Cmp::kEq, 42, 42);
    expect_wait<T>(ctx, flag, seen, 40, 2, SignalOp::kAdd, Cmp::kGe, 41, 42);
    TDIST_CUDA_CHECK(cudaFree(seen));
    ctx.heap.free(flag);
  });
}

}  // namespace

int run_all() {
  World world;
  TDIST_CUDA_CHECK(configure_waits(world.rank(), 30.0));
  tdist::test::Suite suite(world);
  if (world.world_size() < 2) {
    std::printf("test_primitives needs at least 2 ranks (tdistrun -n 2)\n");
    return 2;
  }
  // Waiters spin until kernels launched after them run: load all of them up front.
  preload_kernels(receive_kernel, put_signal_kernel<Group::kThread>, put_signal_kernel<Group::kWarp>,
                  put_signal_kernel<Group::kBlock>, wait_cmp_kernel<u32>, wait_cmp_kernel<u64>, signal_kernel<u32>,
                  signal_kernel<u64>, wait_threads_kernel, raise_flags_kernel, barrier_kernel<true>,
                  barrier_kernel<false>, gpu_scope_kernel, add_all_kernel, put_quiet_flag_kernel);
  SymmetricHeap heap(world, 2 * (kMaxBytes + kSlack) + (64ull << 20));
  Context ctx{
      world, heap, heap.allocate_array<char>(kMaxBytes + kSlack), heap.allocate_array<char>(kMaxBytes + kSlack), {}};

  suite.run("the data checker rejects a wrong seed, a shifted index and one flipped byte", [&] {
    tdist::test::fill_pattern(ctx.dst, 4096, 1234);
    ctx.counter.expect_pattern(ctx.dst, 4096, 1234, 0, "control");
    auto must_fail = [&](auto&& check, const char* what) {
      try {
        check();
      } catch (const tdist::Error&) {
        return;
      }
      TDIST_FAIL("the checker accepted ", what);
    };
    must_fail([&] { ctx.counter.expect_pattern(ctx.dst, 4096, 1235, 0, "wrong seed"); }, "a wrong seed");
    must_fail([&] { ctx.counter.expect_pattern(ctx.dst, 4096, 1234, 1, "shifted"); }, "a shifted index");
    tdist::test::fill_device(ctx.dst + 4000, tdist::test::pattern_byte(1234, 4000) ^ 0xFF, 1);
    must_fail([&] { ctx.counter.expect_pattern(ctx.dst, 4096, 1234, 0, "flipped"); }, "a flipped byte");
  });

  run_copy_sweep<Group::kThread>(ctx, suite);
  run_copy_sweep<Group::kWarp>(ctx, suite);
  run_copy_sweep<Group::kBlock>(ctx, suite);

  {
    const u64 max_chunks = 4096;
    u64* flags = heap.allocate_signals64(max_chunks);
    char* out;
    TDIST_CUDA_CHECK(cudaMalloc(&out, 64ull << 20));
    u64 epoch = 0;
    run_put_signal<Group::kThread>(ctx, flags, epoch, out, suite);
    run_put_signal<Group::kWarp>(ctx, flags, epoch, out, suite);
    run_put_signal<Group::kBlock>(ctx, flags, epoch, out, suite);
    run_put_quiet(ctx, flags, epoch, out, suite);
    TDIST_CUDA_CHECK(cudaFree(out));
    heap.free(flags);
  }

  run_signal_cmp<u32>(ctx, suite, "u32");
  run_signal_cmp<u64>(ctx, suite, "u64");

  suite.run("signal_op add from every rank and thread (system-scope atomics)", [&] {
    u64* counter = heap.allocate_signals64(1);
    const int blocks = 8, threads = 128, reps = 50;
    add_all_kernel<<<blocks, threads>>>(heap.view(), counter, reps);
    TDIST_CUDA_CHECK(cudaGetLastError());
    tdist::test::sync_all(world, "adds done");
    u64 total;
    TDIST_CUDA_CHECK(cudaMemcpy(&total, counter, sizeof(total), cudaMemcpyDeviceToHost));
    const u64 expected = static_cast<u64>(world.world_size()) * blocks * threads * reps;
    TDIST_CHECK(total == expected, "counter holds ", total, ", expected ", expected);
    heap.free(counter);
  });

  suite.run("wait (thread) and wait_block on many flags raised by the previous rank", [&] {
    const int n = 37;
    u64* flags = heap.allocate_signals64(n);
    u64* seen;
    TDIST_CUDA_CHECK(cudaMalloc(&seen, sizeof(u64)));
    cudaStream_t waiter, signaler;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&waiter, cudaStreamNonBlocking));
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&signaler, cudaStreamNonBlocking));
    for (u64 epoch = 1; epoch <= 5; ++epoch) {
      wait_threads_kernel<<<1, 1, 0, waiter>>>(flags, n, epoch, seen);
      raise_flags_kernel<<<1, 64, 0, signaler>>>(heap.view(), flags, n, epoch, ctx.next());
      TDIST_CUDA_CHECK(cudaGetLastError());
      tdist::test::sync_all(world, "flags waited");
      u64 sum;
      TDIST_CUDA_CHECK(cudaMemcpy(&sum, seen, sizeof(sum), cudaMemcpyDeviceToHost));
      TDIST_CHECK(sum == epoch * n, "wait returned a token of ", sum, ", expected ", epoch * n);
    }
    TDIST_CUDA_CHECK(cudaStreamDestroy(waiter));
    TDIST_CUDA_CHECK(cudaStreamDestroy(signaler));
    TDIST_CUDA_CHECK(cudaFree(seen));
    heap.free(flags);
  });

  suite.run("notify/wait_block at gpu scope between two blocks, 200 rounds of 4 MB", [&] {
    const u64 words = 1 << 20;
    u32* data;
    u64* flags;
    unsigned long long* errors;
    TDIST_CUDA_CHECK(cudaMalloc(&data, words * sizeof(u32)));
    TDIST_CUDA_CHECK(cudaMalloc(&flags, 2 * sizeof(u64)));
    TDIST_CUDA_CHECK(cudaMalloc(&errors, sizeof(unsigned long long)));
    tdist::test::fill_device(flags, 0, 2 * sizeof(u64));
    tdist::test::fill_device(errors, 0, sizeof(unsigned long long));
    gpu_scope_kernel<<<2, 512>>>(data, words, flags, flags + 1, 200, errors);
    TDIST_CUDA_CHECK(cudaGetLastError());
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
    unsigned long long host_errors;
    TDIST_CUDA_CHECK(cudaMemcpy(&host_errors, errors, sizeof(host_errors), cudaMemcpyDeviceToHost));
    TDIST_CHECK(host_errors == 0, host_errors, " words read stale after the wait");
    cudaFree(data);
    cudaFree(flags);
    cudaFree(errors);
  });

  for (bool grid : {false, true}) {
    suite.run(grid ? "barrier_all_grid, 16 blocks, 300 rounds" : "barrier_all_block, 300 rounds", [&] {
      const int blocks = grid ? 16 : 1, rounds = 300, n = world.world_size();
      u64* pad = heap.allocate_signals64(barrier_pad_words(n));
      u64* cells = heap.allocate_signals64(static_cast<size_t>(blocks) * n);
      unsigned long long* errors;
      TDIST_CUDA_CHECK(cudaMalloc(&errors, sizeof(unsigned long long)));
      tdist::test::fill_device(errors, 0, sizeof(unsigned long long));
      for (int launch = 0; launch < 2; ++launch) {  // a second launch reuses the pad without reset
        if (grid)
          barrier_kernel<true><<<blocks, 128>>>(heap.view(), pad, cells, rounds, errors);
        else
          barrier_kernel<false><<<blocks, 128>>>(heap.view(), pad, cells, rounds, errors);
        TDIST_CUDA_CHECK(cudaGetLastError());
        tdist::test::sync_all(world, "barrier rounds done");
      }
      unsigned long long host_errors;
      TDIST_CUDA_CHECK(cudaMemcpy(&host_errors, errors, sizeof(host_errors), cudaMemcpyDeviceToHost));
      TDIST_CHECK(host_errors == 0, host_errors, " cells held another round's value after the barrier");
      cudaFree(errors);
      heap.free(cells);
      heap.free(pad);
    });
  }

  heap.free(ctx.dst);
  heap.free(ctx.src);
  return suite.finish();
}

int main() {
  try {
    return run_all();
  } catch (const std::exception& e) {
    std::printf("FAIL test_primitives stopped: %s\n", e.what());
    return 1;
  }
}
