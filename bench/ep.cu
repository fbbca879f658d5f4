// Expert-parallel all-to-all: tdist's EpBuffer beside a plain path from the same run.
//
//   low latency     (DeepSeek-V3 decode: 128 tokens per rank, hidden 7168, 256 experts, top-8):
//                   FP8 (or bf16) dispatch and bf16 combine, each timed alone, and both in one CUDA
//                   graph replay;
//   high throughput (prefill: 4096 tokens per rank, bf16): dispatch (layout step included) and combine.
// The plain path: NCCL send/recv of the same rows, packed per destination beforehand with the
// counts known on the host (packing and counting untimed, which favours it); LL sends a row per
// (token, expert) as the LL dispatch does, HT a row per (token, rank).
// Reported: median microseconds (slowest rank) and the bytes this rank sends to other ranks per
// microsecond (GB/s crossing NVLink; 0 at world size 1), tdist and the plain path side by side.
//
//   tdistrun -n 2 build/bench/bench_ep [--mode ll|ht|both] [--tokens N] [--ht-tokens N] [--hidden H]
//            [--experts E] [--topk K] [--sms N] [--bf16] [--skewed] [--iters N] [--json FILE]
//   tdistrun -n 2 build/bench/bench_ep --summary bench/results/h200x2/ep_summary.json
//
// --summary runs the fixed set of cases (LL 1/32/128/256 tokens in bf16 and FP8, HT 4096/8192
// tokens; uniform and skewed routing; shapes (7168, 256, 8), (2048, 128, 8), (4096, 64, 6)) and
// writes one row per case (rank 0): mode, tokens_per_rank, hidden, experts, topk, dispatch_dtype,
// routing, dispatch_us, combine_us, dispatch_gbps, combine_gbps, baseline ("nccl"),
// baseline_dispatch_us, baseline_combine_us. Runs at any world size, 1 included.
#include <cuda_bf16.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../tools/common/bench_report.hpp"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/json.hpp"
#include "tdist/ops/ep.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/timing.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

struct Options {
  std::string mode = "both";
  int64_t ll_tokens = 128, ht_tokens = 4096, hidden = 7168;
  int experts = 256, topk = 8, sms = 0, iters = 50;
  bool bf16 = false, skewed = false;
  std::string json_path, summary_path;
};

struct Row {
  std::string op, impl;
  int64_t tokens;
  double us, remote_bytes;
};

// One measured configuration.
struct Case {
  bool ht = false;
  int64_t tokens = 0, hidden = 0;
  int experts = 0, topk = 0;
  bool fp8 = false, skewed = false;
};

// Times of one case (microseconds, slowest rank) and the bytes this rank sends to other ranks.
struct Result {
  double dispatch_us = 0, combine_us = 0, graph_us = 0;
  double dispatch_bytes = 0, combine_bytes = 0;
  double nccl_dispatch_us = 0, nccl_combine_us = 0, nccl_dispatch_bytes = 0, nccl_combine_bytes = 0;
};

// Top-k routing with distinct experts per token: uniform, or skewed (every other token's first slot
// is expert 0, so half the tokens go to one expert; its other slots stay uniform).
std::vector<int64_t> routing(int64_t tokens, int topk, int experts, uint64_t seed, bool skewed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> idx(static_cast<size_t>(tokens * topk));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < topk; ++j) {
      int64_t g;
      bool again;
      do {
        g = skewed && j == 0 && t % 2 == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(experts));
        again = std::find(idx.begin() + t * topk, idx.begin() + t * topk + j, g) != idx.begin() + t * topk + j;
      } while (again);
      idx[static_cast<size_t>(t * topk + j)] = g;
    }
  }
  return idx;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer d(std::max<size_t>(v.size() * sizeof(T), 1));
  if (!v.empty()) TDIST_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Values in [-1, 1] from a hash of (seed, index), drawn on the device (the expert outputs of the
// larger cases are gigabytes; drawing them on the host would dominate the run).
__global__ void fill_random_bf16(__nv_bfloat16* out, size_t count, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    out[i] = __float2bfloat16_rn(static_cast<float>(static_cast<int>(z % 2001) - 1000) / 1000.0f);
  }
}

