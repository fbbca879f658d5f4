// Tutorial 3, host side: MoE-style dispatch through the low-latency all-to-all of
// low_latency_all_to_all.cu. Every call draws fresh tokens and a fresh random routing on every rank
// (a full batch, an empty rank, random sizes), lays the rows out by expert, and runs the
// all-to-all; calls go back to back with no host work between them, alternating the two receive
// buffers. Afterwards each rank checks, per call and per source rank, the per-expert counts and
// every row it received against a reference built on the host from the source's tokens.
//
//   tdistrun -n N -- build/examples/example_03_low_latency_all_to_all [--calls=C] [--tokens=T]
//       [--experts-per-rank=E] [--topk=K] [--seed=S]
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/tutorial.hpp"
#include "tdist/runtime/symmetric_heap.hpp"

using namespace tdist;
using device::u64;
namespace ex = tdist::examples;

namespace {

constexpr unsigned kThreads = 512;
constexpr unsigned char kPoison = 0xEE;
constexpr uint64_t kTokenSeedPurpose = 3;

struct Config {
  int num_ranks;
  int max_tokens;  // per rank and call
  int hidden;      // bf16 elements per token
  int experts_per_rank;
  int topk;  // distinct experts per token
  int num_experts() const { return num_ranks * experts_per_rank; }
  u64 row_bytes() const { return static_cast<u64>(hidden) * sizeof(uint16_t); }
  // A token reaches a rank once per expert it picked there: at most min(topk, experts_per_rank) rows.
  u64 rows_per_source() const { return static_cast<u64>(max_tokens) * std::min(topk, experts_per_rank); }
};

// One rank's input to one call: its tokens (bf16 bit patterns) and the experts each token picked.
struct Tokens {
  int count = 0;
  std::vector<uint16_t> hidden;  // [count][hidden]
  std::vector<int> experts;      // [count][topk], distinct per token
};

// `rank`'s tokens in call number `call_index` of a case. The first call is a full batch everywhere;
// in the second, rank 0 sends nothing; later ones are random.
Tokens tokens_of(const Config& cfg, uint64_t job_seed, int rank, u64 call, u64 call_index) {
  ex::Rng rng(ex::derive_seed(job_seed, rank, kTokenSeedPurpose, call));
  Tokens t;
  t.count = call_index == 0                ? cfg.max_tokens
            : call_index == 1 && rank == 0 ? 0
                                           : static_cast<int>(rng.below(cfg.max_tokens + 1));
  t.hidden.resize(static_cast<size_t>(t.count) * cfg.hidden);
  for (uint16_t& h : t.hidden) h = static_cast<uint16_t>(rng.next());
  std::vector<int> pool(cfg.num_experts());
  for (int i = 0; i < t.count; ++i) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int k = 0; k < cfg.topk; ++k) {  // a partial Fisher-Yates shuffle: topk distinct experts
      std::swap(pool[k], pool[k + rng.below(pool.size() - k)]);
      t.experts.push_back(pool[k]);
    }
  }
  return t;
}

// The send side's layout: one row per (token, expert), sorted by expert (counting sort, stable in
// token order), and the number of rows per expert.
void lay_out_by_expert(const Config& cfg, const Tokens& t, std::vector<uint16_t>& rows, std::vector<int>& splits) {
  splits.assign(cfg.num_experts(), 0);
  for (int e : t.experts) ++splits[e];
  std::vector<size_t> cursor(cfg.num_experts(), 0);
  for (int e = 1; e < cfg.num_experts(); ++e) cursor[e] = cursor[e - 1] + splits[e - 1];
  rows.assign(t.experts.size() * cfg.hidden, 0);
  for (int i = 0; i < t.count; ++i)
    for (int k = 0; k < cfg.topk; ++k)
      std::copy_n(&t.hidden[static_cast<size_t>(i) * cfg.hidden], cfg.hidden,
                  &rows[cursor[t.experts[static_cast<size_t>(i) * cfg.topk + k]]++ * cfg.hidden]);
}

