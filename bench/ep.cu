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
// microsecond (GB/s crossing NVLink), tdist and the plain path side by side.
//
//   tdistrun -n 2 build/bench/bench_ep [--mode ll|ht|both] [--tokens N] [--ht-tokens N] [--hidden H]
//            [--experts E] [--topk K] [--sms N] [--bf16] [--iters N] [--json FILE]
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
  bool bf16 = false;
  std::string json_path;
};

struct Row {
  std::string op, impl;
  int64_t tokens;
  double us, remote_bytes;
};

// Uniform top-k routing: distinct experts per token.
std::vector<int64_t> routing(int64_t tokens, int topk, int experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> idx(static_cast<size_t>(tokens * topk));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < topk; ++j) {
      int64_t g;
      bool again;
      do {
        g = static_cast<int64_t>(rng() % static_cast<uint64_t>(experts));
        again = std::find(idx.begin() + t * topk, idx.begin() + t * topk + j, g) != idx.begin() + t * topk + j;
      } while (again);
      idx[static_cast<size_t>(t * topk + j)] = g;
    }
  }
  return idx;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer d(v.size() * sizeof(T));
  TDIST_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

DeviceBuffer random_bf16(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<__nv_bfloat16> v(count);
  for (auto& x : v) x = __float2bfloat16_rn(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f);
  return upload(v);
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
    send = DeviceBuffer(so);
    recv = DeviceBuffer(ro);
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

void bench_ll(World& world, SymmetricHeap& heap, cudaStream_t stream, const Options& o, std::vector<Row>& rows) {
  const int W = world.world_size(), me = world.rank();
  EpConfig cfg{.max_tokens = o.ll_tokens, .hidden = o.hidden, .num_experts = o.experts, .topk = o.topk,
               .num_sms = o.sms};
  EpBuffer ep(world, heap, cfg);
  const int L = ep.num_local_experts();
  const std::vector<int64_t> idx_host = routing(o.ll_tokens, o.topk, o.experts, 1234 + me);
  DeviceBuffer x = random_bf16(static_cast<size_t>(o.ll_tokens * o.hidden), 99 + me);
  DeviceBuffer idx = upload(idx_host);
  std::vector<float> w_host(idx_host.size(), 1.0f / static_cast<float>(o.topk));
  DeviceBuffer w = upload(w_host);
  DeviceBuffer out(static_cast<size_t>(o.ll_tokens * o.hidden) * 2);
  const bool fp8 = !o.bf16;
  const EpLlDispatchArgs da{.x = x.get(), .topk_idx = idx.get<int64_t>(), .num_tokens = o.ll_tokens, .fp8 = fp8};
  // Rows per destination: one per (token, expert), as the LL dispatch sends them.
  const EpTokenCounts counts = ep_count_tokens(idx_host.data(), o.ll_tokens, o.topk, o.experts, W);
  std::vector<int> rows_to(static_cast<size_t>(W), 0);
  for (int g = 0; g < o.experts; ++g) rows_to[static_cast<size_t>(g / L)] += counts.rows_per_expert[static_cast<size_t>(g)];
  const size_t G = static_cast<size_t>((o.hidden + 127) / 128);
  const size_t dispatch_row = fp8 ? static_cast<size_t>(o.hidden) + 4 * G + 4 : 2 * static_cast<size_t>(o.hidden) + 4;
  const size_t combine_row = 2 * static_cast<size_t>(o.hidden) + 8;
  double remote_rows = 0;
  for (int r = 0; r < W; ++r)
    if (r != me) remote_rows += rows_to[static_cast<size_t>(r)];

  EpLlHandle h = ep.ll_dispatch(da, stream);
  // Expert outputs: the received rows themselves (bf16), or a bf16 buffer of the layout's size.
  DeviceBuffer y = random_bf16(static_cast<size_t>(L * ep.recv_rows_per_expert() * o.hidden), 7 + me);
  const EpLlCombineArgs ca{.y = fp8 ? y.get() : h.recv_x, .topk_idx = idx.get<int64_t>(),
                           .topk_weights = w.get<float>(), .out = out.get()};
  const double t_dispatch = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { h = ep.ll_dispatch(da, stream); });
  // Combines repeat the last dispatch's handle (the same slot stays valid: no dispatch in between).
  const double t_combine = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { ep.ll_combine(ca, h, stream); });
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  EpLlHandle gh = ep.ll_dispatch(da, stream);
  EpLlCombineArgs gca = ca;
  if (!fp8) gca.y = gh.recv_x;
  ep.ll_combine(gca, gh, stream);
  TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double t_graph =
      1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { TDIST_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
  TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TDIST_CUDA_CHECK(cudaGraphDestroy(graph));
  ep.check_errors(stream);

  PlainAllToAll plain_dispatch(world, rows_to, dispatch_row), plain_combine(world, rows_to, combine_row);
  const double p_dispatch = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { plain_dispatch.run(stream); });
  const double p_combine = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { plain_combine.run(stream); });
  const std::string dname = fp8 ? "ll_dispatch_fp8" : "ll_dispatch_bf16";
  rows.push_back({dname, "tdist", o.ll_tokens, t_dispatch, remote_rows * dispatch_row});
  rows.push_back({dname, "nccl", o.ll_tokens, p_dispatch, plain_dispatch.remote_bytes()});
  rows.push_back({"ll_combine_bf16", "tdist", o.ll_tokens, t_combine, remote_rows * combine_row});
  rows.push_back({"ll_combine_bf16", "nccl", o.ll_tokens, p_combine, plain_combine.remote_bytes()});
  rows.push_back({"ll_dispatch_combine_graph", "tdist", o.ll_tokens, t_graph,
                  remote_rows * static_cast<double>(dispatch_row + combine_row)});
  rows.push_back({"ll_dispatch_combine_graph", "nccl", o.ll_tokens, p_dispatch + p_combine,
                  plain_dispatch.remote_bytes() + plain_combine.remote_bytes()});
}

