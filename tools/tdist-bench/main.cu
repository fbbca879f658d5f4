// tdist-bench: tdist's collectives beside NCCL (C API on the World's communicator), in the same run,
// alternating, over a sweep of sizes. Run under a launcher, one GPU per rank:
//
//   tdistrun -n 2 build/tools/tdist-bench --op all --dtype bf16 --sizes 1K:1G --method auto --json out.json
//
// --sizes takes MIN:MAX (every power of two between), a comma list (4K,64K,1M) or random:N (N sizes
// from 1 KB to 1 GB drawn from --seed, odd element counts among them, include/tdist/common/
// random_sweep.hpp; --print-sweep lists them and exits), as `python -m tdist.bench` does. Rows are
// printed as they are measured, in the manner of nccl-tests: time, algorithm and bus bandwidth of
// tdist and of NCCL, and #wrong: with --check on (the default) each size is first run once by both
// on the same random inputs into poisoned outputs, and #wrong
// counts tdist's output elements that differ from NCCL's (exactly for AllGather, within the
// rounding of a sum of world-size terms for the reductions). The JSON file has the schema of
// tools/common/bench_report.hpp.
//
// Sizes follow nccl-tests: the AllReduce buffer, the AllGather output, the ReduceScatter input (a size
// that is not whole per-rank parts is rounded down to them, and reported so).
// Bus bandwidth: AllReduce 2(n-1)/n x size / time, AllGather and ReduceScatter (n-1)/n x size / time.
// Sizes up to --graph-max are timed as CUDA-graph replays (many ops per graph, per-op time: no launch
// floor); larger ones with CUDA events around single ops. Each figure is the median of --iters
// timings, the slowest rank's. Data is random and non-zero. tdist gets symmetric buffers (zero copy)
// unless --buffers ordinary; NCCL gets ordinary device memory. tdist's SM kernels use programmatic
// dependent launch unless --pdl off; --pdl both times each method both ways, alternating. Each
// method (--method all: every one) takes turns with NCCL three times, and its row's NCCL columns are
// the NCCL times taken beside it; the JSON's NCCL row is NCCL's best over the size's methods.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../common/bench_report.hpp"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/json.hpp"
#include "tdist/common/random_sweep.hpp"
#include "tdist/ops/collectives.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/timing.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

__global__ void random_fill(unsigned short* p, size_t halves, unsigned long long seed, bool f32) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < halves;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float v = (static_cast<float>(x % 2001) - 1000.5f) / 1000.0f;  // non-zero, in (-1, 1)
    if (f32) {
      if (i % 2 == 0 && i + 1 < halves) *reinterpret_cast<float*>(p + i) = v;
    } else {
      p[i] = __bfloat16_as_ushort(__float2bfloat16(v));
    }
  }
}

// Counts the elements of `got` that differ from `want` by more than tol * (1 + |want|); a NaN
// (the poison left where nothing was written) always counts.
__global__ void count_wrong(const void* got, const void* want, size_t count, int kind, float tol,
                            unsigned long long* wrong) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float g, w;
    if (kind == 0) {
      g = __bfloat162float(__ushort_as_bfloat16(static_cast<const unsigned short*>(got)[i]));
      w = __bfloat162float(__ushort_as_bfloat16(static_cast<const unsigned short*>(want)[i]));
    } else if (kind == 1) {
      g = __half2float(__ushort_as_half(static_cast<const unsigned short*>(got)[i]));
      w = __half2float(__ushort_as_half(static_cast<const unsigned short*>(want)[i]));
    } else {
      g = static_cast<const float*>(got)[i];
      w = static_cast<const float*>(want)[i];
    }
    if (!(fabsf(g - w) <= tol * (1.0f + fabsf(w)))) ++mine;
  }
  if (mine) atomicAdd(wrong, mine);
}