DeviceBuffer random_bf16(size_t count, uint64_t seed) {
  DeviceBuffer d(std::max<size_t>(count, 1) * sizeof(__nv_bfloat16));
  fill_random_bf16<<<1024, 256>>>(d.get<__nv_bfloat16>(), count, seed);
  TDIST_CUDA_CHECK(cudaGetLastError());
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

// NCCL send/recv of rows_to[r] rows of `row_bytes` to each rank r (and the same from each, sized
// by the peers' counts), from and into packed buffers.
struct PlainAllToAll {
  World& world;
  std::vector<size_t> send_bytes, recv_bytes, send_off, recv_off;
  DeviceBuffer send, recv;
  PlainAllToAll(World& w, const std::vector<int>& rows_to, size_t row_bytes) : world(w) {
    const int n = w.world_size();
    std::vector<unsigned long long> mine(rows_to.begin(), rows_to.end());
    std::vector<std::vector<unsigned long long>> all(static_cast<size_t>(n),
                                                     std::vector<unsigned long long>(static_cast<size_t>(n)));
    const auto* p = reinterpret_cast<const uint8_t*>(mine.data());
    const auto got = w.all_gather("ep bench counts", Bytes(p, p + mine.size() * sizeof(unsigned long long)));
    for (int s = 0; s < n; ++s)
      std::memcpy(all[static_cast<size_t>(s)].data(), got[static_cast<size_t>(s)].data(),
                  static_cast<size_t>(n) * sizeof(unsigned long long));
    size_t so = 0, ro = 0;
    for (int r = 0; r < n; ++r) {
      send_off.push_back(so);
      recv_off.push_back(ro);
      send_bytes.push_back(static_cast<size_t>(mine[static_cast<size_t>(r)]) * row_bytes);
      recv_bytes.push_back(static_cast<size_t>(all[static_cast<size_t>(r)][static_cast<size_t>(w.rank())]) * row_bytes);
      so += send_bytes.back();
      ro += recv_bytes.back();
    }
    send = DeviceBuffer(std::max<size_t>(so, 1));
    recv = DeviceBuffer(std::max<size_t>(ro, 1));
    TDIST_CUDA_CHECK(cudaMemset(send.get(), 0x3C, std::max<size_t>(so, 1)));
  }
  double remote_bytes() const {
    double b = 0;
    for (int r = 0; r < world.world_size(); ++r)
      if (r != world.rank()) b += static_cast<double>(send_bytes[static_cast<size_t>(r)]);
    return b;
  }
  void run(cudaStream_t stream) {
    TDIST_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < world.world_size(); ++r) {
      if (send_bytes[static_cast<size_t>(r)])
        TDIST_NCCL_CHECK(ncclSend(send.get<char>() + send_off[static_cast<size_t>(r)], send_bytes[static_cast<size_t>(r)],
                                  ncclChar, r, world.comm(), stream));
      if (recv_bytes[static_cast<size_t>(r)])
        TDIST_NCCL_CHECK(ncclRecv(recv.get<char>() + recv_off[static_cast<size_t>(r)], recv_bytes[static_cast<size_t>(r)],
                                  ncclChar, r, world.comm(), stream));
    }
    TDIST_NCCL_CHECK(ncclGroupEnd());
  }
};

EpConfig ll_config(const Case& c, int sms) {
  return EpConfig{.max_tokens = c.tokens, .hidden = c.hidden, .num_experts = c.experts, .topk = c.topk, .num_sms = sms};
}

EpConfig ht_config(const Case& c, int sms) {
  return EpConfig{.max_tokens = c.tokens, .hidden = c.hidden, .num_experts = c.experts, .topk = c.topk,
                  .num_sms = sms, .mode = EpMode::kHighThroughput};
}

// The byte figures are the largest over the ranks (they differ slightly with the routing).
void max_bytes_across_ranks(World& world, Result& r) {
  const std::vector<double> m = world.max_across_ranks(
      "ep bench bytes", {r.dispatch_bytes, r.combine_bytes, r.nccl_dispatch_bytes, r.nccl_combine_bytes});
  r.dispatch_bytes = m[0];
  r.combine_bytes = m[1];
  r.nccl_dispatch_bytes = m[2];
  r.nccl_combine_bytes = m[3];
}

