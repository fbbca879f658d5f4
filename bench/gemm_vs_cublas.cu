// tdist::Gemm beside cuBLAS (cublasGemmEx, fp32 compute) in the same run, one GPU: D = A x B^T with
// A M x K and B N x K row-major (cuBLAS: op(A) = T on the N x K operand, "TN"), bf16 or fp16.
// Per shape: both outputs cross-checked on the same inputs, then each timed with CUDA events around
// every launch (warm-up first), median of --iters, input sets rotated so that the sets together are
// larger than twice the L2 and no timed launch finds its operands there. Prints a table (TFLOP/s and
// the tdist / cuBLAS time ratio) and, with --json FILE, writes the rows.
//
// Then the m-grouped GEMM of MoE layers: tdist::GroupedGemm (one launch) beside a loop of one
// cuBLAS GEMM per non-empty group, on the same inputs: G groups of random sizes (mean M, 0.25 M to
// 1.75 M rows), each padded to grouped_gemm_alignment() for tdist (padding rows of A are zeros),
// the real row counts for cuBLAS; TFLOP/s count the real rows for both.
//
//   build-gpu/bench/bench_gemm_vs_cublas [--dtype bf16|fp16] [--iters 20] [--shapes MxNxK,...]
//                                        [--tiles] [--tune] [--grouped GxMxNxK,... | --no-grouped]
//                                        [--json FILE]
//   --tiles    also times every shipped tile of tdist on each shape (for tuning the heuristic)
//   --tune     runs tdist's autotuner per shape first and times its winner
//   --grouped  grouped shapes: G groups of M rows on average, N x K weights per group
//
// cuBLAS comes through tdist::CublasGemm (dlopen of libcublas.so.13, or TDIST_CUBLAS_LIBRARY).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "../tools/common/bench_report.hpp"
#include "fill_random.cuh"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_info.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/json.hpp"
#include "tdist/ops/detail/cublas.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/ops/grouped_gemm.hpp"

namespace {

// max |x - y| and max |y| over two outputs.
__global__ void diff(const unsigned short* x, const unsigned short* y, size_t count, bool bf16, float* out) {
  float e = 0, mx = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float a, b;
    if (bf16) {
      __nv_bfloat16 va, vb;
      memcpy(&va, x + i, 2);
      memcpy(&vb, y + i, 2);
      a = __bfloat162float(va), b = __bfloat162float(vb);
    } else {
      __half va, vb;
      memcpy(&va, x + i, 2);
      memcpy(&vb, y + i, 2);
      a = __half2float(va), b = __half2float(vb);
    }
    const float d = fabsf(a - b);
    e = fmaxf(e, d != d ? INFINITY : d);
    mx = fmaxf(mx, fabsf(b));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(e));
  atomicMax(reinterpret_cast<int*>(out + 1), __float_as_int(mx));
}

struct Shape {
  int m, n, k;
  std::string note;
};

// Median milliseconds of `launch(set)`, each launch between two events, sets rotating.
double median_ms(cudaStream_t s, int iters, int sets, const std::function<void(int)>& launch) {
  for (int i = 0; i < 5; ++i) launch(i % sets);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(iters + 1);
  for (auto& e : ev) TDIST_CUDA_CHECK(cudaEventCreate(&e));
  TDIST_CUDA_CHECK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < iters; ++i) {
    launch((i + 5) % sets);
    TDIST_CUDA_CHECK(cudaEventRecord(ev[i + 1], s));
  }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) TDIST_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
  for (auto& e : ev) TDIST_CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

struct GroupedShape {
  int groups, mean_rows, n, k;
  std::string note;
};

std::vector<GroupedShape> parse_grouped_shapes(const std::string& s) {
  std::vector<GroupedShape> v;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    GroupedShape sh{};
    TDIST_CHECK_ARG(
        std::sscanf(s.substr(pos, end - pos).c_str(), "%dx%dx%dx%d", &sh.groups, &sh.mean_rows, &sh.n, &sh.k) == 4 &&
            sh.groups > 0 && sh.mean_rows >= 0,
        "--grouped", "expected GxMxNxK[,GxMxNxK...] with G > 0, got ", s);
    sh.note = "custom";
    v.push_back(sh);
    pos = end + 1;
  }
  return v;
}

