// MoE tensor-parallel layers (ops/moe.hpp) beside the grouped GEMM alone and the unfused sequence:
//   ag   MoeAgGroupGemm, N = 2 x intermediate / world (gate and up), K = hidden
//   rs   MoeGroupGemmRs, N = hidden, K = intermediate / world
// per model (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite) and M, with uniform random top-k routing
// (the same ids on every rank). Columns: chunked (tdist's overlap), baseline (NCCL AllGather or
// ReduceScatter and the grouped GEMM in sequence, OverlapMethod::kBaseline), gemm (tdist::GroupedGemm
// alone on this rank's expert-ordered rows: no gather, no reduce, no communication).
//
//   tdistrun -n 2 -- bench_moe [--models mixtral,qwen3,dsv2lite] [--m 1024,4096,16384] [--iters 20]
//                              [--json FILE]
#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../tools/common/bench_report.hpp"
#include "fill_random.cuh"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/json.hpp"
#include "tdist/ops/grouped_gemm.hpp"
#include "tdist/ops/moe.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

struct Model {
  std::string name;
  int64_t hidden, inter;
  int experts, topk;
};

const std::vector<Model> kModels = {{"mixtral", 4096, 14336, 8, 2},
                                    {"qwen3", 2048, 768, 128, 8},
                                    {"dsv2lite", 2048, 1408, 64, 6}};

// Median ms over `iters` launches of each variant (alternating), maximum over the ranks.
std::vector<double> time_variants(World& world, cudaStream_t s, int iters,
                                  const std::vector<std::function<void()>>& vs) {
  for (int w = 0; w < 3; ++w)
    for (const auto& v : vs) v();
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  world.barrier("moe bench start");
  const size_t nv = vs.size();
  std::vector<cudaEvent_t> ev(2 * nv * iters);
  for (auto& e : ev) TDIST_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i)
    for (size_t v = 0; v < nv; ++v) {
      TDIST_CUDA_CHECK(cudaEventRecord(ev[2 * (i * nv + v)], s));
      vs[v]();
      TDIST_CUDA_CHECK(cudaEventRecord(ev[2 * (i * nv + v) + 1], s));
    }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> med(nv);
  for (size_t v = 0; v < nv; ++v) {
    std::vector<float> ms(iters);
    for (int i = 0; i < iters; ++i)
      TDIST_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * (i * nv + v)], ev[2 * (i * nv + v) + 1]));
    std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
    med[v] = ms[iters / 2];
  }
  for (auto& e : ev) TDIST_CUDA_CHECK(cudaEventDestroy(e));
  return world.max_across_ranks("moe bench timing", med);
}

DeviceBuffer random_buffer(size_t elems, unsigned long long seed, cudaStream_t s) {
  DeviceBuffer b(std::max<size_t>(elems, 1) * 2);
  fill_random<<<1024, 256, 0, s>>>(b.get<unsigned short>(), elems, seed, true);
  TDIST_CUDA_CHECK(cudaGetLastError());
  return b;
}