struct Options {
  std::vector<std::string> ops = {"all_gather", "reduce_scatter", "all_reduce"};
  DType dtype = DType::kBFloat16;
  std::string method = "auto";
  int iters = 20;
  std::string json;
  bool quick = false;
  bool check = true;
  size_t graph_max = 4ull << 20;
  int ops_per_graph = 100;
  size_t ll_bytes = CollectivesOptions{}.ll_bytes;        // low-latency buffer per rank
  size_t ll128_bytes = CollectivesOptions{}.ll128_bytes;  // LL128 buffer per rank
  bool symmetric = true;
  std::vector<bool> pdl = {true};  // programmatic launch settings to time
  std::vector<size_t> sizes;
  uint64_t seed = 1;  // of --sizes random:N
  bool print_sweep = false;
};

// "MIN:MAX" (powers of two from MIN), "A,B,C" or "random:N" (tdist/common/random_sweep.hpp:
// multiples of the element size, odd element counts among them).
std::vector<size_t> parse_sizes(const std::string& v, size_t elem_size, uint64_t seed) {
  std::vector<size_t> sizes;
  if (sweep::is_random(v)) {
    for (uint64_t s : sweep::random_sizes(sweep::parse_random_count(v, "--sizes"), seed, elem_size))
      sizes.push_back(static_cast<size_t>(s));
  } else if (const auto colon = v.find(':'); colon != std::string::npos) {
    const size_t lo = cli::parse_size(v.substr(0, colon), "--sizes"),
                 hi = cli::parse_size(v.substr(colon + 1), "--sizes");
    if (lo == 0 || lo > hi) throw cli::UsageError("--sizes expects MIN:MAX with 0 < MIN <= MAX, got '" + v + "'");
    for (size_t s = lo; s <= hi && s != 0; s *= 2) sizes.push_back(s);
  } else {
    for (const auto& item : cli::split_list(v, "--sizes")) {
      const size_t s = cli::parse_size(item, "--sizes");
      if (s == 0) throw cli::UsageError("--sizes expects sizes above 0, got '" + v + "'");
      sizes.push_back(s);
    }
  }
  return sizes;
}