// One grouped shape: tdist::GroupedGemm beside a per-group cuBLAS loop. Appends a JSON row to `rows`.
void bench_grouped(const GroupedShape& sh, tdist::DType dtype, int iters, int l2, tdist::GroupedGemm& grouped,
                   tdist::CublasGemm& cublas, cudaStream_t stream, tdist::json::Value& doc) {
  const bool bf16 = dtype == tdist::DType::kBFloat16;
  std::vector<int64_t> counts(sh.groups);
  unsigned long long x = 0x2545F4914F6CDD1Dull * (sh.groups + 31ull * sh.mean_rows + 7ull * sh.n + sh.k);
  int64_t real_rows = 0;
  for (auto& c : counts) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<int64_t>(sh.mean_rows * (0.25 + 1.5 * static_cast<double>(x % 10000) / 10000.0));
    real_rows += c;
  }
  const std::vector<int64_t> offsets = tdist::grouped_gemm_offsets(counts);
  const int64_t m_total = std::max<int64_t>(offsets.back(), 1);
  const size_t a_elems = static_cast<size_t>(m_total) * sh.k, b_elems = static_cast<size_t>(sh.groups) * sh.n * sh.k;
  const size_t d_elems = static_cast<size_t>(m_total) * sh.n;
  const size_t set_bytes = 2 * (a_elems + b_elems);
  const int sets = static_cast<int>(std::max<size_t>(2, (2 * static_cast<size_t>(l2) + set_bytes - 1) / set_bytes + 1));
  std::vector<unsigned short*> as(sets), bs(sets);
  unsigned short *d_tdist = nullptr, *d_cublas = nullptr;
  float* stats = nullptr;
  int* offs = nullptr;
  for (int s = 0; s < sets; ++s) {
    TDIST_CUDA_CHECK(cudaMalloc(&as[s], 2 * a_elems));
    TDIST_CUDA_CHECK(cudaMalloc(&bs[s], 2 * b_elems));
    fill_random<<<528, 256, 0, stream>>>(as[s], a_elems, 17 * s + 5, bf16);
    fill_random<<<528, 256, 0, stream>>>(bs[s], b_elems, 17 * s + 6, bf16);
    for (int g = 0; g < sh.groups; ++g)  // padding rows of A: zeros (so D's are zeros, as cuBLAS leaves them)
      TDIST_CUDA_CHECK(cudaMemsetAsync(as[s] + static_cast<size_t>(offsets[g] + counts[g]) * sh.k, 0,
                                       2 * static_cast<size_t>(offsets[g + 1] - offsets[g] - counts[g]) * sh.k,
                                       stream));
  }
  TDIST_CUDA_CHECK(cudaMalloc(&d_tdist, 2 * d_elems));
  TDIST_CUDA_CHECK(cudaMalloc(&d_cublas, 2 * d_elems));
  TDIST_CUDA_CHECK(cudaMalloc(&stats, 2 * sizeof(float)));
  TDIST_CUDA_CHECK(cudaMalloc(&offs, sizeof(int) * offsets.size()));
  const std::vector<int> offs32(offsets.begin(), offsets.end());
  TDIST_CUDA_CHECK(cudaMemcpyAsync(offs, offs32.data(), sizeof(int) * offs32.size(), cudaMemcpyHostToDevice, stream));
  TDIST_CUDA_CHECK(cudaMemsetAsync(d_cublas, 0, 2 * d_elems, stream));

  auto grouped_args = [&](int s) {
    tdist::GroupedGemmArgs g;
    g.a = as[s];
    g.b = bs[s];
    g.d = d_tdist;
    g.offsets = offs;
    g.m = m_total;
    g.n = sh.n;
    g.k = sh.k;
    g.num_groups = sh.groups;
    g.dtype = dtype;
    return g;
  };
  auto cublas_loop = [&](int s) {
    for (int g = 0; g < sh.groups; ++g) {
      if (counts[g] == 0) continue;
      tdist::GemmArgs a;
      a.a = as[s] + static_cast<size_t>(offsets[g]) * sh.k;
      a.b = bs[s] + static_cast<size_t>(g) * sh.n * sh.k;
      a.d = d_cublas + static_cast<size_t>(offsets[g]) * sh.n;
      a.m = counts[g];
      a.n = sh.n;
      a.k = sh.k;
      a.dtype = dtype;
      cublas.run(a, stream);
    }
  };
  // Cross-check on set 0 over every row of the groups (padding rows: zeros on both sides).
  TDIST_CUDA_CHECK(cudaMemsetAsync(d_tdist, 0xFF, 2 * d_elems, stream));
  TDIST_CUDA_CHECK(cudaMemsetAsync(stats, 0, 2 * sizeof(float), stream));
  grouped.run(grouped_args(0), stream);
  cublas_loop(0);
  diff<<<528, 256, 0, stream>>>(d_tdist, d_cublas, static_cast<size_t>(offsets.back()) * sh.n, bf16, stats);
  float host_stats[2];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host_stats, stats, sizeof(host_stats), cudaMemcpyDeviceToHost, stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  const float rel = host_stats[1] > 0 ? host_stats[0] / host_stats[1] : host_stats[0];

  const double flop = 2.0 * static_cast<double>(real_rows) * sh.n * static_cast<double>(sh.k);
  const double cublas_ms = median_ms(stream, iters, sets, cublas_loop);
  const double ms = median_ms(stream, iters, sets, [&](int s) { grouped.run(grouped_args(s), stream); });
  const std::string tile_name = grouped.tile_for(grouped_args(0)).name();
  char shape[64];
  std::snprintf(shape, sizeof(shape), "%dx%dx%dx%d", sh.groups, sh.mean_rows, sh.n, sh.k);
  std::printf("%-20s %-18s %10.1f %8.1f %10.1f %8.1f %7.3f %10.2e  %s\n", shape, tile_name.c_str(), ms * 1e3,
              flop / ms * 1e-9, cublas_ms * 1e3, flop / cublas_ms * 1e-9, ms / cublas_ms, rel, sh.note.c_str());
  std::fflush(stdout);
  // Schema tdist.bench/1: the grouped GEMM and the per-group cuBLAS loop, one row each.
  auto row = [&](const char* impl, const std::string& method, double us) {
    return tdist::json::Value(tdist::json::Object{{"op", "grouped_gemm"},
                                                  {"groups", sh.groups},
                                                  {"mean_rows", sh.mean_rows},
                                                  {"m", real_rows},
                                                  {"padded_rows", offsets.back()},
                                                  {"n", sh.n},
                                                  {"k", sh.k},
                                                  {"impl", impl},
                                                  {"method", method},
                                                  {"us", us},
                                                  {"tflops", flop / us * 1e-6}});
  };
  tdist::json::Value t = row("tdist", tile_name, ms * 1e3);
  t["ratio_cublas"] = ms / cublas_ms;
  t["max_rel_diff"] = rel;
  doc["rows"].push_back(t);
  doc["rows"].push_back(row("cublas", "cublas_loop", cublas_ms * 1e3));
  for (int s = 0; s < sets; ++s) {
    TDIST_CUDA_CHECK(cudaFree(as[s]));
    TDIST_CUDA_CHECK(cudaFree(bs[s]));
  }
  for (void* p :
       {static_cast<void*>(d_tdist), static_cast<void*>(d_cublas), static_cast<void*>(stats), static_cast<void*>(offs)})
    TDIST_CUDA_CHECK(cudaFree(p));
}