// The NCCL send/recv baseline of one case into `res`, beside tdist's times (rows_to[r] rows to rank
// r, dispatch_row / combine_row bytes each), and the bytes each side moves to other ranks
// (remote_rows of this rank's rows for tdist), the largest over the ranks.
void with_nccl_baseline(World& world, cudaStream_t stream, int iters, const std::vector<int>& rows_to,
                        double remote_rows, size_t dispatch_row, size_t combine_row, Result& res) {
  PlainAllToAll plain_dispatch(world, rows_to, dispatch_row), plain_combine(world, rows_to, combine_row);
  res.nccl_dispatch_us = 1e3 * slowest_rank_median_ms(world, stream, iters, [&] { plain_dispatch.run(stream); });
  res.nccl_combine_us = 1e3 * slowest_rank_median_ms(world, stream, iters, [&] { plain_combine.run(stream); });
  res.dispatch_bytes = remote_rows * static_cast<double>(dispatch_row);
  res.combine_bytes = remote_rows * static_cast<double>(combine_row);
  res.nccl_dispatch_bytes = plain_dispatch.remote_bytes();
  res.nccl_combine_bytes = plain_combine.remote_bytes();
  max_bytes_across_ranks(world, res);
}

Result bench_ll(World& world, SymmetricHeap& heap, cudaStream_t stream, const Case& c, int sms, int iters,
                bool graph) {
  const int W = world.world_size(), me = world.rank();
  EpBuffer ep(world, heap, ll_config(c, sms));
  const int L = ep.num_local_experts();
  const std::vector<int64_t> idx_host = routing(c.tokens, c.topk, c.experts, 1234 + me, c.skewed);
  DeviceBuffer x = random_bf16(static_cast<size_t>(c.tokens * c.hidden), 99 + me);
  DeviceBuffer idx = upload(idx_host);
  std::vector<float> w_host(idx_host.size(), 1.0f / static_cast<float>(c.topk));
  DeviceBuffer w = upload(w_host);
  DeviceBuffer out(static_cast<size_t>(c.tokens * c.hidden) * 2);
  const EpLlDispatchArgs da{.x = x.get(), .topk_idx = idx.get<int64_t>(), .num_tokens = c.tokens, .fp8 = c.fp8};
  // Rows per destination: one per (token, expert), as the LL dispatch sends them.
  const EpTokenCounts counts = ep_count_tokens(idx_host.data(), c.tokens, c.topk, c.experts, W);
  std::vector<int> rows_to(static_cast<size_t>(W), 0);
  for (int g = 0; g < c.experts; ++g) rows_to[static_cast<size_t>(g / L)] += counts.rows_per_expert[static_cast<size_t>(g)];
  const size_t G = static_cast<size_t>((c.hidden + 127) / 128);
  const size_t dispatch_row = c.fp8 ? static_cast<size_t>(c.hidden) + 4 * G + 4 : 2 * static_cast<size_t>(c.hidden) + 4;
  const size_t combine_row = 2 * static_cast<size_t>(c.hidden) + 8;
  double remote_rows = 0;
  for (int r = 0; r < W; ++r)
    if (r != me) remote_rows += rows_to[static_cast<size_t>(r)];

  Result res;
  EpLlHandle h = ep.ll_dispatch(da, stream);
  // Expert outputs: the received rows themselves (bf16), or a bf16 buffer of the layout's size.
  DeviceBuffer y = c.fp8 ? random_bf16(static_cast<size_t>(L * ep.recv_rows_per_expert() * c.hidden), 7 + me)
                         : DeviceBuffer(16);
  const EpLlCombineArgs ca{.y = c.fp8 ? y.get() : h.recv_x, .topk_idx = idx.get<int64_t>(),
                           .topk_weights = w.get<float>(), .out = out.get()};
  res.dispatch_us = 1e3 * slowest_rank_median_ms(world, stream, iters, [&] { h = ep.ll_dispatch(da, stream); });
  // Combines repeat the last dispatch's handle (the same slot stays valid: no dispatch in between).
  res.combine_us = 1e3 * slowest_rank_median_ms(world, stream, iters, [&] { ep.ll_combine(ca, h, stream); });
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    EpLlHandle gh = ep.ll_dispatch(da, stream);
    EpLlCombineArgs gca = ca;
    if (!c.fp8) gca.y = gh.recv_x;
    ep.ll_combine(gca, gh, stream);
    TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    res.graph_us =
        1e3 * slowest_rank_median_ms(world, stream, iters, [&] { TDIST_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
    TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TDIST_CUDA_CHECK(cudaGraphDestroy(g));
  }
  ep.check_errors(stream);

  with_nccl_baseline(world, stream, iters, rows_to, remote_rows, dispatch_row, combine_row, res);
  return res;
}

Result bench_ht(World& world, SymmetricHeap& heap, cudaStream_t stream, const Case& c, int sms, int iters) {
  const int W = world.world_size(), me = world.rank();
  EpBuffer ep(world, heap, ht_config(c, sms));
  const std::vector<int64_t> idx_host = routing(c.tokens, c.topk, c.experts, 4321 + me, c.skewed);
  DeviceBuffer x = random_bf16(static_cast<size_t>(c.tokens * c.hidden), 55 + me);
  DeviceBuffer idx = upload(idx_host);
  std::vector<float> w_host(idx_host.size(), 1.0f / static_cast<float>(c.topk));
  DeviceBuffer w = upload(w_host);
  DeviceBuffer out(static_cast<size_t>(c.tokens * c.hidden) * 2);
  const EpHtDispatchArgs da{.x = x.get(), .topk_idx = idx.get<int64_t>(), .topk_weights = w.get<float>(),
                            .num_tokens = c.tokens};
  const EpTokenCounts counts = ep_count_tokens(idx_host.data(), c.tokens, c.topk, c.experts, W);
  const size_t dispatch_row = 2 * static_cast<size_t>(c.hidden) + 4 + 12 * static_cast<size_t>(c.topk);
  const size_t combine_row = 2 * static_cast<size_t>(c.hidden);
  double remote_tokens = 0;
  for (int r = 0; r < W; ++r)
    if (r != me) remote_tokens += counts.tokens_per_rank[static_cast<size_t>(r)];
  Result res;
  EpHtHandle h = ep.ht_dispatch(da, stream);
  res.dispatch_us = 1e3 * slowest_rank_median_ms(world, stream, iters, [&] { h = ep.ht_dispatch(da, stream); });
  // Expert outputs in the expert-major layout: its rows as dispatched (bf16), padding included.
  const EpHtCombineArgs ca{.y = h.expert_x, .topk_idx = idx.get<int64_t>(), .out = out.get()};
  res.combine_us = 1e3 * slowest_rank_median_ms(world, stream, iters, [&] { ep.ht_combine(ca, h, stream); });
  ep.check_errors(stream);
  with_nccl_baseline(world, stream, iters, counts.tokens_per_rank, remote_tokens, dispatch_row, combine_row, res);
  return res;
}

double gbps(double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; }

size_t case_heap_bytes(const Case& c, int world_size, int sms) {
  return ep_heap_bytes(c.ht ? ht_config(c, sms) : ll_config(c, sms), world_size);
}

// The summary's cases: every shape, routing and size; LL in both dispatch dtypes, HT in bf16.
std::vector<Case> summary_cases() {
  struct Shape {
    int64_t hidden;
    int experts, topk;
  };
  const Shape shapes[] = {{7168, 256, 8}, {2048, 128, 8}, {4096, 64, 6}};
  std::vector<Case> cases;
  for (const Shape& s : shapes)
    for (bool skewed : {false, true}) {
      for (int64_t tokens : {1, 32, 128, 256})
        for (bool fp8 : {false, true})
          cases.push_back({.ht = false, .tokens = tokens, .hidden = s.hidden, .experts = s.experts, .topk = s.topk,
                           .fp8 = fp8, .skewed = skewed});
      for (int64_t tokens : {4096, 8192})
        cases.push_back({.ht = true, .tokens = tokens, .hidden = s.hidden, .experts = s.experts, .topk = s.topk,
                         .fp8 = false, .skewed = skewed});
    }
  return cases;
}

int run_summary(World& world, cudaStream_t stream, const Options& o, int argc, char** argv) {
  const int W = world.world_size();
  const std::vector<Case> cases = summary_cases();
  size_t heap_bytes = 0;
  for (const Case& c : cases)
    if (c.experts % W == 0) heap_bytes = std::max(heap_bytes, case_heap_bytes(c, W, o.sms));
  SymmetricHeap heap(world, heap_bytes + (64ull << 20));
  json::Value doc;
  if (world.rank() == 0) {
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    doc = bench::document("ep_summary", prop.name, W, "fp8+bf16", argc, argv);
    doc["iters"] = o.iters;
    std::printf("\nEP all-to-all summary, %d ranks on %s, median of %d (slowest rank); GB/s = bytes crossing "
                "NVLink per rank / time\n",
                W, prop.name, o.iters);
    std::printf("%-4s %6s %6s %4s %3s %5s %-8s %10s %10s %9s %9s %10s %10s\n", "mode", "tokens", "hidden", "E", "K",
                "dtype", "routing", "disp us", "comb us", "disp GB/s", "comb GB/s", "nccl disp", "nccl comb");
  }
  for (const Case& c : cases) {
    if (c.experts % W != 0) continue;  // experts must split evenly over the ranks
    const Result r = c.ht ? bench_ht(world, heap, stream, c, o.sms, o.iters)
                          : bench_ll(world, heap, stream, c, o.sms, o.iters, false);
    if (world.rank() != 0) continue;
    const char* mode = c.ht ? "high_throughput" : "low_latency";
    const char* dtype = c.fp8 ? "fp8" : "bf16";
    const char* routing_name = c.skewed ? "skewed" : "uniform";
    std::printf("%-4s %6lld %6lld %4d %3d %5s %-8s %10.1f %10.1f %9.1f %9.1f %10.1f %10.1f\n", c.ht ? "ht" : "ll",
                static_cast<long long>(c.tokens), static_cast<long long>(c.hidden), c.experts, c.topk, dtype,
                routing_name, r.dispatch_us, r.combine_us, gbps(r.dispatch_bytes, r.dispatch_us),
                gbps(r.combine_bytes, r.combine_us), r.nccl_dispatch_us, r.nccl_combine_us);
    std::fflush(stdout);
    doc["rows"].push_back(json::Object{{"mode", mode},
                                       {"tokens_per_rank", c.tokens},
                                       {"hidden", c.hidden},
                                       {"experts", c.experts},
                                       {"topk", c.topk},
                                       {"dispatch_dtype", dtype},
                                       {"routing", routing_name},
                                       {"dispatch_us", r.dispatch_us},
                                       {"combine_us", r.combine_us},
                                       {"dispatch_gbps", gbps(r.dispatch_bytes, r.dispatch_us)},
                                       {"combine_gbps", gbps(r.combine_bytes, r.combine_us)},
                                       {"baseline", "nccl"},
                                       {"baseline_dispatch_us", r.nccl_dispatch_us},
                                       {"baseline_combine_us", r.nccl_combine_us}});
  }
  if (world.rank() == 0) json::write_file(o.summary_path, doc);
  return 0;
}

int run(const Options& o, int argc, char** argv) {
  World world;
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (!o.summary_path.empty()) {
    const int rc = run_summary(world, stream, o, argc, argv);
    TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
    return rc;
  }
  if (o.experts % world.world_size() != 0) throw cli::UsageError("--experts must be a multiple of the world size");
  const Case ll{.ht = false, .tokens = o.ll_tokens, .hidden = o.hidden, .experts = o.experts, .topk = o.topk,
                .fp8 = !o.bf16, .skewed = o.skewed};
  const Case ht{.ht = true, .tokens = o.ht_tokens, .hidden = o.hidden, .experts = o.experts, .topk = o.topk,
                .fp8 = false, .skewed = o.skewed};
  size_t heap_bytes = 64ull << 20;
  if (o.mode != "ht") heap_bytes += case_heap_bytes(ll, world.world_size(), o.sms);
  if (o.mode != "ll") heap_bytes += case_heap_bytes(ht, world.world_size(), o.sms);
  SymmetricHeap heap(world, heap_bytes);
  std::vector<Row> rows;
  if (o.mode != "ht") {
    const Result r = bench_ll(world, heap, stream, ll, o.sms, o.iters, true);
    const std::string dname = ll.fp8 ? "ll_dispatch_fp8" : "ll_dispatch_bf16";
    rows.push_back({dname, "tdist", ll.tokens, r.dispatch_us, r.dispatch_bytes});
    rows.push_back({dname, "nccl", ll.tokens, r.nccl_dispatch_us, r.nccl_dispatch_bytes});
    rows.push_back({"ll_combine_bf16", "tdist", ll.tokens, r.combine_us, r.combine_bytes});
    rows.push_back({"ll_combine_bf16", "nccl", ll.tokens, r.nccl_combine_us, r.nccl_combine_bytes});
    rows.push_back({"ll_dispatch_combine_graph", "tdist", ll.tokens, r.graph_us, r.dispatch_bytes + r.combine_bytes});
    rows.push_back({"ll_dispatch_combine_graph", "nccl", ll.tokens, r.nccl_dispatch_us + r.nccl_combine_us,
                    r.nccl_dispatch_bytes + r.nccl_combine_bytes});
  }
  if (o.mode != "ll") {
    const Result r = bench_ht(world, heap, stream, ht, o.sms, o.iters);
    rows.push_back({"ht_dispatch_bf16", "tdist", ht.tokens, r.dispatch_us, r.dispatch_bytes});
    rows.push_back({"ht_dispatch_bf16", "nccl", ht.tokens, r.nccl_dispatch_us, r.nccl_dispatch_bytes});
    rows.push_back({"ht_combine_bf16", "tdist", ht.tokens, r.combine_us, r.combine_bytes});
    rows.push_back({"ht_combine_bf16", "nccl", ht.tokens, r.nccl_combine_us, r.nccl_combine_bytes});
  }
  if (world.rank() == 0) {
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    std::printf("\nEP all-to-all, %d ranks on %s, hidden %lld, %d experts, top-%d, %s routing, median of %d "
                "(slowest rank)\n",
                world.world_size(), prop.name, static_cast<long long>(o.hidden), o.experts, o.topk,
                o.skewed ? "skewed" : "uniform", o.iters);
    std::printf("%-28s %7s %-6s %10s %12s\n", "op", "tokens", "impl", "us", "GB/s remote");
    for (const Row& r : rows)
      std::printf("%-28s %7lld %-6s %10.1f %12.1f\n", r.op.c_str(), static_cast<long long>(r.tokens), r.impl.c_str(),
                  r.us, gbps(r.remote_bytes, r.us));
    if (!o.json_path.empty()) {
      json::Value doc = bench::document("ep", prop.name, world.world_size(), o.bf16 ? "bf16" : "fp8+bf16", argc, argv);
      doc["hidden"] = o.hidden;
      doc["experts"] = o.experts;
      doc["topk"] = o.topk;
      doc["routing"] = o.skewed ? "skewed" : "uniform";
      doc["iters"] = o.iters;
      for (const Row& r : rows)
        doc["rows"].push_back(json::Object{{"op", r.op},
                                           {"impl", r.impl},
                                           {"tokens", r.tokens},
                                           {"bytes", r.remote_bytes},
                                           {"us", r.us},
                                           {"algbw_gbps", gbps(r.remote_bytes, r.us)}});
      json::write_file(o.json_path, doc);
    }
  }
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  tdist::cli::Parser p("bench_ep",
                       "Expert-parallel dispatch and combine (low latency and high throughput) beside NCCL\n"
                       "send/recv of the same rows. Runs under tdistrun at any world size (1 included).");
  p.choice("--mode", "ll, ht or both (default both)", {"ll", "ht", "both"}, &o.mode);
  p.option("--tokens", "N", "low-latency tokens per rank (default 128)", &o.ll_tokens, 1, 1 << 16);
  p.option("--ht-tokens", "N", "high-throughput tokens per rank (default 4096)", &o.ht_tokens, 1, 1 << 20);
  p.option("--hidden", "H", "channels per token, a multiple of 128 (default 7168)", &o.hidden, 128, 1 << 16);
  p.option("--experts", "E", "experts, a multiple of the world size (default 256)", &o.experts, 1, 1 << 13);
  p.option("--topk", "K", "experts per token (default 8)", &o.topk, 1, 32);
  p.option("--sms", "N", "blocks of the send kernels (default: every SM for LL, 24 for HT)", &o.sms, 0, 1024);
  p.flag("--bf16", "low-latency dispatch in bf16 instead of FP8", &o.bf16);
  p.flag("--skewed", "skewed routing: half the tokens go to expert 0 (default uniform)", &o.skewed);
  p.option("--iters", "N", "timings per figure, the median is kept (default 50)", &o.iters, 3, 1000000);
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &o.json_path);
  p.option("--summary", "FILE",
           "run the fixed set of cases (sizes, dtypes, routings, shapes) and write one row per case as JSON (rank 0); "
           "the other case options are ignored",
           &o.summary_path);
  p.parse(argc, argv);
  if (o.hidden % 128 != 0) p.fail("--hidden expects a multiple of 128");
  if (o.topk > o.experts) p.fail("--topk expects at most --experts");
  return tdist::cli::run_main("bench_ep", [&] { return run(o, argc, argv); });
}