Options parse(int argc, char** argv) {
  Options o;
  std::string sizes = "1K:1G", dtype = "bf16", pdl = "on", buffers = "symmetric", check = "on";
  cli::Parser p("tdist-bench",
                "tdist's collectives beside NCCL, in the same run, alternating, over a sweep of sizes.\n"
                "Run under a launcher, one GPU per rank: tdistrun -n 2 tdist-bench --op all");
  p.option(
      "--op,--ops", "LIST", "all_gather, reduce_scatter, all_reduce, a comma list of them, or all (default)",
      [&](const std::string& v) {
        o.ops.clear();
        for (const auto& item : cli::split_list(v, "--op")) {
          if (item == "all")
            o.ops = {"all_gather", "reduce_scatter", "all_reduce"};
          else if (item == "all_gather" || item == "reduce_scatter" || item == "all_reduce")
            o.ops.push_back(item);
          else
            throw cli::UsageError("--op expects all_gather, reduce_scatter, all_reduce or all, got '" + item + "'");
        }
      });
  p.choice("--dtype", "element type (default bf16)", {"bf16", "f16", "fp16", "f32", "fp32"}, &dtype);
  p.option("--sizes", "MIN:MAX|A,B,..|random:N",
           "bytes: powers of two from MIN to MAX, a list (K/M/G suffixes), or N random sizes from 1K to 1G, "
           "odd element counts among them (default 1K:1G)",
           &sizes);
  p.option("--seed", "S", "seed of --sizes random:N: the same S gives the same sizes (default 1)", &o.seed, 0,
           std::numeric_limits<int64_t>::max());
  p.flag("--print-sweep", "print the sizes, one per line, and exit", &o.print_sweep);
  p.option("--method,--methods", "NAME",
           "auto, a method name of the op, or all: auto, then every method of the op (default auto)", &o.method);
  p.option("--iters", "N", "timings per figure, the median is kept (default 20)", &o.iters, 3, 1000000);
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &o.json);
  p.flag("--quick", "a short sweep: 8K, 256K, 4M, 64M, at most 10 iterations", &o.quick);
  p.choice("--check", "verify tdist's output against NCCL's before timing (default on)", {"on", "off"}, &check);
  p.option("--graph-max", "BYTES", "time sizes up to this as CUDA-graph replays (default 4M)",
           [&](const std::string& v) { o.graph_max = cli::parse_size(v, "--graph-max"); });
  p.option("--ops-per-graph", "N", "ops captured per graph (default 100)", &o.ops_per_graph, 1, 100000);
  p.choice("--buffers", "tdist's buffers (default symmetric: zero copy)", {"symmetric", "ordinary"}, &buffers);
  p.option("--ll-bytes", "BYTES", "low-latency buffer per rank",
           [&](const std::string& v) { o.ll_bytes = cli::parse_size(v, "--ll-bytes"); });
  p.option("--ll128-bytes", "BYTES", "LL128 buffer per rank",
           [&](const std::string& v) { o.ll128_bytes = cli::parse_size(v, "--ll128-bytes"); });
  p.choice("--pdl", "programmatic dependent launch of tdist's kernels (default on)", {"on", "off", "both"}, &pdl);
  p.parse(argc, argv);
  o.dtype = parse_dtype(dtype == "fp16" ? "f16" : dtype == "fp32" ? "f32" : dtype);
  try {
    o.sizes = parse_sizes(sizes, dtype_size(o.dtype), o.seed);
  } catch (const cli::UsageError& e) {
    p.fail(e.what());
  }
  o.check = check == "on";
  o.symmetric = buffers == "symmetric";
  o.pdl = pdl == "both" ? std::vector<bool>{true, false} : std::vector<bool>{pdl == "on"};
  if (o.quick) {
    o.sizes = {8ull << 10, 256ull << 10, 4ull << 20, 64ull << 20};
    o.iters = std::min(o.iters, 10);
  }
  return o;
}

std::vector<std::string> methods_for(const std::string& op, const std::string& choice) {
  // "all" times auto beside every method, so one run shows auto against the best of them.
  if (choice != "all") return {choice};
  if (op == "all_reduce") return {"auto", "ll", "ll128", "one_shot", "two_shot", "ce"};
  if (op == "all_gather") return {"auto", "ll", "sm", "sm_push", "ce_push", "ce_pull"};
  return {"auto", "ll", "fused", "ce"};
}

double bus_factor(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// Median per-op microseconds of `op` over `iters` timings (graph replays or single ops); the slowest
// rank's figure.
double time_op(World& world, cudaStream_t s, bool graph, int ops_per_graph, int iters,
               const std::function<void()>& op) {
  cudaGraphExec_t exec = nullptr;
  int per = 1;
  if (graph) {
    per = ops_per_graph;
    cudaGraph_t g;
    TDIST_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < per; ++k) op();
    TDIST_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    TDIST_CUDA_CHECK(cudaGraphDestroy(g));
  }
  auto run = [&] {
    if (graph)
      TDIST_CUDA_CHECK(cudaGraphLaunch(exec, s));
    else
      op();
  };
  const double us = slowest_rank_median_ms(world, s, iters, run) * 1000.0 / per;
  if (exec) TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return us;
}