void bench_ht(World& world, SymmetricHeap& heap, cudaStream_t stream, const Options& o, std::vector<Row>& rows) {
  const int W = world.world_size(), me = world.rank();
  EpConfig cfg{.max_tokens = o.ht_tokens, .hidden = o.hidden, .num_experts = o.experts, .topk = o.topk,
               .num_sms = o.sms, .mode = EpMode::kHighThroughput};
  EpBuffer ep(world, heap, cfg);
  const std::vector<int64_t> idx_host = routing(o.ht_tokens, o.topk, o.experts, 4321 + me);
  DeviceBuffer x = random_bf16(static_cast<size_t>(o.ht_tokens * o.hidden), 55 + me);
  DeviceBuffer idx = upload(idx_host);
  std::vector<float> w_host(idx_host.size(), 1.0f / static_cast<float>(o.topk));
  DeviceBuffer w = upload(w_host);
  DeviceBuffer out(static_cast<size_t>(o.ht_tokens * o.hidden) * 2);
  const EpHtDispatchArgs da{.x = x.get(), .topk_idx = idx.get<int64_t>(), .topk_weights = w.get<float>(),
                            .num_tokens = o.ht_tokens};
  const EpTokenCounts counts = ep_count_tokens(idx_host.data(), o.ht_tokens, o.topk, o.experts, W);
  const size_t dispatch_row = 2 * static_cast<size_t>(o.hidden) + 4 + 12 * static_cast<size_t>(o.topk);
  const size_t combine_row = 2 * static_cast<size_t>(o.hidden);
  double remote_tokens = 0;
  for (int r = 0; r < W; ++r)
    if (r != me) remote_tokens += counts.tokens_per_rank[static_cast<size_t>(r)];
  EpHtHandle h = ep.ht_dispatch(da, stream);
  // Expert outputs in the expert-major layout: its rows as dispatched (bf16), padding included.
  const double t_dispatch = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { h = ep.ht_dispatch(da, stream); });
  const EpHtCombineArgs ca{.y = h.expert_x, .topk_idx = idx.get<int64_t>(), .out = out.get()};
  const double t_combine = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { ep.ht_combine(ca, h, stream); });
  ep.check_errors(stream);
  PlainAllToAll plain_dispatch(world, counts.tokens_per_rank, dispatch_row),
      plain_combine(world, counts.tokens_per_rank, combine_row);
  const double p_dispatch = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { plain_dispatch.run(stream); });
  const double p_combine = 1e3 * slowest_rank_median_ms(world, stream, o.iters, [&] { plain_combine.run(stream); });
  rows.push_back({"ht_dispatch_bf16", "tdist", o.ht_tokens, t_dispatch, remote_tokens * dispatch_row});
  rows.push_back({"ht_dispatch_bf16", "nccl", o.ht_tokens, p_dispatch, plain_dispatch.remote_bytes()});
  rows.push_back({"ht_combine_bf16", "tdist", o.ht_tokens, t_combine, remote_tokens * combine_row});
  rows.push_back({"ht_combine_bf16", "nccl", o.ht_tokens, p_combine, plain_combine.remote_bytes()});
}

