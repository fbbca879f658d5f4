// tdist-bench: tdist's collectives beside NCCL (C API on the World's communicator), in the same run,
// alternating, over a sweep of sizes. Run under a launcher, one GPU per rank:
//
//   tdistrun -n 2 build/tools/tdist-bench --op all --dtype bf16 --sizes 1K:1G --method auto --json out.json
//
// Sizes follow nccl-tests: the AllReduce buffer, the AllGather output, the ReduceScatter input.
// Bus bandwidth: AllReduce 2(n-1)/n x size / time, AllGather and ReduceScatter (n-1)/n x size / time.
// Sizes up to --graph-max are timed as CUDA-graph replays (many ops per graph, per-op time: no launch
// floor); larger ones with CUDA events around single ops. Each figure is the median of --iters
// timings, the slowest rank's. Data is random and non-zero. tdist gets symmetric buffers (zero copy)
// unless --buffers ordinary; NCCL gets ordinary device memory. tdist's SM kernels use programmatic
// dependent launch unless --pdl off; --pdl both times each method both ways, alternating.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tdist/runtime/timing.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/ops/collectives.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

__global__ void random_fill(unsigned short* p, size_t halves, unsigned long long seed, bool f32) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < halves; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
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

struct Options {
  std::string op = "all";
  DType dtype = DType::kBFloat16;
  size_t min_bytes = 1024, max_bytes = 1ull << 30;
  std::string method = "auto";
  int iters = 20;
  std::string json;
  bool quick = false;
  size_t graph_max = 4ull << 20;
  int ops_per_graph = 100;
  size_t ll_bytes = CollectivesOptions{}.ll_bytes;        // low-latency buffer per rank
  size_t ll128_bytes = CollectivesOptions{}.ll128_bytes;  // LL128 buffer per rank
  bool symmetric = true;
  std::vector<bool> pdl = {true};  // programmatic launch settings to time
  std::vector<size_t> sizes;  // explicit list (--quick)
};

struct Row {
  std::string op, method;
  size_t bytes;
  double tdist_us, tdist_busbw, nccl_us, nccl_busbw;
  bool graph;
  bool pdl;
};

[[noreturn]] void usage(const char* argv0, const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: %s [--op all_gather|reduce_scatter|all_reduce|all] [--dtype bf16|f16|f32]\n"
               "  [--sizes MIN:MAX (powers of 2, K/M/G suffixes)] [--method auto|<name>|all] [--iters N]\n"
               "  [--json FILE] [--quick] [--graph-max BYTES] [--ops-per-graph N] [--buffers symmetric|ordinary]\n"
               "  [--ll-bytes BYTES (low-latency buffer per rank)] [--ll128-bytes BYTES (LL128 buffer per rank)]\n"
               "  [--pdl on|off|both (programmatic dependent launch of tdist's kernels)]\n",
               why.c_str(), argv0);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(argv[0], a + " needs a value");
      return argv[++i];
    };
    if (a == "--op") o.op = value();
    else if (a == "--dtype") o.dtype = parse_dtype(value());
    else if (a == "--sizes") {
      const std::string v = value();
      const auto colon = v.find(':');
      o.min_bytes = SymmetricHeap::parse_size(v.substr(0, colon), "--sizes");
      o.max_bytes = colon == std::string::npos ? o.min_bytes : SymmetricHeap::parse_size(v.substr(colon + 1), "--sizes");
    } else if (a == "--method") o.method = value();
    else if (a == "--iters") o.iters = std::max(3, std::atoi(value().c_str()));
    else if (a == "--json") o.json = value();
    else if (a == "--quick") o.quick = true;
    else if (a == "--graph-max") o.graph_max = SymmetricHeap::parse_size(value(), "--graph-max");
    else if (a == "--ops-per-graph") o.ops_per_graph = std::max(1, std::atoi(value().c_str()));
    else if (a == "--ll-bytes") o.ll_bytes = SymmetricHeap::parse_size(value(), "--ll-bytes");
    else if (a == "--ll128-bytes") o.ll128_bytes = SymmetricHeap::parse_size(value(), "--ll128-bytes");
    else if (a == "--pdl") {
      const std::string v = value();
      if (v != "on" && v != "off" && v != "both") usage(argv[0], "--pdl: on, off or both");
      o.pdl = v == "both" ? std::vector<bool>{true, false} : std::vector<bool>{v == "on"};
    } else if (a == "--buffers") {
      const std::string v = value();
      if (v != "symmetric" && v != "ordinary") usage(argv[0], "--buffers: symmetric or ordinary");
      o.symmetric = v == "symmetric";
    } else usage(argv[0], "unknown argument " + a);
  }
  if (o.op != "all" && o.op != "all_reduce" && o.op != "all_gather" && o.op != "reduce_scatter")
    usage(argv[0], "--op: all_gather, reduce_scatter, all_reduce or all");
  if (o.quick) {
    o.sizes = {8ull << 10, 256ull << 10, 4ull << 20, 64ull << 20};
    o.iters = std::min(o.iters, 10);
    o.max_bytes = 64ull << 20;
  } else {
    for (size_t s = o.min_bytes; s <= o.max_bytes; s *= 2) o.sizes.push_back(s);
  }
  if (o.sizes.empty()) usage(argv[0], "--sizes: empty range");
  return o;
}