int run(const Options& opt, int argc, char** argv) {
  World world;
  const int n = world.world_size(), me = world.rank();
  if (n < 2) throw cli::UsageError("needs at least 2 ranks (tdistrun -n 2 tdist-bench ...)");
  const size_t S = *std::max_element(opt.sizes.begin(), opt.sizes.end());
  const size_t buf = S + 4096;
  CollectivesOptions coll_options;
  coll_options.ll_bytes = opt.ll_bytes;
  coll_options.ll128_bytes = opt.ll128_bytes;
  const int sms = sm_count(world.device());
  const size_t per_context = Collectives::heap_bytes(n, S, sms, coll_options);
  SymmetricHeap heap(world, opt.pdl.size() * per_context + (opt.symmetric ? 2 * buf : 0) + (16ull << 20));
  // One context per programmatic-launch setting, each with its own buffers.
  std::vector<std::unique_ptr<Collectives>> contexts;
  for (bool pdl : opt.pdl) {
    coll_options.programmatic_launch = pdl;
    contexts.push_back(std::make_unique<Collectives>(world, heap, S, coll_options));
  }
  char *n_in, *n_out, *t_in, *t_out;
  unsigned long long* wrong_count;
  TDIST_CUDA_CHECK(cudaMalloc(&n_in, buf));
  TDIST_CUDA_CHECK(cudaMalloc(&n_out, buf));
  TDIST_CUDA_CHECK(cudaMalloc(&wrong_count, sizeof(unsigned long long)));
  if (opt.symmetric) {
    t_in = heap.allocate_array<char>(buf);
    t_out = heap.allocate_array<char>(buf);
  } else {
    TDIST_CUDA_CHECK(cudaMalloc(&t_in, buf));
    TDIST_CUDA_CHECK(cudaMalloc(&t_out, buf));
  }
  const bool f32 = opt.dtype == DType::kFloat32;
  // The same random data in NCCL's and tdist's inputs: their outputs must agree.
  for (char* p : {n_in, t_in})
    random_fill<<<1024, 256>>>(reinterpret_cast<unsigned short*>(p), buf / 2, 1234 + me, f32);
  TDIST_CUDA_CHECK(cudaMemcpy(n_out, n_in, buf, cudaMemcpyDeviceToDevice));
  TDIST_CUDA_CHECK(cudaMemcpy(t_out, t_in, buf, cudaMemcpyDeviceToDevice));
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const ncclDataType_t nt = opt.dtype == DType::kFloat32   ? ncclFloat32
                            : opt.dtype == DType::kFloat16 ? ncclFloat16
                                                           : ncclBfloat16;
  const size_t sz = dtype_size(opt.dtype);
  const int kind = opt.dtype == DType::kBFloat16 ? 0 : opt.dtype == DType::kFloat16 ? 1 : 2;
  // A sum of n terms in (-1, 1) rounded in another order: a few units in the last place per term.
  const float sum_tol = static_cast<float>(n) * (kind == 0 ? 1.0f / 64 : kind == 1 ? 1.0f / 512 : 1e-5f);

  cudaDeviceProp prop;
  TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
  json::Value doc = bench::document("tdist-bench", prop.name, n, to_string(opt.dtype), argc, argv);
  doc["buffers"] = opt.symmetric ? "symmetric" : "ordinary";
  doc["iters"] = opt.iters;
  doc["graph_max_bytes"] = opt.graph_max;
  doc["check"] = opt.check;
  doc["seed"] = opt.seed;
  doc["statistic"] = "median per-op time of --iters timings, the slowest rank's (us)";

  if (me == 0) {
    std::printf(
        "# tdist-bench %s: %d ranks on %s, %s, %s buffers for tdist; graph-timed up to %zu bytes; median of %d\n",
        tdist::version(), n, prop.name, to_string(opt.dtype), opt.symmetric ? "symmetric" : "ordinary", opt.graph_max,
        opt.iters);
    std::printf("# %-14s %12s %12s %-18s %3s | %10s %8s %8s %6s | %10s %8s %8s | %7s\n", "", "", "", "", "", "tdist",
                "", "", "", "nccl", "", "", "");
    std::printf("# %-14s %12s %12s %-18s %3s | %10s %8s %8s %6s | %10s %8s %8s | %7s\n", "op", "size (B)", "count",
                "method", "pdl", "time (us)", "algbw", "busbw", "#wrong", "time (us)", "algbw", "busbw", "speedup");
    std::fflush(stdout);
  }

  const std::vector<std::string>& ops = opt.ops;
  long long total_wrong = 0;
  for (const std::string& op : ops) {
    for (size_t drawn : opt.sizes) {
      // Elements the op's count argument names: AllReduce all, AllGather/ReduceScatter per rank. The
      // size reported (and its bandwidth) is the buffer the op moves: the drawn size rounded down to
      // whole per-rank parts.
      const size_t per = op == "all_reduce" ? drawn / sz : drawn / sz / n;
      if (per == 0) continue;
      const size_t bytes = op == "all_reduce" ? per * sz : per * n * sz;
      const size_t out_count = op == "all_gather" ? per * n : per;
      const bool graph = bytes <= opt.graph_max;
      const int ops_per_graph = bytes <= (1ull << 20) ? opt.ops_per_graph : std::max(1, opt.ops_per_graph / 5);
      double nccl_best = 1e30;  // NCCL's best over every method's rounds: its row
      for (const std::string& mname : methods_for(op, opt.method)) {
        std::vector<std::function<void()>> run_tdist;  // one per context
        std::string resolved;
        try {
          for (auto& ctx : contexts) {
            Collectives& c = *ctx;
            if (op == "all_reduce") {
              const auto m = c.tune_all_reduce(t_in, t_out, per, opt.dtype, s, parse_all_reduce_method(mname));
              resolved = to_string(m);
              run_tdist.push_back([&, m, per] { c.all_reduce(t_in, t_out, per, opt.dtype, s, m); });
            } else if (op == "all_gather") {
              const auto m = c.tune_all_gather(t_in, t_out, per, opt.dtype, s, parse_all_gather_method(mname));
              resolved = to_string(m);
              run_tdist.push_back([&, m, per] { c.all_gather(t_in, t_out, per, opt.dtype, s, m); });
            } else {
              const auto m = c.tune_reduce_scatter(t_in, t_out, per, opt.dtype, s, parse_reduce_scatter_method(mname));
              resolved = to_string(m);
              run_tdist.push_back([&, m, per] { c.reduce_scatter(t_in, t_out, per, opt.dtype, s, m); });
            }
          }
        } catch (const tdist::Error& e) {
          if (opt.method == "all") continue;  // this method cannot run the size
          throw;
        }
        auto run_nccl = [&, op, per] {
          if (op == "all_reduce")
            TDIST_NCCL_CHECK(ncclAllReduce(n_in, n_out, per, nt, ncclSum, world.comm(), s));
          else if (op == "all_gather")
            TDIST_NCCL_CHECK(ncclAllGather(n_in, n_out, per, nt, world.comm(), s));
          else
            TDIST_NCCL_CHECK(ncclReduceScatter(n_in, n_out, per, nt, ncclSum, world.comm(), s));
        };
        // --check: each context once into a poisoned output (all ones: NaN in every type), then
        // NCCL once; #wrong is the worst rank's count.
        std::vector<long long> wrong(contexts.size(), -1);
        if (opt.check) {
          for (size_t c = 0; c < contexts.size(); ++c) {
            TDIST_CUDA_CHECK(cudaMemsetAsync(t_out, 0xFF, out_count * sz, s));
            TDIST_CUDA_CHECK(cudaMemsetAsync(n_out, 0xFF, out_count * sz, s));
            // Peers may store into this rank's symmetric output: every poison lands before any op.
            TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
            world.barrier("bench poison");
            run_tdist[c]();
            run_nccl();
            TDIST_CUDA_CHECK(cudaMemsetAsync(wrong_count, 0, sizeof(unsigned long long), s));
            count_wrong<<<256, 256, 0, s>>>(t_out, n_out, out_count, kind, op == "all_gather" ? 0.0f : sum_tol,
                                            wrong_count);
            TDIST_CUDA_CHECK(cudaGetLastError());
            unsigned long long host = 0;
            TDIST_CUDA_CHECK(cudaMemcpyAsync(&host, wrong_count, sizeof(host), cudaMemcpyDeviceToHost, s));
            TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
            wrong[c] = static_cast<long long>(world.max_across_ranks("bench check", {static_cast<double>(host)})[0]);
            total_wrong += wrong[c];
          }
        }
        // Alternate tdist (each context) and NCCL, three times each, for every method: each method is
        // compared with the NCCL times taken beside it (same clocks, same neighbours); keep each one's
        // best median.
        std::vector<double> t_best(contexts.size(), 1e30);
        double nccl_us = 1e30;
        for (int r = 0; r < 3; ++r) {
          for (size_t c = 0; c < contexts.size(); ++c)
            t_best[c] = std::min(t_best[c], time_op(world, s, graph, ops_per_graph, opt.iters, run_tdist[c]));
          nccl_us = std::min(nccl_us, time_op(world, s, graph, ops_per_graph, opt.iters, run_nccl));
        }
        nccl_best = std::min(nccl_best, nccl_us);
        const double algbw = static_cast<double>(bytes) / 1e3;  // bytes / us = MB/s; / 1e3 = GB/s
        const double busbw = bus_factor(op, n) * algbw;
        const std::string method = mname == "auto" ? "auto:" + resolved : resolved;
        for (size_t c = 0; c < contexts.size(); ++c) {
          const double t = t_best[c];
          json::Value row = json::Object{{"op", op},
                                         {"bytes", bytes},
                                         {"count", per},
                                         {"impl", "tdist"},
                                         {"method", method},
                                         {"pdl", static_cast<bool>(opt.pdl[c])},
                                         {"timing", graph ? "graph" : "events"},
                                         {"us", t},
                                         {"algbw_gbps", algbw / t},
                                         {"busbw_gbps", busbw / t},
                                         {"speedup_vs_nccl", nccl_us / t}};
          row["wrong"] = wrong[c] >= 0 ? json::Value(wrong[c]) : json::Value();
          doc["rows"].push_back(row);
          if (me == 0) {
            const std::string wrong_text = wrong[c] >= 0 ? std::to_string(wrong[c]) : "N/A";
            std::printf("  %-14s %12zu %12zu %-18s %3s | %10.2f %8.2f %8.2f %6s | %10.2f %8.2f %8.2f | %6.2fx\n",
                        op.c_str(), bytes, per, method.c_str(), opt.pdl[c] ? "on" : "off", t, algbw / t, busbw / t,
                        wrong_text.c_str(), nccl_us, algbw / nccl_us, busbw / nccl_us, nccl_us / t);
            std::fflush(stdout);
          }
        }
      }
      if (nccl_best < 1e30) {
        const double algbw = static_cast<double>(bytes) / 1e3;
        doc["rows"].push_back(json::Object{{"op", op},
                                           {"bytes", bytes},
                                           {"count", per},
                                           {"impl", "nccl"},
                                           {"method", "nccl"},
                                           {"timing", graph ? "graph" : "events"},
                                           {"us", nccl_best},
                                           {"algbw_gbps", algbw / nccl_best},
                                           {"busbw_gbps", bus_factor(op, n) * algbw / nccl_best}});
      }
    }
  }

  if (me == 0) {
    if (opt.check) std::printf("# out of bounds values: %lld %s\n", total_wrong, total_wrong ? "ERROR" : "OK");
    if (!opt.json.empty()) {
      json::write_file(opt.json, doc);
      std::printf("# wrote %s\n", opt.json.c_str());
    }
  }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  world.barrier("bench end");
  cudaFree(n_in);
  cudaFree(n_out);
  cudaFree(wrong_count);
  if (!opt.symmetric) {
    cudaFree(t_in);
    cudaFree(t_out);
  }
  return total_wrong ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (opt.print_sweep) {
    for (size_t s : opt.sizes) std::printf("%zu\n", s);
    return 0;
  }
  return cli::run_main("tdist-bench", [&] { return run(opt, argc, argv); });
}