struct Row {
  std::string model, op;
  int64_t m, n, k;
  double chunked_us, baseline_us, gemm_us;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models = {"mixtral", "qwen3", "dsv2lite"};
  std::vector<int64_t> ms = {1024, 4096, 16384};
  int iters = 20;
  std::string json_path;
  size_t heap_bytes = size_t{4} << 30;
  cli::Parser p("bench_moe", "MoE tensor-parallel layers beside the grouped GEMM alone and NCCL + grouped GEMM.\n"
                             "Run under a launcher: tdistrun -n 2 bench_moe");
  p.option("--models", "LIST", "mixtral,qwen3,dsv2lite (default all)",
           [&](const std::string& v) { models = cli::split_list(v, "--models"); });
  p.option("--m", "LIST", "M (all ranks' tokens), default 1024,4096,16384", [&](const std::string& v) {
    ms.clear();
    for (const auto& s : cli::split_list(v, "--m")) ms.push_back(cli::parse_int(s, "--m", 1, int64_t{1} << 24));
  });
  p.option("--iters", "N", "timed launches per variant, the median is kept (default 20)", &iters, 1, 100000);
  p.option("--heap", "BYTES", "symmetric heap per rank (default 4G)",
           [&](const std::string& v) { heap_bytes = cli::parse_size(v, "--heap"); });
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &json_path);
  p.parse(argc, argv);
  for (const auto& name : models)
    if (std::none_of(kModels.begin(), kModels.end(), [&](const Model& m) { return m.name == name; }))
      p.fail("--models expects mixtral, qwen3 or dsv2lite, got '" + name + "'");

  return cli::run_main("bench_moe", [&]() -> int {
    World world;
    SymmetricHeap heap(world, heap_bytes);
    const int w = world.world_size(), rank = world.rank();
    cudaStream_t s;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    std::vector<Row> rows;
    GroupedGemm gg;
    if (rank == 0)
      std::printf("moe: %d ranks on %s, bf16, uniform random routing; us = median, max over ranks\n", w, prop.name);
    for (const Model& md : kModels) {
      if (std::find(models.begin(), models.end(), md.name) == models.end()) continue;
      for (int64_t m : ms) {
        const int64_t n_up = 2 * md.inter / w, k_down = md.inter / w;
        const int64_t cap = moe_capacity(m, md.topk, md.experts);
        std::mt19937_64 rng(1234 + m);
        std::vector<int> ids(m * md.topk);
        std::vector<float> weights(m * md.topk, 1.0f / md.topk);
        for (int64_t t = 0; t < m; ++t) {
          std::vector<int> pool(md.experts);
          for (int e = 0; e < md.experts; ++e) pool[e] = e;
          for (int k = 0; k < md.topk; ++k) {  // partial Fisher-Yates: top-k distinct experts
            std::swap(pool[k], pool[k + rng() % (md.experts - k)]);
            ids[t * md.topk + k] = pool[k];
          }
        }
        DeviceBuffer d_ids(ids.size() * 4), d_w(weights.size() * 4);
        TDIST_CUDA_CHECK(cudaMemcpy(d_ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        TDIST_CUDA_CHECK(cudaMemcpy(d_w.get(), weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
        const uint64_t local_rows = m / w + (rank < m % w ? 1 : 0);
        DeviceBuffer x = random_buffer(local_rows * md.hidden, 11 + rank, s);
        DeviceBuffer b1 = random_buffer(static_cast<size_t>(md.experts) * n_up * md.hidden, 22 + rank, s);
        DeviceBuffer b2 = random_buffer(static_cast<size_t>(md.experts) * md.hidden * k_down, 33 + rank, s);
        DeviceBuffer up_out(cap * n_up * 2), h = random_buffer(cap * k_down, 44 + rank, s);
        DeviceBuffer y(std::max<uint64_t>(local_rows, 1) * md.hidden * 2);
        DeviceBuffer a_rows = random_buffer(cap * md.hidden, 55 + rank, s), d_rows(cap * md.hidden * 2);
        {
          MoeAgGroupGemm up(world, heap, {.max_m = m, .k = md.hidden, .experts = md.experts, .topk = md.topk});
          MoeGroupGemmRs down(world, heap, {.max_m = m, .max_n = md.hidden, .experts = md.experts, .topk = md.topk});
          const MoeAgGroupGemmArgs ag{.a_local = x.get(), .topk_ids = d_ids.get<int>(), .b = b1.get(),
                                      .d = up_out.get(), .m = m, .n = n_up};
          up.run(ag, s);
          const MoeRouting& r = up.routing();
          const MoeGroupGemmRsArgs rs{.h = h.get(), .b = b2.get(), .topk_weights = d_w.get<float>(), .routing = &r,
                                      .d = y.get(), .m = m, .n = md.hidden, .k = k_down};
          const GroupedGemmArgs gemm_up{.a = a_rows.get(), .b = b1.get(), .d = up_out.get(), .offsets = r.offsets,
                                        .m = cap, .n = n_up, .k = md.hidden, .num_groups = md.experts};
          const GroupedGemmArgs gemm_down{.a = h.get(), .b = b2.get(), .d = d_rows.get(), .offsets = r.offsets,
                                          .m = cap, .n = md.hidden, .k = k_down, .num_groups = md.experts};
          const auto t_ag = time_variants(world, s, iters,
                                          {[&] { up.run(ag, s, OverlapMethod::kChunked); },
                                           [&] { up.run(ag, s, OverlapMethod::kBaseline); },
                                           [&] { gg.run(gemm_up, s); }});
          // The down projection reuses the last routing (the ids do not change).
          const auto t_rs = time_variants(world, s, iters,
                                          {[&] { down.run(rs, s, OverlapMethod::kChunked); },
                                           [&] { down.run(rs, s, OverlapMethod::kBaseline); },
                                           [&] { gg.run(gemm_down, s); }});
          rows.push_back({md.name, "ag", m, n_up, md.hidden, t_ag[0] * 1e3, t_ag[1] * 1e3, t_ag[2] * 1e3});
          rows.push_back({md.name, "rs", m, md.hidden, k_down, t_rs[0] * 1e3, t_rs[1] * 1e3, t_rs[2] * 1e3});
          TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
        }
        if (rank == 0)
          for (size_t i = rows.size() - 2; i < rows.size(); ++i) {
            const Row& r = rows[i];
            std::printf("%-9s %-3s m %6lld n %6lld k %6lld  chunked %9.1f  baseline %9.1f  gemm %9.1f  "
                        "chunked/gemm %.3f  chunked/baseline %.3f\n",
                        r.model.c_str(), r.op.c_str(), static_cast<long long>(r.m), static_cast<long long>(r.n),
                        static_cast<long long>(r.k), r.chunked_us, r.baseline_us, r.gemm_us, r.chunked_us / r.gemm_us,
                        r.chunked_us / r.baseline_us);
            std::fflush(stdout);
          }
      }
    }
    if (rank == 0 && !json_path.empty()) {
      json::Value doc = bench::document("moe", prop.name, w, "bf16", argc, argv);
      doc["iters"] = iters;
      doc["statistic"] = "median of per-call CUDA-event times, max over ranks (us)";
      for (const Row& r : rows)
        for (const auto& [impl, us] : {std::pair<const char*, double>{"chunked", r.chunked_us},
                                       {"baseline", r.baseline_us},
                                       {"gemm", r.gemm_us}})
          doc["rows"].push_back(json::Value(json::Object{{"model", r.model},
                                                         {"op", r.op},
                                                         {"m", r.m},
                                                         {"n", r.n},
                                                         {"k", r.k},
                                                         {"impl", impl},
                                                         {"us", us},
                                                         {"ratio_gemm", us / r.gemm_us},
                                                         {"ratio_baseline", us / r.baseline_us}}));
      json::write_file(json_path, doc);
    }
    TDIST_CUDA_CHECK(cudaStreamDestroy(s));
    return 0;
  });
}
