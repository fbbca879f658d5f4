// Tutorial 1, host side: runs the ring of notify_wait.cu for several message sizes, many rounds
// back to back without any host synchronisation between rounds, and checks every message each rank
// received against the previous rank's payload rebuilt on the host.
//
//   tdistrun -n N -- build/examples/example_01_notify_wait [--rounds=R] [--words=W] [--seed=S]
#include <algorithm>
#include <vector>

#include "common/tutorial.hpp"
#include "tdist/runtime/symmetric_heap.hpp"

using namespace tdist;
using device::u32;
using device::u64;
namespace ex = tdist::examples;

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned char kPoison = 0xA5;
constexpr uint64_t kPayloadSeedPurpose = 1;

// The payload `sender` sends in round `round`: the sender uploads it, the receiver's reference
// rebuilds it from the job seed.
std::vector<u32> payload_of(uint64_t job_seed, int sender, u64 round, u64 words) {
  ex::Rng rng(ex::derive_seed(job_seed, sender, kPayloadSeedPurpose, round));
  std::vector<u32> payload(words);
  for (u32& w : payload) w = static_cast<u32>(rng.next());
  return payload;
}

void run(ex::Context& ctx) {
  World& world = ctx.world;
  const u64 rounds = static_cast<u64>(ctx.options["rounds"]);
  std::vector<u64> message_words = {1, 7, 4099, 262147};  // odd sizes: the copies' unaligned tails
  if (ctx.options["words"] > 0) message_words.push_back(static_cast<u64>(ctx.options["words"]));
  const u64 capacity = *std::max_element(message_words.begin(), message_words.end());
  const int prev = (world.rank() + world.world_size() - 1) % world.world_size();

  // Symmetric buffers; their roles are described in notify_wait.cu.
  SymmetricHeap& heap = ctx.create_heap(capacity * sizeof(u32) + (1 << 20));
  u32* mailbox = heap.allocate_array<u32>(capacity);
  u64* mailbox_header = heap.allocate_array<u64>(1);
  u64* ready = heap.allocate_signals64(1);
  u64* mailbox_free = heap.allocate_signals64(1);

  // Compiled by NVRTC for this GPU on the first run, then taken from the JIT's disk cache.
  const auto module = ex::load_tutorial_kernels("01_notify_wait/notify_wait.cu");
  const jit::Kernel ring_send = module->kernel("ring_send");
  const jit::Kernel ring_receive = module->kernel("ring_receive");

  // Separate streams: a receiver waits for its previous rank's sender while this rank's sender must
  // still be able to run.
  ex::Stream send_stream, receive_stream;
  u64 round = 0;  // last round launched; rounds keep counting across sizes, flags are never reset

  for (const u64 words : message_words) {
    ctx.report.run(detail::concat("ring of ", rounds, " rounds, ", words, " words"), [&](ex::Case& check) {
      // This rank's payload for every round, uploaded before the first launch; outputs poisoned.
      ex::DeviceArray<u32> payloads(rounds * words), received(rounds * words);
      ex::DeviceArray<u64> received_headers(rounds);
      const u64 first_round = round + 1;
      for (u64 i = 0; i < rounds; ++i)
        payloads.upload(payload_of(ctx.job_seed, world.rank(), first_round + i, words), i * words);
      received.poison(kPoison);
      received_headers.poison(kPoison);
      // Poison the mailbox as well, and let every rank finish that before any peer writes into it.
      TDIST_CUDA_CHECK(cudaMemset(mailbox, kPoison, words * sizeof(u32)));
      ex::sync_all(world, "mailboxes poisoned");

      for (u64 i = 0; i < rounds; ++i) {
        ++round;
        // The receiver is launched first and waits for kernels launched after it, here and on the
        // previous rank. That needs the module loaded before either runs: Module::load did it.
        jit::launch(ring_receive, {.grid = {1}, .block = {kThreads}, .stream = receive_stream},
                    jit::make_args(heap.view(), mailbox, mailbox_header, words, ready, mailbox_free,
                                   received.data() + i * words, received_headers.data() + i, round));
        jit::launch(ring_send, {.grid = {1}, .block = {kThreads}, .stream = send_stream},
                    jit::make_args(heap.view(), mailbox, mailbox_header, payloads.data() + i * words, words, ready,
                                   mailbox_free, round));
      }
      ex::sync_all(world, "rounds done");

      // Reference: the previous rank's payload of each round, rebuilt on the host.
      const std::vector<u32> got = received.download();
      const std::vector<u64> headers = received_headers.download();
      for (u64 i = 0; i < rounds; ++i) {
        const std::vector<u32> expected = payload_of(ctx.job_seed, prev, first_round + i, words);
        u64 wrong = 0, first_wrong = 0;
        for (u64 w = 0; w < words; ++w)
          if (got[i * words + w] != expected[w] && wrong++ == 0) first_wrong = w;
        check.expect(wrong == 0, "round ", first_round + i, ": ", wrong, " of ", words, " words differ from rank ",
                     prev, "'s payload, first at word ", first_wrong, " (got ", got[i * words + first_wrong],
                     ", expected ", expected[first_wrong], ")");
        const u64 expected_header = (static_cast<u64>(prev) << 32) | (first_round + i);
        check.expect(headers[i] == expected_header, "round ", first_round + i, ": header ", headers[i], ", expected ",
                     expected_header);
      }
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const ex::TutorialInfo info{
      "example_01_notify_wait",
      "Tutorial 1: every rank sends a message to the next rank of a ring, round after round, with a\n"
      "ready flag (notify/wait) and a mailbox-free flag (back-pressure); flags count rounds, never reset.",
      {{"rounds", 8, 1, 10000, "rounds per message size, launched back to back"},
       {"words", 0, 0, 1 << 26, "one more message size, in u32 words (0: the built-in sizes only)"}}};
  return ex::run_tutorial(argc, argv, info, run);
}
