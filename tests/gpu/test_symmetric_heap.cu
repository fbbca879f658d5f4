// Symmetric heap and host runtime on GPUs: collective allocation (zeroed, same offsets, peer
// reachable), error reporting for mismatched or impossible requests, leak checks over many
// allocate/free and heap create/destroy cycles, and the copy-engine / stream-memory-op helpers.
// Run with tdistrun -n N (N >= 2). Optional argument: number of heap create/destroy cycles.
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "tdist/runtime/stream.hpp"

using namespace tdist;
using tdist::test::MismatchCounter;

namespace {

template <typename Fn>
void expect_error(const std::string& needle, Fn&& fn) {
  try {
    fn();
  } catch (const tdist::Error& e) {
    if (std::string(e.what()).find(needle) == std::string::npos)
      TDIST_FAIL("error message lacks '", needle, "': ", e.what());
    return;
  }
  TDIST_FAIL("expected an error containing '", needle, "', got none");
}

size_t free_device_memory() {
  size_t free_bytes = 0, total = 0;
  TDIST_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

// A reader as the overlapped ops' reduce kernels are: thread 0 of every block acquires the flag
// (system scope), the block meets at a barrier, and every thread then checks its bytes of the put
// against the sender's pattern, counting the bytes that differ.
__global__ void check_after_flag_kernel(const device::u64* flag, device::u64 epoch, const unsigned char* p,
                                        unsigned long long bytes, unsigned long long seed,
                                        unsigned long long* mismatches, unsigned long long* first_bad) {
  if (threadIdx.x == 0) device::signal_wait_until(flag, device::Cmp::kGe, epoch);
  __syncthreads();
  test::check_pattern_kernel_body(p, bytes, seed, 0, mismatches, first_bad);
}

// A producer as the fused GEMM-ReduceScatter's GEMM is: writes the pattern, and the last block to
// finish raises `ready` (release) while the kernel may still be resident.
__global__ void produce_then_publish_kernel(unsigned char* p, unsigned long long bytes, unsigned long long seed,
                                            device::u32* blocks_done, device::u64* ready, device::u64 epoch) {
  test::fill_pattern_kernel_body(p, bytes, seed);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(blocks_done, 1u) + 1 == gridDim.x) device::st_release(ready, epoch);
  }
}

// The side stream's half: waits (one thread) for the producer's flag, as the ops' wait kernels do.
__global__ void wait_ready_kernel(const device::u64* ready, device::u64 epoch) {
  device::signal_wait_until(ready, device::Cmp::kGe, epoch);
}

}  // namespace