std::vector<std::string> methods_for(const std::string& op, const std::string& choice) {
  if (choice != "all") return {choice};
  if (op == "all_reduce") return {"ll", "ll128", "one_shot", "two_shot", "ce"};
  if (op == "all_gather") return {"ll", "sm", "sm_push", "ce_push", "ce_pull"};
  return {"ll", "fused", "ce"};
}

double bus_factor(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// Median per-op microseconds of `op` over `iters` timings (graph replays or single ops); the slowest
// rank's figure.
double time_op(World& world, cudaStream_t s, bool graph, int ops_per_graph, int iters, const std::function<void()>& op) {
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
    if (graph) TDIST_CUDA_CHECK(cudaGraphLaunch(exec, s));
    else op();
  };
  const double us = slowest_rank_median_ms(world, s, iters, run) * 1000.0 / per;
  if (exec) TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return us;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  World world;
  const int n = world.world_size(), me = world.rank();
  if (n < 2) {
    std::fprintf(stderr, "tdist-bench needs at least 2 ranks (tdistrun -n 2)\n");
    return 2;
  }
  const size_t S = *std::max_element(opt.sizes.begin(), opt.sizes.end());
  const size_t buf = S + 4096;
  CollectivesOptions coll_options;
  coll_options.ll_bytes = opt.ll_bytes;
  coll_options.ll128_bytes = opt.ll128_bytes;
  int sms = 0;
  TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, world.device()));
  const size_t per_context = Collectives::heap_bytes(n, S, sms, coll_options);
  SymmetricHeap heap(world, opt.pdl.size() * per_context + (opt.symmetric ? 2 * buf : 0) + (16ull << 20));
  // One context per programmatic-launch setting, each with its own buffers.
  std::vector<std::unique_ptr<Collectives>> contexts;
  for (bool pdl : opt.pdl) {
    coll_options.programmatic_launch = pdl;
    contexts.push_back(std::make_unique<Collectives>(world, heap, S, coll_options));
  }
  char *n_in, *n_out, *t_in, *t_out;
  TDIST_CUDA_CHECK(cudaMalloc(&n_in, buf));
  TDIST_CUDA_CHECK(cudaMalloc(&n_out, buf));
  if (opt.symmetric) {
    t_in = heap.allocate_array<char>(buf);
    t_out = heap.allocate_array<char>(buf);
  } else {
    TDIST_CUDA_CHECK(cudaMalloc(&t_in, buf));
    TDIST_CUDA_CHECK(cudaMalloc(&t_out, buf));
  }
  const bool f32 = opt.dtype == DType::kFloat32;
  for (char* p : {n_in, t_in}) random_fill<<<1024, 256>>>(reinterpret_cast<unsigned short*>(p), buf / 2, 1234 + me, f32);
  TDIST_CUDA_CHECK(cudaMemcpy(n_out, n_in, buf, cudaMemcpyDeviceToDevice));
  TDIST_CUDA_CHECK(cudaMemcpy(t_out, t_in, buf, cudaMemcpyDeviceToDevice));
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const ncclDataType_t nt = opt.dtype == DType::kFloat32 ? ncclFloat32 : opt.dtype == DType::kFloat16 ? ncclFloat16 : ncclBfloat16;
  const size_t sz = dtype_size(opt.dtype);

  std::vector<std::string> ops = opt.op == "all" ? std::vector<std::string>{"all_gather", "reduce_scatter", "all_reduce"}
                                                 : std::vector<std::string>{opt.op};
  std::vector<Row> rows;
  for (const std::string& op : ops) {
    for (size_t bytes : opt.sizes) {
      // Elements the op's count argument names: AllReduce all, AllGather/ReduceScatter per rank.
      const size_t per = op == "all_reduce" ? bytes / sz : bytes / sz / n;
      if (per == 0) continue;
      const bool graph = bytes <= opt.graph_max;
      const int ops_per_graph = bytes <= (1ull << 20) ? opt.ops_per_graph : std::max(1, opt.ops_per_graph / 5);
      double nccl_us = -1;
      for (const std::string& mname : methods_for(op, opt.method)) {
        std::vector<std::function<void()>> run_tdist;  // one per context
        std::string resolved;
        try {
          for (auto& ctx : contexts) {
            Collectives& c = *ctx;
            if (op == "all_reduce") {
              const auto m = c.all_reduce_method(t_in, t_out, per, opt.dtype, parse_all_reduce_method(mname));
              resolved = to_string(m);
              run_tdist.push_back([&, m, per] { c.all_reduce(t_in, t_out, per, opt.dtype, s, m); });
            } else if (op == "all_gather") {
              const auto m = c.all_gather_method(t_in, t_out, per, opt.dtype, parse_all_gather_method(mname));
              resolved = to_string(m);
              run_tdist.push_back([&, m, per] { c.all_gather(t_in, t_out, per, opt.dtype, s, m); });
            } else {
              const auto m = c.reduce_scatter_method(t_in, t_out, per, opt.dtype, parse_reduce_scatter_method(mname));
              resolved = to_string(m);
              run_tdist.push_back([&, m, per] { c.reduce_scatter(t_in, t_out, per, opt.dtype, s, m); });
            }
          }
        } catch (const tdist::Error& e) {
          if (opt.method == "all") continue;  // this method cannot run the size
          throw;
        }
        auto run_nccl = [&, op, per] {
          if (op == "all_reduce") TDIST_NCCL_CHECK(ncclAllReduce(n_in, n_out, per, nt, ncclSum, world.comm(), s));
          else if (op == "all_gather") TDIST_NCCL_CHECK(ncclAllGather(n_in, n_out, per, nt, world.comm(), s));
          else TDIST_NCCL_CHECK(ncclReduceScatter(n_in, n_out, per, nt, ncclSum, world.comm(), s));
        };
        // Alternate tdist (each context) and NCCL, three times each; keep each one's best median.
        std::vector<double> t_best(contexts.size(), 1e30);
        double n_best = nccl_us > 0 ? nccl_us : 1e30;
        const int rounds = nccl_us > 0 ? 2 : 3;
        for (int r = 0; r < rounds; ++r) {
          for (size_t c = 0; c < contexts.size(); ++c)
            t_best[c] = std::min(t_best[c], time_op(world, s, graph, ops_per_graph, opt.iters, run_tdist[c]));
          if (nccl_us < 0) n_best = std::min(n_best, time_op(world, s, graph, ops_per_graph, opt.iters, run_nccl));
        }
        nccl_us = n_best;
        const double f = bus_factor(op, n) * bytes / 1e3;  // bytes / us = MB/s; / 1e3 = GB/s
        for (size_t c = 0; c < contexts.size(); ++c) {
          const double t = t_best[c];
          rows.push_back({op, opt.method == "auto" ? "auto:" + resolved : resolved, bytes, t, f / t, nccl_us,
                          f / nccl_us, graph, opt.pdl[c]});
          if (me == 0) {
            std::printf("%-15s %10zu %-16s %-3s %10.2f us %8.1f GB/s | nccl %10.2f us %8.1f GB/s | %5.2fx\n",
                        op.c_str(), bytes, rows.back().method.c_str(), opt.pdl[c] ? "pdl" : "", t, f / t, nccl_us,
                        f / nccl_us, nccl_us / t);
            std::fflush(stdout);
          }
        }
      }
    }
  }

  if (me == 0) {
    cudaDeviceProp prop;
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    std::printf("\ntdist-bench: %d ranks on %s, %s, %s buffers for tdist; graph-timed up to %zu bytes; median of %d\n", n,
                prop.name, to_string(opt.dtype), opt.symmetric ? "symmetric" : "ordinary", opt.graph_max, opt.iters);
    std::printf("%-15s %12s %-18s %4s %11s %11s %11s %11s %11s\n", "op", "bytes", "tdist method", "pdl", "tdist us",
                "tdist GB/s", "NCCL us", "NCCL GB/s", "NCCL/tdist");
    for (const Row& r : rows)
      std::printf("%-15s %12zu %-18s %4s %11.2f %11.1f %11.2f %11.1f %11.2f\n", r.op.c_str(), r.bytes, r.method.c_str(),
                  r.pdl ? "on" : "off", r.tdist_us, r.tdist_busbw, r.nccl_us, r.nccl_busbw, r.nccl_us / r.tdist_us);
    if (!opt.json.empty()) {
      std::ofstream j(opt.json);
      j << "{\n  \"bench\": \"tdist-bench\",\n  \"gpu\": \"" << json_escape(prop.name) << "\",\n  \"world_size\": " << n
        << ",\n  \"dtype\": \"" << to_string(opt.dtype) << "\",\n  \"buffers\": \""
        << (opt.symmetric ? "symmetric" : "ordinary") << "\",\n  \"iters\": " << opt.iters
        << ",\n  \"command\": \"" << json_escape(command) << "\",\n  \"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        j << "    {\"op\": \"" << r.op << "\", \"bytes\": " << r.bytes << ", \"method\": \"" << r.method
          << "\", \"timing\": \"" << (r.graph ? "graph" : "events") << "\", \"pdl\": " << (r.pdl ? "true" : "false")
          << ", \"tdist_us\": " << r.tdist_us
          << ", \"tdist_busbw_gbps\": " << r.tdist_busbw << ", \"nccl_us\": " << r.nccl_us
          << ", \"nccl_busbw_gbps\": " << r.nccl_busbw << ", \"speedup\": " << r.nccl_us / r.tdist_us << "}"
          << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      j << "  ]\n}\n";
      std::printf("wrote %s\n", opt.json.c_str());
    }
  }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  world.barrier("bench end");
  cudaFree(n_in);
  cudaFree(n_out);
  if (!opt.symmetric) {
    cudaFree(t_in);
    cudaFree(t_out);
  }
  return 0;
}