void run(ex::Context& ctx) {
  World& world = ctx.world;
  const int n = world.world_size();
  const u64 calls = static_cast<u64>(ctx.options["calls"]);
  const int max_tokens = static_cast<int>(ctx.options["tokens"]);
  const int experts_per_rank = static_cast<int>(ctx.options["experts-per-rank"]);
  const int topk = static_cast<int>(ctx.options["topk"]);
  TDIST_CHECK_ARG(topk <= n * experts_per_rank, "--topk", "a token picks ", topk, " distinct experts, but ", n,
                  " ranks x ", experts_per_rank, " experts per rank make only ", n * experts_per_rank);
  // An odd hidden size (rows 2-byte aligned only), one element, and DeepSeek-V3's 7168.
  const std::vector<int> hidden_sizes = {1031, 1, 7168};
  const Config largest{n, max_tokens, *std::max_element(hidden_sizes.begin(), hidden_sizes.end()), experts_per_rank,
                       topk};
  const u64 max_recv_bytes = 2ull * n * largest.rows_per_source() * largest.row_bytes();

  // Symmetric buffers; their roles are described in low_latency_all_to_all.cu.
  SymmetricHeap& heap = ctx.create_heap(max_recv_bytes + (2 << 20));
  auto* recv_rows = heap.allocate_array<unsigned char>(max_recv_bytes);
  int* recv_splits = heap.allocate_array<int>(2ull * n * experts_per_rank);
  u64* arrived = heap.allocate_signals64(2ull * n);

  const auto module = ex::load_tutorial_kernels("03_low_latency_all_to_all/low_latency_all_to_all.cu");
  const jit::Kernel dispatch = module->kernel("all_to_all_dispatch");
  ex::Stream stream;
  u64 call = 0;  // call k uses buffer parity k % 2 and raises flags to k; continues across cases

  for (const int hidden : hidden_sizes) {
    const Config cfg{n, max_tokens, hidden, experts_per_rank, topk};
    const u64 row_bytes = cfg.row_bytes(), rows_per_source = cfg.rows_per_source();
    const u64 recv_bytes_per_parity = n * rows_per_source * row_bytes;
    const u64 send_rows_capacity = static_cast<u64>(max_tokens) * topk;

    ctx.report.run(
        detail::concat("dispatch of up to ", max_tokens, " tokens x top-", topk, " over ", cfg.num_experts(),
                       " experts, hidden ", hidden, ", ", calls, " calls"),
        [&](ex::Case& check) {
          // Every call's send-side input, uploaded up front; every call's received data gets its own copy.
          ex::DeviceArray<unsigned char> send_rows(calls * send_rows_capacity * row_bytes);
          ex::DeviceArray<int> send_splits(calls * cfg.num_experts());
          ex::DeviceArray<unsigned char> got_rows(calls * recv_bytes_per_parity);
          ex::DeviceArray<int> got_splits(calls * n * experts_per_rank);
          const u64 first_call = call + 1;
          for (u64 i = 0; i < calls; ++i) {
            std::vector<uint16_t> rows;
            std::vector<int> splits;
            lay_out_by_expert(cfg, tokens_of(cfg, ctx.job_seed, world.rank(), first_call + i, i), rows, splits);
            std::vector<unsigned char> row_bytes_host(rows.size() * sizeof(uint16_t));
            std::memcpy(row_bytes_host.data(), rows.data(), row_bytes_host.size());
            send_rows.upload(row_bytes_host, i * send_rows_capacity * row_bytes);
            send_splits.upload(splits, i * cfg.num_experts());
          }
          got_rows.poison(kPoison);
          got_splits.poison(kPoison);
          TDIST_CUDA_CHECK(cudaMemset(recv_rows, kPoison, 2 * recv_bytes_per_parity));
          TDIST_CUDA_CHECK(cudaMemset(recv_splits, kPoison, 2ull * n * experts_per_rank * sizeof(int)));
          ex::sync_all(world, "receive buffers poisoned");  // before any peer writes into them

          for (u64 i = 0; i < calls; ++i) {
            ++call;
            const u64 parity = call % 2;
            jit::launch(dispatch, {.grid = {static_cast<unsigned>(n)}, .block = {kThreads}, .stream = stream},
                        jit::make_args(heap.view(), send_rows.data() + i * send_rows_capacity * row_bytes,
                                       send_splits.data() + i * cfg.num_experts(), recv_rows, recv_splits, arrived,
                                       row_bytes, rows_per_source, experts_per_rank, call));
            // The consumer, in stream order (a real MoE layer runs its expert GEMM here, reading the
            // receive buffer in place). Buffer `parity` is written again only by call + 2.
            TDIST_CUDA_CHECK(cudaMemcpyAsync(got_rows.data() + i * recv_bytes_per_parity,
                                             recv_rows + parity * recv_bytes_per_parity, recv_bytes_per_parity,
                                             cudaMemcpyDeviceToDevice, stream));
            TDIST_CUDA_CHECK(cudaMemcpyAsync(got_splits.data() + i * n * experts_per_rank,
                                             recv_splits + parity * n * experts_per_rank,
                                             n * experts_per_rank * sizeof(int), cudaMemcpyDeviceToDevice, stream));
          }
          ex::sync_all(world, "calls done");

          // Reference, per call and source: for each of this rank's experts in order, the source's
          // tokens that picked it, in token order.
          const std::vector<unsigned char> rows = got_rows.download();
          const std::vector<int> splits = got_splits.download();
          for (u64 i = 0; i < calls; ++i) {
            for (int s = 0; s < n; ++s) {
              const Tokens sent = tokens_of(cfg, ctx.job_seed, s, first_call + i, i);
              const unsigned char* slot = rows.data() + i * recv_bytes_per_parity + s * rows_per_source * row_bytes;
              u64 row = 0;
              for (int local = 0; local < experts_per_rank; ++local) {
                const int expert = world.rank() * experts_per_rank + local;
                int expected_count = 0;
                for (int t = 0; t < sent.count; ++t) {
                  const int* picked = &sent.experts[static_cast<size_t>(t) * topk];
                  if (std::find(picked, picked + topk, expert) == picked + topk) continue;
                  ++expected_count;
                  check.expect(std::memcmp(slot + row * row_bytes, &sent.hidden[static_cast<size_t>(t) * hidden],
                                           row_bytes) == 0,
                               "call ", first_call + i, ": row ", row, " from rank ", s, " (expert ", expert,
                               ") is not token ", t);
                  ++row;
                }
                const int got_count = splits[(i * n + s) * experts_per_rank + local];
                check.expect(got_count == expected_count, "call ", first_call + i, ": rank ", s, " sent ", got_count,
                             " rows for expert ", expert, ", expected ", expected_count);
              }
            }
          }
        });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const ex::TutorialInfo info{
      "example_03_low_latency_all_to_all",
      "Tutorial 3: MoE dispatch through a low-latency all-to-all: per-expert counts and token rows put\n"
      "with put+signal into per-source slots, double-buffered by call parity, signal value = call count.",
      {{"calls", 6, 1, 1000, "calls per hidden size, launched back to back"},
       {"tokens", 96, 1, 4096, "most tokens a rank sends per call"},
       {"experts-per-rank", 3, 1, 64, "experts hosted by each rank"},
       {"topk", 4, 1, 64, "distinct experts each token is routed to"}}};
  return ex::run_tutorial(argc, argv, info, run);
}
