// Tutorial 2, host side: runs the hand-written all-gather of allgather.cu for several sizes (odd
// byte counts included), several calls back to back per size with no host work in between, and
// compares what every call produced with the concatenation of every rank's input, rebuilt on the host.
//
//   tdistrun -n N -- build/examples/example_02_allgather [--calls=C] [--bytes=B] [--seed=S]
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/tutorial.hpp"
#include "tdist/runtime/symmetric_heap.hpp"

using namespace tdist;
using device::u64;
namespace ex = tdist::examples;

namespace {

constexpr int kMaxChunks = 16;  // as in allgather.cu
constexpr unsigned kThreads = 512;
constexpr u64 kChunkTarget = 256 << 10;  // split inputs into chunks of about this size
constexpr u64 kGuardBytes = 64;          // after the concatenation: must stay poisoned
constexpr unsigned char kPoison = 0xCD;
constexpr uint64_t kInputSeedPurpose = 2;

// `rank`'s input to call `call`: the rank uploads it, every rank's reference rebuilds it.
std::vector<unsigned char> input_of(uint64_t job_seed, int rank, u64 call, u64 bytes) {
  ex::Rng rng(ex::derive_seed(job_seed, rank, kInputSeedPurpose, call));
  std::vector<unsigned char> input(bytes);
  for (u64 i = 0; i < bytes; i += 8) {
    const uint64_t word = rng.next();
    std::memcpy(input.data() + i, &word, std::min<u64>(8, bytes - i));
  }
  return input;
}

void run(ex::Context& ctx) {
  World& world = ctx.world;
  const int n = world.world_size();
  const u64 calls = static_cast<u64>(ctx.options["calls"]);
  std::vector<u64> sizes = {1, 3, 4096, 4097, 65543, (1 << 20) + 5, (8 << 20) + 3};
  if (ctx.options["bytes"] > 0) sizes.push_back(static_cast<u64>(ctx.options["bytes"]));
  const u64 max_bytes = *std::max_element(sizes.begin(), sizes.end());
  TDIST_CHECK(n <= ctx.device_sm_count, "the all-gather needs one resident block per rank; ", n, " ranks but ",
              ctx.device_sm_count, " SMs");

  // Symmetric buffers; their roles are described in allgather.cu.
  SymmetricHeap& heap = ctx.create_heap(n * max_bytes + kGuardBytes + (1 << 20));
  auto* gathered = heap.allocate_array<unsigned char>(n * max_bytes + kGuardBytes);
  u64* arrived = heap.allocate_signals64(static_cast<size_t>(n) * kMaxChunks);
  u64* may_write = heap.allocate_signals64(n);

  const auto module = ex::load_tutorial_kernels("02_allgather/allgather.cu");
  const jit::Kernel all_gather = module->kernel("all_gather");
  ex::Stream stream;
  u64 call = 0;  // calls keep counting across sizes: flags are never reset

  for (const u64 bytes : sizes) {
    // More chunks (blocks) for large inputs, but never more blocks than SMs: every block must be
    // resident, since each waits for a block of a peer.
    const int chunks =
        static_cast<int>(std::clamp<u64>(bytes / kChunkTarget, 1, std::min<u64>(kMaxChunks, ctx.device_sm_count / n)));
    const u64 result_bytes = n * bytes + kGuardBytes;  // the concatenation and its guard

    ctx.report.run(
        detail::concat("all-gather of ", bytes, " bytes per rank, ", calls, " calls, ", chunks, " chunk(s) per rank"),
        [&](ex::Case& check) {
          // This rank's input for every call, uploaded up front; every call's result gets its own copy.
          ex::DeviceArray<unsigned char> inputs(calls * bytes), results(calls * result_bytes);
          const u64 first_call = call + 1;
          for (u64 i = 0; i < calls; ++i)
            inputs.upload(input_of(ctx.job_seed, world.rank(), first_call + i, bytes), i * bytes);
          results.poison(kPoison);
          TDIST_CUDA_CHECK(cudaMemset(gathered, kPoison, result_bytes));
          ex::sync_all(world, "gathered poisoned");  // before any peer writes into it

          for (u64 i = 0; i < calls; ++i) {
            ++call;
            jit::launch(all_gather,
                        {.grid = {static_cast<unsigned>(n * chunks)}, .block = {kThreads}, .stream = stream},
                        jit::make_args(heap.view(), gathered, inputs.data() + i * bytes, bytes, chunks, arrived,
                                       may_write, call));
            // The consumer of this call's result, in stream order. The next call's puts into our
            // `gathered` wait until this copy is done (may_write).
            TDIST_CUDA_CHECK(cudaMemcpyAsync(results.data() + i * result_bytes, gathered, result_bytes,
                                             cudaMemcpyDeviceToDevice, stream));
          }
          ex::sync_all(world, "calls done");

          // Reference: every rank's input of each call, concatenated in rank order.
          const std::vector<unsigned char> got = results.download();
          for (u64 i = 0; i < calls; ++i) {
            const unsigned char* result = got.data() + i * result_bytes;
            for (int s = 0; s < n; ++s) {
              const std::vector<unsigned char> expected = input_of(ctx.job_seed, s, first_call + i, bytes);
              const auto diff = std::mismatch(expected.begin(), expected.end(), result + s * bytes);
              check.expect(diff.first == expected.end(), "call ", first_call + i, ": rank ", s, "'s part differs from ",
                           "its input at byte ", diff.first - expected.begin(), " of ", bytes);
            }
            const unsigned char* guard = result + n * bytes;
            check.expect(std::all_of(guard, guard + kGuardBytes, [](unsigned char b) { return b == kPoison; }), "call ",
                         first_call + i, ": bytes after the concatenation were overwritten");
          }
        });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const ex::TutorialInfo info{
      "example_02_allgather",
      "Tutorial 2: an all-gather written by hand with putmem_signal_block into every peer; flags count\n"
      "calls and are never reset; a may-write handshake keeps one call from overwriting the last.",
      {{"calls", 4, 1, 1000, "calls per size, launched back to back"},
       {"bytes", 0, 0, 1ll << 30, "one more input size in bytes per rank (0: the built-in sizes only)"}}};
  return ex::run_tutorial(argc, argv, info, run);
}