int run_all(int argc, char** argv) {
  const int heap_cycles = argc > 1 ? std::atoi(argv[1]) : 1000;
  World world;
  tdist::test::Suite suite(world);
  if (world.world_size() < 2) {
    std::printf("test_symmetric_heap needs at least 2 ranks (tdistrun -n 2)\n");
    return 2;
  }
  const int rank = world.rank(), n = world.world_size(), next = (rank + 1) % n, prev = (rank + n - 1) % n;
  MismatchCounter counter;

  suite.run("host all_gather, barrier, and disagreement reported with every rank's value", [&] {
    const auto values = tdist::test::all_gather_u64(world, "ranks", 1000 + rank);
    for (int r = 0; r < n; ++r) TDIST_CHECK(values[r] == 1000ull + r, "rank ", r, " sent ", values[r]);
    world.barrier("test barrier");
    world.check_same_on_all_ranks("agreed value", "same");
    expect_error("rank 1=1", [&] { world.check_same_on_all_ranks("per-rank value", std::to_string(rank)); });
  });

  suite.run("World around an existing communicator: host collectives through NCCL, a heap on it", [&] {
    World wrapped(world.comm(), std::chrono::milliseconds(30000));
    TDIST_CHECK(wrapped.rank() == rank && wrapped.world_size() == n && wrapped.device() == world.device(),
                "wrapped world is rank ", wrapped.rank(), " of ", wrapped.world_size(), " on GPU ", wrapped.device());
    const auto values = tdist::test::all_gather_u64(wrapped, "nccl path", 77 * rank + 5);
    for (int r = 0; r < n; ++r) TDIST_CHECK(values[r] == 77ull * r + 5, "rank ", r, " sent ", values[r]);
    expect_error("rank 0=0", [&] { wrapped.check_same_on_all_ranks("per-rank value", std::to_string(rank)); });
    SymmetricHeap heap(wrapped, 4ull << 20);
    char* p = heap.allocate_array<char>(1 << 20);
    tdist::test::fill_pattern(p, 1 << 20, 900 + rank);
    tdist::test::sync_all(wrapped, "filled");
    char* copy;
    TDIST_CUDA_CHECK(cudaMalloc(&copy, 1 << 20));
    TDIST_CUDA_CHECK(cudaMemcpy(copy, heap.peer_ptr(p, next), 1 << 20, cudaMemcpyDeviceToDevice));
    counter.expect_pattern(copy, 1 << 20, 900 + next, 0, "peer data through the wrapped world's heap");
    TDIST_CUDA_CHECK(cudaFree(copy));
    tdist::test::sync_all(wrapped, "read");
    heap.free(p);
  });

  {
    SymmetricHeap heap(world, 512ull << 20);

    suite.run("1000 allocate/free cycles: zeroed, same offsets everywhere, reachable from peers, no leak", [&] {
      std::mt19937_64 rng(12345);  // the same sequence on every rank, as collective allocation requires
      std::vector<void*> live;
      const size_t free_before = free_device_memory();
      for (int cycle = 0; cycle < 1000; ++cycle) {
        if (!live.empty() && (rng() % 3 == 0 || live.size() > 24)) {
          const size_t victim = rng() % live.size();
          heap.free(live[victim]);
          live.erase(live.begin() + victim);
          continue;
        }
        const size_t bytes = 1 + rng() % (rng() % 4 == 0 ? (8ull << 20) : 4096);
        const size_t alignment = size_t{1} << (rng() % 13);
        char* p = static_cast<char*>(heap.allocate(bytes, alignment));
        TDIST_CHECK(reinterpret_cast<uintptr_t>(p) % alignment == 0, "allocation ", p, " not aligned to ", alignment);
        const auto offsets =
            tdist::test::all_gather_u64(world, "offsets", p - static_cast<char*>(heap.view().local_base()));
        for (int r = 0; r < n; ++r) TDIST_CHECK(offsets[r] == offsets[0], "rank ", r, " got offset ", offsets[r]);
        if (cycle % 50 == 0) {
          counter.expect_value(p, bytes, 0, "fresh allocation");
          // The peer's copy must be readable through the host-side peer pointer (copy engine).
          tdist::test::fill_pattern(p, bytes, 77 + rank);
          tdist::test::sync_all(world, "filled");
          char* copy;
          TDIST_CUDA_CHECK(cudaMalloc(&copy, bytes));
          TDIST_CUDA_CHECK(cudaMemcpy(copy, heap.peer_ptr(p, next), bytes, cudaMemcpyDeviceToDevice));
          counter.expect_pattern(copy, bytes, 77 + next, 0, "peer copy read through peer_ptr");
          TDIST_CUDA_CHECK(cudaFree(copy));
          tdist::test::sync_all(world, "read");
        }
        live.push_back(p);
      }
      for (void* p : live) heap.free(p);
      TDIST_CHECK(heap.bytes_in_use() == 0, heap.bytes_in_use(), " bytes still in use after freeing everything");
      TDIST_CHECK(heap.largest_free_block() == heap.capacity(), "free space fragmented: largest block ",
                  heap.largest_free_block(), " of ", heap.capacity());
      TDIST_CHECK(free_device_memory() + (2ull << 20) >= free_before, "device memory fell from ", free_before, " to ",
                  free_device_memory());
    });

    suite.run("mismatched sizes across ranks are reported, and the heap stays usable", [&] {
      expect_error("differs across ranks", [&] { heap.allocate(4096 * (rank + 1)); });
      void* p = heap.allocate(4096);
      TDIST_CHECK(heap.bytes_in_use() == 4096, "bytes in use ", heap.bytes_in_use());
      heap.free(p);
    });

    suite.run("bad arguments and exhaustion give clear errors", [&] {
      expect_error("out of memory", [&] { heap.allocate(heap.capacity() + 1); });
      expect_error("'bytes'", [&] { heap.allocate(0); });
      expect_error("'alignment'", [&] { heap.allocate(64, 48); });
      int outside = 0;
      expect_error("'ptr'", [&] { heap.free(&outside); });
      void* p = heap.allocate(1024);
      expect_error("double free", [&] { heap.free(static_cast<char*>(p) + 8); });
      expect_error("'peer'", [&] { heap.peer_ptr(p, n); });
      expect_error("'peer'", [&] { heap.peer_ptr(p, -1); });
      heap.free(p);
      expect_error("TDIST_SYMMETRIC_HEAP_SIZE", [&] { SymmetricHeap::parse_size("12X", "TDIST_SYMMETRIC_HEAP_SIZE"); });
      TDIST_CHECK(SymmetricHeap::parse_size("3G", "x") == (3ull << 30), "3G parsed wrong");
    });

    suite.run("copy-engine put_async / get_async, 1 B to 256 MB, odd offsets", [&] {
      const size_t max_bytes = 256ull << 20;
      char* buf = heap.allocate_array<char>(max_bytes + 64);
      char* local;
      TDIST_CUDA_CHECK(cudaMalloc(&local, max_bytes + 64));
      cudaStream_t stream;
      TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      for (size_t bytes : {size_t{1}, size_t{3}, size_t{4097}, (size_t{1} << 20) + 7, max_bytes}) {
        for (size_t off : {size_t{0}, size_t{5}}) {
          if (off + bytes > max_bytes + 64) continue;
          const auto seeds = tdist::test::all_gather_u64(world, "ce seeds", tdist::test::fresh_seed(rank));
          tdist::test::fill_pattern(local, bytes, seeds[rank]);
          tdist::test::fill_device(buf, 0xCD, max_bytes + 64);
          tdist::test::sync_all(world, "ce ready");
          put_async(heap, buf + off, local, bytes, next, stream);
          TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
          tdist::test::sync_all(world, "ce put done");
          counter.expect_pattern(buf + off, bytes, seeds[prev], 0,
                                 detail::concat("put_async ", bytes, " bytes +", off));
          counter.expect_value(buf, off, 0xCD, "put_async guard");
          // Get the next rank's received data back: it holds this rank's pattern.
          // On the copy's stream: a legacy-stream memset is not ordered before a non-blocking stream.
          TDIST_CUDA_CHECK(cudaMemsetAsync(local, 0xCD, bytes, stream));
          get_async(heap, local, buf + off, bytes, next, stream);
          TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
          counter.expect_pattern(local, bytes, seeds[rank], 0, detail::concat("get_async ", bytes, " bytes +", off));
          tdist::test::sync_all(world, "ce get done");
        }
      }
      expect_error("'dst'", [&] { put_async(heap, local, local, 16, next, stream); });
      TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
      TDIST_CUDA_CHECK(cudaFree(local));
      heap.free(buf);
    });

    suite.run("put_signal_async + stream_wait_value64 order data before the flag; 32-bit waits", [&] {
      const size_t bytes = (64ull << 20) + 11;
      char* buf = heap.allocate_array<char>(bytes);
      device::u64* flag = heap.allocate_signals64(1);
      device::u32* flag32 = heap.allocate_signals32(2);
      char *local, *received;
      TDIST_CUDA_CHECK(cudaMalloc(&local, bytes));
      TDIST_CUDA_CHECK(cudaMalloc(&received, bytes));
      cudaStream_t send, recv;
      TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&send, cudaStreamNonBlocking));
      TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&recv, cudaStreamNonBlocking));
      for (device::u64 epoch = 1; epoch <= 4; ++epoch) {
        const auto seeds = tdist::test::all_gather_u64(world, "sw seeds", tdist::test::fresh_seed(rank));
        tdist::test::fill_pattern(local, bytes, seeds[rank]);
        tdist::test::fill_device(received, 0xCD, bytes);
        tdist::test::sync_all(world, "sw ready");
        // The receiver's copy is queued first and may only run once the flag arrives.
        stream_wait_value64(recv, flag, epoch, StreamWaitCmp::kGe);
        TDIST_CUDA_CHECK(cudaMemcpyAsync(received, buf, bytes, cudaMemcpyDeviceToDevice, recv));
        stream_wait_value32(recv, flag32, static_cast<device::u32>(epoch), StreamWaitCmp::kEq);
        stream_wait_value32(recv, flag32 + 1, 0x1u, StreamWaitCmp::kAnd);
        put_signal_async(heap, buf, local, bytes, flag, epoch, next, send);
        stream_write_value32(send, heap.peer_ptr(flag32, next), static_cast<device::u32>(epoch));
        stream_write_value32(send, heap.peer_ptr(flag32 + 1, next), 0x11u);
        TDIST_CUDA_CHECK(cudaStreamSynchronize(send));
        TDIST_CUDA_CHECK(cudaStreamSynchronize(recv));
        tdist::test::sync_all(world, "sw done");
        counter.expect_pattern(received, bytes, seeds[prev], 0,
                               detail::concat("data copied after the flag, epoch ", epoch));
      }
      expect_error("'address'", [&] { stream_write_value64(send, reinterpret_cast<device::u64*>(buf + 1), 1); });
      TDIST_CUDA_CHECK(cudaStreamDestroy(send));
      TDIST_CUDA_CHECK(cudaStreamDestroy(recv));
      cudaFree(local);
      cudaFree(received);
      heap.free(flag32);
      heap.free(flag);
      heap.free(buf);
    });
    suite.run(
        "put_signal_async seen by kernels: a reader that acquires the flag reads every byte; a source "
        "produced by a running kernel",
        [&] {
          // Sizes of the fused GEMM-ReduceScatter's slots (3000 x 1784 rows halved, bf16) and odd ones.
          const size_t sizes[] = {5352000, 5352000 + 3, (size_t{1} << 20) + 7, 4097, (size_t{64} << 20) + 11};
          const size_t offsets[] = {0, 5, 96};
          const size_t max_bytes = (size_t{64} << 20) + 11 + 96;
          char* buf = heap.allocate_array<char>(max_bytes);
          device::u64* flag = heap.allocate_signals64(1);
          device::u64* ready;
          device::u32* blocks_done;
          char* local;
          TDIST_CUDA_CHECK(cudaMalloc(&local, max_bytes));
          TDIST_CUDA_CHECK(cudaMalloc(&ready, sizeof(device::u64)));
          tdist::test::fill_device(ready, 0, sizeof(device::u64));
          TDIST_CUDA_CHECK(cudaMalloc(&blocks_done, sizeof(device::u32)));
          cudaStream_t produce, send, recv;
          for (cudaStream_t* s : {&produce, &send, &recv})
            TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
          // Loaded now: under lazy loading, a kernel's first launch can wait for the running kernels,
          // which here spin until that kernel has run.
          for (const void* kernel : {reinterpret_cast<const void*>(check_after_flag_kernel),
                                     reinterpret_cast<const void*>(produce_then_publish_kernel),
                                     reinterpret_cast<const void*>(wait_ready_kernel)}) {
            cudaFuncAttributes attributes;
            TDIST_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
          }
          device::u64 epoch = 0;
          for (int produced = 0; produced < 2; ++produced) {
            for (size_t bytes : sizes) {
              for (size_t off : offsets) {
                ++epoch;
                const auto seeds = tdist::test::all_gather_u64(world, "ks seeds", tdist::test::fresh_seed(rank));
                counter.reset();
                tdist::test::fill_device(buf, 0xCD, max_bytes);
                tdist::test::fill_device(blocks_done, 0, sizeof(device::u32));
                if (!produced) tdist::test::fill_pattern(local, bytes, seeds[rank]);
                tdist::test::sync_all(world, "ks ready");
                // The reader is resident and spinning before the put starts.
                check_after_flag_kernel<<<256, 256, 0, recv>>>(flag, epoch, reinterpret_cast<unsigned char*>(buf + off),
                                                               bytes, seeds[prev], counter.mismatches(),
                                                               counter.first_bad());
                TDIST_CUDA_CHECK(cudaGetLastError());
                if (produced) {
                  // The copy is enqueued before its source exists; only the flag orders it after the producer.
                  wait_ready_kernel<<<1, 1, 0, send>>>(ready, epoch);
                  TDIST_CUDA_CHECK(cudaGetLastError());
                  put_signal_async(heap, buf + off, local, bytes, flag, epoch, next, send);
                  produce_then_publish_kernel<<<64, 256, 0, produce>>>(reinterpret_cast<unsigned char*>(local), bytes,
                                                                       seeds[rank], blocks_done, ready, epoch);
                  TDIST_CUDA_CHECK(cudaGetLastError());
                } else {
                  put_signal_async(heap, buf + off, local, bytes, flag, epoch, next, send);
                }
                tdist::test::sync_all(world, "ks done");
                const auto [wrong, first] = counter.read();
                tdist::test::fail_unless_every_rank_clean(
                    world, "ks result", wrong,
                    detail::concat(produced ? "produced source, " : "", bytes, " bytes +", off, ": "),
                    detail::concat(" (first at byte ", first, ")"));
              }
            }
          }
          for (cudaStream_t s : {produce, send, recv}) TDIST_CUDA_CHECK(cudaStreamDestroy(s));
          cudaFree(local);
          cudaFree(ready);
          cudaFree(blocks_done);
          heap.free(flag);
          heap.free(buf);
        });
  }

  suite.run(detail::concat(heap_cycles, " heap create/destroy cycles return device memory to its starting level"), [&] {
    { SymmetricHeap warm_up(world, 64ull << 20); }  // NCCL sets up its window machinery once
    // The free memory is the GPU's: ranks sharing it (TDIST_SHARE_GPUS) measure at the same point.
    world.barrier("heap cycles start");
    const size_t free_before = free_device_memory();
    const auto start = std::chrono::steady_clock::now();
    for (int cycle = 0; cycle < heap_cycles; ++cycle) {
      SymmetricHeap heap(world, 64ull << 20);
      void* p = heap.allocate(1 << 20);
      heap.free(p);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    world.barrier("heap cycles done");
    const size_t free_after = free_device_memory();
    std::printf("heap cycles: %d in %.1f s; free device memory %zu -> %zu bytes\n", heap_cycles, seconds, free_before,
                free_after);
    TDIST_CHECK(free_after + (2ull << 20) >= free_before, "device memory leaked: ", free_before - free_after,
                " bytes after ", heap_cycles, " cycles");
  });

  return suite.finish();
}

int main(int argc, char** argv) {
  try {
    return run_all(argc, argv);
  } catch (const std::exception& e) {
    std::printf("FAIL test_symmetric_heap stopped: %s\n", e.what());
    return 1;
  }
}