int run(const Options& o, int argc, char** argv) {
  World world;
  if (world.world_size() < 2) throw cli::UsageError("needs at least 2 ranks (tdistrun -n 2 bench_ep)");
  if (o.experts % world.world_size() != 0) throw cli::UsageError("--experts must be a multiple of the world size");
  size_t heap_bytes = 64ull << 20;
  if (o.mode != "ht")
    heap_bytes += ep_heap_bytes({.max_tokens = o.ll_tokens, .hidden = o.hidden, .num_experts = o.experts, .topk = o.topk},
                                world.world_size());
  if (o.mode != "ll")
    heap_bytes += ep_heap_bytes({.max_tokens = o.ht_tokens, .hidden = o.hidden, .num_experts = o.experts,
                                 .topk = o.topk, .mode = EpMode::kHighThroughput},
                                world.world_size());
  SymmetricHeap heap(world, heap_bytes);
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Row> rows;
  if (o.mode != "ht") bench_ll(world, heap, stream, o, rows);
  if (o.mode != "ll") bench_ht(world, heap, stream, o, rows);
  // Bytes per rank differ slightly with the routing: report the largest.
  for (Row& r : rows) r.remote_bytes = world.max_across_ranks("ep bench bytes", {r.remote_bytes})[0];
  if (world.rank() == 0) {
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    std::printf("\nEP all-to-all, %d ranks on %s, hidden %lld, %d experts, top-%d, median of %d (slowest rank)\n",
                world.world_size(), prop.name, static_cast<long long>(o.hidden), o.experts, o.topk, o.iters);
    std::printf("%-28s %7s %-6s %10s %12s\n", "op", "tokens", "impl", "us", "GB/s remote");
    for (const Row& r : rows)
      std::printf("%-28s %7lld %-6s %10.1f %12.1f\n", r.op.c_str(), static_cast<long long>(r.tokens), r.impl.c_str(),
                  r.us, r.remote_bytes / (r.us * 1e3));
    if (!o.json_path.empty()) {
      json::Value doc = bench::document("ep", prop.name, world.world_size(), o.bf16 ? "bf16" : "fp8+bf16", argc, argv);
      doc["hidden"] = o.hidden;
      doc["experts"] = o.experts;
      doc["topk"] = o.topk;
      doc["iters"] = o.iters;
      for (const Row& r : rows)
        doc["rows"].push_back(json::Object{{"op", r.op},
                                           {"impl", r.impl},
                                           {"tokens", r.tokens},
                                           {"bytes", r.remote_bytes},
                                           {"us", r.us},
                                           {"algbw_gbps", r.remote_bytes / (r.us * 1e3)}});
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
                       "send/recv of the same rows. Run under tdistrun -n 2 (or more).");
  p.choice("--mode", "ll, ht or both (default both)", {"ll", "ht", "both"}, &o.mode);
  p.option("--tokens", "N", "low-latency tokens per rank (default 128)", &o.ll_tokens, 1, 1 << 16);
  p.option("--ht-tokens", "N", "high-throughput tokens per rank (default 4096)", &o.ht_tokens, 1, 1 << 20);
  p.option("--hidden", "H", "channels per token, a multiple of 128 (default 7168)", &o.hidden, 128, 1 << 16);
  p.option("--experts", "E", "experts, a multiple of the world size (default 256)", &o.experts, 1, 1 << 13);
  p.option("--topk", "K", "experts per token (default 8)", &o.topk, 1, 32);
  p.option("--sms", "N", "blocks of the send kernels (default: every SM for LL, 24 for HT)", &o.sms, 0, 1024);
  p.flag("--bf16", "low-latency dispatch in bf16 instead of FP8", &o.bf16);
  p.option("--iters", "N", "timings per figure, the median is kept (default 50)", &o.iters, 3, 1000000);
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &o.json_path);
  p.parse(argc, argv);
  if (o.hidden % 128 != 0) p.fail("--hidden expects a multiple of 128");
  if (o.topk > o.experts) p.fail("--topk expects at most --experts");
  return tdist::cli::run_main("bench_ep", [&] { return run(o, argc, argv); });
}