std::vector<Shape> parse_shapes(const std::string& s) {
  std::vector<Shape> v;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    Shape sh{};
    TDIST_CHECK_ARG(std::sscanf(s.substr(pos, end - pos).c_str(), "%dx%dx%d", &sh.m, &sh.n, &sh.k) == 3, "--shapes",
                    "expected MxNxK[,MxNxK...], got ", s);
    sh.note = "custom";
    v.push_back(sh);
    pos = end + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dtype_name = "bf16", shapes_arg, grouped_arg, json;
  int iters = 20;
  bool all_tiles = false, tune = false, no_grouped = false;
  tdist::cli::Parser p("bench_gemm_vs_cublas", "tdist::Gemm beside cuBLAS on one GPU (LOCAL_RANK picks it).");
  p.choice("--dtype", "element type (default bf16)", {"bf16", "fp16", "f16"}, &dtype_name);
  p.option("--iters", "N", "timed launches, the median is kept (default 20)", &iters, 1, 1000000);
  p.option("--shapes", "MxNxK,...", "shapes to time (default: the LLM shapes)", &shapes_arg);
  p.flag("--tiles", "also time every tile configuration", &all_tiles);
  p.flag("--tune", "let the autotuner pick the tile", &tune);
  p.option("--grouped", "GxMxNxK,...", "grouped-GEMM shapes: G groups of about M rows (default: MoE shapes)",
           &grouped_arg);
  p.flag("--no-grouped", "skip the grouped GEMM beside the per-group cuBLAS loop", &no_grouped);
  p.option("--json", "FILE", "also write the results as JSON", &json);
  p.parse(argc, argv);
  if (dtype_name == "f16") dtype_name = "fp16";
  return tdist::cli::run_main("bench_gemm_vs_cublas", [&]() -> int {
    const tdist::DType dtype = tdist::parse_dtype(dtype_name);
    const bool bf16 = dtype == tdist::DType::kBFloat16;
    TDIST_CHECK_ARG(dtype != tdist::DType::kFloat32, "--dtype", "bf16 or fp16");
    const char* local_rank = std::getenv("LOCAL_RANK");
    TDIST_CUDA_CHECK(cudaSetDevice(local_rank ? std::atoi(local_rank) : 0));
    // 8192^3 and the LLaMA-3-70B shapes at TP = 2 of shared/BASELINES.md (hidden 8192, MLP 28672 / 2):
    // AG-GEMM M x 14336 x 8192 and M x 8192 x 8192 (full M), GEMM-RS M x 8192 x 14336 (local K).
    std::vector<Shape> shapes = {
        {8192, 8192, 8192, "square; cuBLAS 764 TFLOP/s in BASELINES"},
        {4096, 14336, 8192, "AG-GEMM M=4096 N=14336"},
        {8192, 14336, 8192, "AG-GEMM M=8192 N=14336"},
        {8192, 8192, 14336, "GEMM-RS M=8192 local K=14336"},
        {4096, 8192, 8192, "AG-GEMM M=4096 N=8192"},
        {1024, 14336, 8192, "AG-GEMM M=1024 N=14336"},
        {1024, 8192, 14336, "GEMM-RS M=1024 local K"},
        {16384, 8192, 8192, "AG-GEMM M=16384 N=8192"},
    };
    if (!shapes_arg.empty()) shapes = parse_shapes(shapes_arg);

    const int device = tdist::current_device();
    int l2 = 0;
    TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    cudaDeviceProp prop{};
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    cudaStream_t stream;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    tdist::Gemm gemm;
    tdist::CublasGemm cublas;
    std::printf("%s, %d SMs, L2 %d MB, %s, median of %d\n", prop.name, gemm.num_sms(), l2 >> 20, dtype_name.c_str(),
                iters);
    std::printf("%-20s %-18s %10s %8s %10s %8s %7s %10s  %s\n", "M x N x K", "tdist tile", "tdist us", "TFLOP/s",
                "cuBLAS us", "TFLOP/s", "ratio", "max diff", "shape");
    tdist::json::Value doc = tdist::bench::document("gemm_vs_cublas", prop.name, 1, dtype_name, argc, argv);
    doc["iters"] = iters;
    for (const Shape& sh : shapes) {
      const size_t a_elems = static_cast<size_t>(sh.m) * sh.k, b_elems = static_cast<size_t>(sh.n) * sh.k;
      const size_t d_elems = static_cast<size_t>(sh.m) * sh.n;
      const size_t set_bytes = 2 * (a_elems + b_elems);
      const int sets =
          static_cast<int>(std::max<size_t>(2, (2 * static_cast<size_t>(l2) + set_bytes - 1) / set_bytes + 1));
      std::vector<unsigned short*> as(sets), bs(sets);
      unsigned short *d_tdist = nullptr, *d_cublas = nullptr;
      float* stats = nullptr;
      for (int s = 0; s < sets; ++s) {
        TDIST_CUDA_CHECK(cudaMalloc(&as[s], 2 * a_elems));
        TDIST_CUDA_CHECK(cudaMalloc(&bs[s], 2 * b_elems));
        fill_random<<<528, 256, 0, stream>>>(as[s], a_elems, 17 * s + 1, bf16);
        fill_random<<<528, 256, 0, stream>>>(bs[s], b_elems, 17 * s + 2, bf16);
      }
      TDIST_CUDA_CHECK(cudaMalloc(&d_tdist, 2 * d_elems));
      TDIST_CUDA_CHECK(cudaMalloc(&d_cublas, 2 * d_elems));
      TDIST_CUDA_CHECK(cudaMalloc(&stats, 2 * sizeof(float)));
      auto args = [&](int s) {
        tdist::GemmArgs g;
        g.a = as[s];
        g.b = bs[s];
        g.d = d_tdist;
        g.m = sh.m;
        g.n = sh.n;
        g.k = sh.k;
        g.dtype = dtype;
        return g;
      };
      auto cublas_args = [&](int s) {
        tdist::GemmArgs g = args(s);
        g.d = d_cublas;
        return g;
      };
      if (tune) gemm.tune(args(0), stream);
      // Cross-check on set 0.
      TDIST_CUDA_CHECK(cudaMemsetAsync(d_tdist, 0xFF, 2 * d_elems, stream));
      TDIST_CUDA_CHECK(cudaMemsetAsync(stats, 0, 2 * sizeof(float), stream));
      gemm.run(args(0), stream);
      cublas.run(cublas_args(0), stream);
      diff<<<528, 256, 0, stream>>>(d_tdist, d_cublas, d_elems, bf16, stats);
      float host_stats[2];
      TDIST_CUDA_CHECK(cudaMemcpyAsync(host_stats, stats, sizeof(host_stats), cudaMemcpyDeviceToHost, stream));
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
      const float rel = host_stats[1] > 0 ? host_stats[0] / host_stats[1] : host_stats[0];

      const double flop = 2.0 * sh.m * sh.n * static_cast<double>(sh.k);
      const double cublas_ms = median_ms(stream, iters, sets, [&](int s) { cublas.run(cublas_args(s), stream); });
      std::vector<std::pair<std::string, std::optional<tdist::GemmTile>>> variants = {{"", std::nullopt}};
      if (all_tiles)
        for (const auto& t : tdist::gemm_tiles()) variants.push_back({t.name(), t});
      for (const auto& [label, tile] : variants) {
        tdist::GemmRunOptions o;
        o.tile = tile;
        const std::string tile_name =
            tile ? tile->name()
                 : (tune ? "tuned " : "auto ") +
                       tdist::with_b_multicast(tdist::choose_gemm_tile(sh.m, sh.n, sh.k, gemm.num_sms()), sh.m, bs[0],
                                               sh.k, dtype)
                           .name();
        const double ms = median_ms(stream, iters, sets, [&](int s) { gemm.run(args(s), stream, o); });
        char shape[64];
        std::snprintf(shape, sizeof(shape), "%dx%dx%d", sh.m, sh.n, sh.k);
        std::printf("%-20s %-18s %10.1f %8.1f %10.1f %8.1f %7.3f %10.2e  %s\n", shape,
                    tune && !tile ? "tuned" : tile_name.c_str(), ms * 1e3, flop / ms * 1e-9, cublas_ms * 1e3,
                    flop / cublas_ms * 1e-9, ms / cublas_ms, rel, sh.note.c_str());
        std::fflush(stdout);
        // Schema tdist.bench/1: the tdist row (with its tile), and cuBLAS's once per shape.
        auto row = [&](const char* impl, const std::string& method, double us) {
          return tdist::json::Value(tdist::json::Object{{"op", "gemm"},
                                                        {"m", sh.m},
                                                        {"n", sh.n},
                                                        {"k", sh.k},
                                                        {"impl", impl},
                                                        {"method", method},
                                                        {"us", us},
                                                        {"tflops", flop / us * 1e-6}});
        };
        tdist::json::Value t = row("tdist", tile_name, ms * 1e3);
        t["ratio_cublas"] = ms / cublas_ms;
        t["max_rel_diff"] = rel;
        doc["rows"].push_back(t);
        if (!tile) doc["rows"].push_back(row("cublas", "cublas", cublas_ms * 1e3));
      }
      for (int s = 0; s < sets; ++s) {
        TDIST_CUDA_CHECK(cudaFree(as[s]));
        TDIST_CUDA_CHECK(cudaFree(bs[s]));
      }
      TDIST_CUDA_CHECK(cudaFree(d_tdist));
      TDIST_CUDA_CHECK(cudaFree(d_cublas));
      TDIST_CUDA_CHECK(cudaFree(stats));
    }
    if (!no_grouped) {
      // MoE expert GEMMs (Mixtral-8x7B-like at 8 experts, fine-grained DeepSeek-like at 64 and 128):
      // up projections (N = FFN width, K = hidden) and down projections.
      std::vector<GroupedShape> gshapes = {
          {8, 2048, 14336, 4096, "8 experts, up, 16k tokens"}, {8, 2048, 4096, 14336, "8 experts, down"},
          {8, 256, 14336, 4096, "8 experts, up, 2k tokens"},   {64, 512, 2048, 7168, "64 experts, up"},
          {64, 512, 7168, 2048, "64 experts, down"},           {128, 128, 2048, 7168, "128 experts, few tokens each"},
      };
      if (!grouped_arg.empty()) gshapes = parse_grouped_shapes(grouped_arg);
      tdist::GroupedGemm grouped;
      std::printf("\n%-20s %-18s %10s %8s %10s %8s %7s %10s  %s\n", "G x M x N x K", "tdist tile", "tdist us",
                  "TFLOP/s", "cuBLAS loop", "TFLOP/s", "ratio", "max diff", "grouped shape");
      for (const GroupedShape& sh : gshapes) bench_grouped(sh, dtype, iters, l2, grouped, cublas, stream, doc);
    }
    std::printf(
        "ratio: tdist time / cuBLAS time (below 1: tdist faster); max diff: max |tdist - cuBLAS| / max |cuBLAS|\n");
    if (!json.empty()) tdist::json::write_file(json, doc);
    return 0;
  });
}
