// The overlapped tensor-parallel linear layers (tdist::AllGatherGemm, GemmReduceScatter,
// GemmAllReduce) beside what they must beat, in the same run, on every rank of the team:
//
//   tdist      the op with each method of --methods (default auto; a method the shape does not allow,
//              e.g. sequential with unequal per-rank counts, is skipped with a note)
//   gemm       tdist's own GEMM alone on this rank's problem: AllGather-GEMM the whole gathered
//              M x N_local x K, ReduceScatter / AllReduce the local M x N x K_local (the floor the
//              overlap approaches when communication is fully hidden)
//   baseline   the NCCL collective and cuBLAS in sequence (the op's kBaseline method), and its parts:
//              nccl (the collective alone, on World's communicator) and cublas (the GEMM alone)
//
// Every variant is timed with CUDA events around each launch, the variants alternating launch by
// launch (each launch preceded by an untimed one-element NCCL AllReduce so ranks enter it together;
// --no-align drops it), after warm-up; median of --iters per rank, the maximum over ranks reported.
// Input sets rotate so that together they exceed twice the L2. Before timing, each method's output is
// compared with the baseline's on the same inputs (max |diff| / max |baseline|, max over ranks).
//
// Default shapes: LLaMA-3-70B at TP = world (hidden 8192, MLP 28672 / 2 = 14336 per TP=2 pair):
//   ag_gemm  M x 14336 (total; N_local = 14336 / world) x 8192, and M=4096 x 8192 x 8192
//   gemm_rs, gemm_ar  M x 8192 x 14336 (total; K_local = 14336 / world), and M=4096 x 8192 x 8192
// with M in {1024, 4096, 8192, 16384}.
//
//   build-gpu/tools/tdistrun -n 2 -- build-gpu/bench/bench_gemm_overlap [--ops ag_gemm,gemm_rs,gemm_ar]
//       [--m 1024,4096] [--methods auto,fused,chunked,sequential,baseline] [--dtype bf16|fp16] [--iters 20]
//       [--heap 8G] [--no-align] [--json FILE] [--quick] [--shapes random:N|MxNxK,.. [--seed S]]
// --shapes replaces the default shapes and --m with whole layers (M x N x K, N and K split as above):
// a list, or random:N drawn from --seed (include/tdist/common/random_sweep.hpp: M 128..16384 with
// non-multiples of 128, N and K multiples of 8 in 1024..28672; the same list as
// `python -m tdist.bench --shapes random:N`); --print-sweep prints it and exits.
// (--rows is another name of --m and --heap-size of --heap, the names `python -m tdist.bench` uses;
// the JSON file has the schema of tools/common/bench_report.hpp, one row per op, M and variant.)
// Prints (rank 0 only) a table per op: M, method, tdist us, gemm-alone us, baseline us, nccl us,
// cublas us, tdist/gemm, tdist/baseline, TFLOP/s per GPU of the op, output difference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../tools/common/bench_report.hpp"
#include "fill_random.cuh"
#include "tdist/common/cli.hpp"
#include "tdist/common/cuda_check.hpp"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/json.hpp"
#include "tdist/common/random_sweep.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/detail/cublas.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/runtime/symmetric_heap.hpp"
#include "tdist/runtime/world.hpp"

using namespace tdist;

namespace {

__device__ inline float to_f(unsigned short bits, bool bf16) {
  if (bf16) {
    __nv_bfloat16 v;
    memcpy(&v, &bits, 2);
    return __bfloat162float(v);
  }
  __half v;
  memcpy(&v, &bits, 2);
  return __half2float(v);
}

// out[0] = max |x - y| (NaN counts as infinite), out[1] = max |y|.
__global__ void diff(const unsigned short* x, const unsigned short* y, size_t count, bool bf16, float* out) {
  float e = 0, mx = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float a = to_f(x[i], bf16), b = to_f(y[i], bf16);
    const float d = fabsf(a - b);
    e = fmaxf(e, d != d ? INFINITY : d);
    mx = fmaxf(mx, fabsf(b));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(e));
  atomicMax(reinterpret_cast<int*>(out + 1), __float_as_int(mx));
}

enum class Op { kAllGather, kReduceScatter, kAllReduce };
const char* op_name(Op op) {
  return op == Op::kAllGather ? "ag_gemm" : op == Op::kReduceScatter ? "gemm_rs" : "gemm_ar";
}
Op parse_op(const std::string& s) {
  if (s == "ag_gemm") return Op::kAllGather;
  if (s == "gemm_rs") return Op::kReduceScatter;
  if (s == "gemm_ar") return Op::kAllReduce;
  TDIST_FAIL("invalid argument '--ops': '", s, "' (expected ag_gemm, gemm_rs, gemm_ar)");
}

// A layer's shape in whole-model terms: ag_gemm splits N over the ranks, gemm_rs / gemm_ar split K.
struct Shape {
  int64_t m, n_total, k_total;
  std::string note;
};

struct Variant {
  std::string name;
  std::function<void(int set)> launch;
};

// Median ms of each variant's launches on this rank, maximum over the ranks. Launches alternate
// variant by variant; each sits between two events, after an untimed one-element AllReduce that
// lines the ranks up (when `align`).
std::vector<double> time_alternating(World& world, cudaStream_t s, int iters, int sets, const std::vector<Variant>& vs,
                                     bool align, float* align_buf) {
  const size_t nv = vs.size();
  auto line_up = [&] {
    if (align) TDIST_NCCL_CHECK(ncclAllReduce(align_buf, align_buf, 1, ncclFloat32, ncclSum, world.comm(), s));
  };
  for (int w = 0; w < 3; ++w)
    for (const Variant& v : vs) {
      line_up();
      v.launch(w % sets);
    }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  world.barrier("gemm_overlap timing start");
  std::vector<cudaEvent_t> ev(2 * nv * iters);
  for (auto& e : ev) TDIST_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i)
    for (size_t v = 0; v < nv; ++v) {
      line_up();
      TDIST_CUDA_CHECK(cudaEventRecord(ev[2 * (i * nv + v)], s));
      vs[v].launch((i + 3) % sets);
      TDIST_CUDA_CHECK(cudaEventRecord(ev[2 * (i * nv + v) + 1], s));
    }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> medians(nv);
  for (size_t v = 0; v < nv; ++v) {
    std::vector<float> ms(iters);
    for (int i = 0; i < iters; ++i)
      TDIST_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * (i * nv + v)], ev[2 * (i * nv + v) + 1]));
    std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
    medians[v] = ms[iters / 2];
  }
  for (auto& e : ev) TDIST_CUDA_CHECK(cudaEventDestroy(e));
  return world.max_across_ranks("gemm_overlap timing", medians);
}

struct Row {
  Op op;
  Shape shape;
  int64_t m, n, k;  // this rank's GEMM: ag_gemm M x N_local x K, gemm_rs / gemm_ar M x N x K_local
  std::string method, resolved;
  double tdist_us, gemm_us, cublas_us, nccl_us, baseline_us, tflops, max_rel_diff;
};

struct Options {
  std::vector<Op> ops = {Op::kAllGather, Op::kReduceScatter, Op::kAllReduce};
  std::vector<int64_t> ms = {1024, 4096, 8192, 16384};
  bool ms_given = false;
  std::vector<OverlapMethod> methods = {OverlapMethod::kAuto};
  DType dtype = DType::kBFloat16;
  int iters = 20;
  size_t heap = 8ull << 30;
  bool align = true, quick = false;
  std::string json;
  // --shapes: whole-layer (M, N, K), replacing the default shapes and --m; random:N draws them from
  // --seed (tdist/common/random_sweep.hpp).
  std::vector<sweep::GemmShape> layers;
  std::string shapes_spec;
  uint64_t seed = 1;
  bool print_sweep = false;
};

// "random:N" (drawn from `seed`) or "MxNxK,..."; N and K positive multiples of 8.
std::vector<sweep::GemmShape> parse_shapes(const std::string& v, uint64_t seed) {
  if (sweep::is_random(v)) return sweep::random_gemm_shapes(sweep::parse_random_count(v, "--shapes"), seed);
  std::vector<sweep::GemmShape> out;
  for (const auto& item : cli::split_list(v, "--shapes")) {
    const auto bad = [&] {
      return cli::UsageError("--shapes expects random:N or MxNxK,... with M >= 1 and N, K positive multiples of 8, "
                             "got '" + item + "'");
    };
    const size_t x1 = item.find_first_of("xX"), x2 = x1 == std::string::npos ? x1 : item.find_first_of("xX", x1 + 1);
    if (x2 == std::string::npos) throw bad();
    sweep::GemmShape sh{};
    try {
      sh.m = cli::parse_int(item.substr(0, x1), "--shapes", 1, int64_t{1} << 40);
      sh.n = cli::parse_int(item.substr(x1 + 1, x2 - x1 - 1), "--shapes", 8, int64_t{1} << 40);
      sh.k = cli::parse_int(item.substr(x2 + 1), "--shapes", 8, int64_t{1} << 40);
    } catch (const cli::UsageError&) {
      throw bad();
    }
    if (sh.n % 8 || sh.k % 8) throw bad();
    out.push_back(sh);
  }
  return out;
}

std::vector<Shape> shapes_of(Op op, const Options& o) {
  if (!o.layers.empty()) {
    std::vector<Shape> v;
    for (const sweep::GemmShape& l : o.layers)
      v.push_back({l.m, l.n, l.k, detail::concat("--shapes: N=", l.n, " total, K=", l.k, " total")});
    return v;
  }
  std::vector<int64_t> ms = o.ms;
  if (o.quick && !o.ms_given) ms = {1024, 8192};
  std::vector<Shape> v;
  for (int64_t m : ms) {
    if (op == Op::kAllGather)
      v.push_back({m, 14336, 8192, "LLaMA-3-70B MLP up: N=14336 total, K=8192"});
    else
      v.push_back({m, 8192, 14336, "LLaMA-3-70B MLP down: N=8192, K=14336 total"});
  }
  if (!o.quick && std::find(ms.begin(), ms.end(), 4096) != ms.end())
    v.push_back({4096, 8192, 8192,
                 op == Op::kAllGather ? "8192 x 8192 weight: N=8192 total" : "8192 x 8192 weight: K=8192 total"});
  return v;
}

// Per rank, the split dimension rounded down to a multiple of 8 (exact for the default shapes).
int64_t per_rank(int64_t total, int world) { return std::max<int64_t>(8, total / world / 8 * 8); }

struct Bench {
  World& world;
  SymmetricHeap& heap;
  const Options& o;
  cudaStream_t stream;
  Gemm gemm;
  CublasGemm cublas;
  size_t l2 = 0;
  float* align_buf = nullptr;
  float* stats = nullptr;
  std::vector<Row> rows;

  Bench(World& w, SymmetricHeap& h, const Options& opts, cudaStream_t s) : world(w), heap(h), o(opts), stream(s) {
    int l2_bytes = 0;
    TDIST_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, world.device()));
    l2 = static_cast<size_t>(l2_bytes);
    TDIST_CUDA_CHECK(cudaMalloc(&align_buf, sizeof(float)));
    TDIST_CUDA_CHECK(cudaMemset(align_buf, 0, sizeof(float)));
    TDIST_CUDA_CHECK(cudaMalloc(&stats, 2 * sizeof(float)));
  }
  ~Bench() {
    cudaFree(align_buf);
    cudaFree(stats);
  }

  bool bf16() const { return o.dtype == DType::kBFloat16; }
  ncclDataType_t nccl_type() const { return bf16() ? ncclBfloat16 : ncclFloat16; }

  // Input sets: enough that together they exceed twice the L2 (2 at least), within 16 GB.
  int sets_for(size_t set_bytes) const {
    size_t sets = std::max<size_t>(2, (2 * l2 + set_bytes - 1) / set_bytes + 1);
    while (sets > 2 && sets * set_bytes > (16ull << 30)) --sets;
    return static_cast<int>(sets);
  }

  // max |x - y| / max |y| on this rank, maximum over ranks.
  double rel_diff(const unsigned short* x, const unsigned short* y, size_t count) {
    TDIST_CUDA_CHECK(cudaMemsetAsync(stats, 0, 2 * sizeof(float), stream));
    if (count) diff<<<528, 256, 0, stream>>>(x, y, count, bf16(), stats);
    TDIST_CUDA_CHECK(cudaGetLastError());
    float h[2];
    TDIST_CUDA_CHECK(cudaMemcpyAsync(h, stats, sizeof(h), cudaMemcpyDeviceToHost, stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double mine = h[1] > 0 ? h[0] / h[1] : h[0];
    return world.max_across_ranks("gemm_overlap diff", {mine})[0];
  }

  GemmArgs gemm_args(const void* a, const void* b, void* d, int64_t m, int64_t n, int64_t k) const {
    return GemmArgs{.a = a, .b = b, .d = d, .m = m, .n = n, .k = k, .dtype = o.dtype};
  }

  void run_op(Op op) {
    const int w = world.world_size(), me = world.rank();
    const std::vector<Shape> shapes = shapes_of(op, o);
    if (shapes.empty()) return;
    int64_t max_m = 0, max_n = 0;
    for (const Shape& s : shapes) {
      max_m = std::max(max_m, s.m);
      max_n = std::max(max_n, op == Op::kAllGather ? per_rank(s.n_total, w) : s.n_total);
    }
    // AllGather-GEMM: one context per K, the largest M of that K; built when a shape needs it and
    // dropped (its heap block returned) when the next shape has another K, so that many K (--shapes)
    // need the heap of one.
    std::map<int64_t, int64_t> ag_max_m;
    std::unique_ptr<AllGatherGemm> ag;
    int64_t ag_k = -1;
    std::unique_ptr<GemmReduceScatter> rs;
    std::unique_ptr<GemmAllReduce> ar;
    if (op == Op::kAllGather) {
      for (const Shape& s : shapes) ag_max_m[s.k_total] = std::max(ag_max_m[s.k_total], s.m);
    } else {
      GemmReduceScatterConfig c;
      c.max_m = max_m;
      c.max_n = max_n;
      c.dtype = o.dtype;
      if (op == Op::kReduceScatter)
        rs = std::make_unique<GemmReduceScatter>(world, heap, c);
      else
        ar = std::make_unique<GemmAllReduce>(world, heap, c);
    }

    for (const Shape& sh : shapes) {
      const int64_t m = sh.m;
      const int64_t n = op == Op::kAllGather ? per_rank(sh.n_total, w) : sh.n_total;
      const int64_t k = op == Op::kAllGather ? sh.k_total : per_rank(sh.k_total, w);
      if (op == Op::kAllGather && ag_k != k) {
        ag.reset();
        AllGatherGemmConfig c;
        c.max_m = ag_max_m.at(k);
        c.k = k;
        c.dtype = o.dtype;
        ag = std::make_unique<AllGatherGemm>(world, heap, c);
        ag_k = k;
      }
      const kernels::gemm::RowChunks split{static_cast<uint64_t>(m), w};
      const int64_t my_rows = static_cast<int64_t>(split.rows(me));
      const int64_t padded_rows = (m + w - 1) / w;  // NCCL's equal per-rank counts
      const size_t e = 2;
      // Rotated inputs: ag_gemm a_local, B and the gathered A of the GEMM alone; gemm_rs / gemm_ar
      // A and B.
      const size_t a_elems = op == Op::kAllGather ? static_cast<size_t>(padded_rows) * k : static_cast<size_t>(m) * k;
      const size_t b_elems = static_cast<size_t>(n) * k;
      const size_t g_elems = op == Op::kAllGather ? static_cast<size_t>(padded_rows) * w * k : 0;
      const int sets = sets_for(e * (a_elems + b_elems + g_elems));
      std::vector<DeviceBuffer> as, bs, gs;
      for (int s = 0; s < sets; ++s) {
        as.emplace_back(e * a_elems);
        bs.emplace_back(e * b_elems);
        fill_random<<<528, 256, 0, stream>>>(as.back().get<unsigned short>(), a_elems,
                                             1000003ull * (me + 1) + 17 * s + 1, bf16());
        fill_random<<<528, 256, 0, stream>>>(bs.back().get<unsigned short>(), b_elems,
                                             1000003ull * (me + 1) + 17 * s + 2, bf16());
        if (g_elems) {
          gs.emplace_back(e * g_elems);
          fill_random<<<528, 256, 0, stream>>>(gs.back().get<unsigned short>(), g_elems,
                                               1000003ull * (me + 1) + 17 * s + 3, bf16());
        }
      }
      TDIST_CUDA_CHECK(cudaGetLastError());
      // Outputs: the op's D, the baseline's D (cross-check), the GEMM alone's M x N, and the
      // collective alone's buffers (padded to equal per-rank counts).
      const size_t d_elems = static_cast<size_t>(op == Op::kReduceScatter ? my_rows : m) * n;
      DeviceBuffer d(e * d_elems), d_base(e * d_elems);
      DeviceBuffer d_full(e * static_cast<size_t>(padded_rows) * w * n);
      DeviceBuffer nccl_out(op == Op::kReduceScatter ? e * static_cast<size_t>(padded_rows) * n : 256);

      auto ag_args = [&](int s, void* out) {
        AllGatherGemmArgs a;
        a.a_local = as[s].get();
        a.b = bs[s].get();
        a.d = out;
        a.m = m;
        a.n = n;
        return a;
      };
      auto reduce_args = [&](auto args, int s, void* out) {
        args.a = as[s].get();
        args.b = bs[s].get();
        args.d = out;
        args.m = m;
        args.n = n;
        args.k = k;
        return args;
      };
      auto run = [&](OverlapMethod method, int s, void* out) {
        if (op == Op::kAllGather)
          ag->run(ag_args(s, out), stream, method);
        else if (op == Op::kReduceScatter)
          rs->run(reduce_args(GemmReduceScatterArgs{}, s, out), stream, method);
        else
          ar->run(reduce_args(GemmAllReduceArgs{}, s, out), stream, method);
      };
      auto resolve = [&](OverlapMethod method) {
        if (op == Op::kAllGather) return ag->method(ag_args(0, d.get()), method);
        if (op == Op::kReduceScatter) return rs->method(reduce_args(GemmReduceScatterArgs{}, 0, d.get()), method);
        return ar->method(reduce_args(GemmAllReduceArgs{}, 0, d.get()), method);
      };
      // This rank's GEMM alone (gathered A for ag_gemm) and the collective alone.
      auto gemm_alone = [&](int s) -> GemmArgs {
        return op == Op::kAllGather ? gemm_args(gs[s].get(), bs[s].get(), d_full.get(), m, n, k)
                                    : gemm_args(as[s].get(), bs[s].get(), d_full.get(), m, n, k);
      };
      auto nccl_alone = [&](int s) {
        if (op == Op::kAllGather)
          TDIST_NCCL_CHECK(ncclAllGather(as[s].get(), gs[s].get(), static_cast<size_t>(padded_rows) * k, nccl_type(),
                                         world.comm(), stream));
        else if (op == Op::kReduceScatter)
          TDIST_NCCL_CHECK(ncclReduceScatter(d_full.get(), nccl_out.get(), static_cast<size_t>(padded_rows) * n,
                                             nccl_type(), ncclSum, world.comm(), stream));
        else
          TDIST_NCCL_CHECK(ncclAllReduce(d_full.get(), d_full.get(), static_cast<size_t>(m) * n, nccl_type(), ncclSum,
                                         world.comm(), stream));
      };

      // Methods this shape allows (sequential refuses unequal per-rank counts and large collectives;
      // every rank refuses alike), each cross-checked against the baseline on set 0.
      std::vector<OverlapMethod> methods;
      std::vector<std::string> resolved;
      for (OverlapMethod method : o.methods) {
        try {
          resolved.push_back(to_string(resolve(method)));
          methods.push_back(method);
        } catch (const tdist::Error& e) {
          if (me == 0)
            std::printf("%s M=%lld: %s skipped: %s\n", op_name(op), static_cast<long long>(m), to_string(method),
                        e.what());
        }
      }
      std::vector<double> diffs;
      run(OverlapMethod::kBaseline, 0, d_base.get());
      for (OverlapMethod method : methods) {
        TDIST_CUDA_CHECK(cudaMemsetAsync(d.get(), 0xFF, e * d_elems, stream));
        run(method, 0, d.get());
        diffs.push_back(rel_diff(d.get<unsigned short>(), d_base.get<unsigned short>(), d_elems));
      }

      std::vector<Variant> vs;
      for (OverlapMethod method : methods)
        vs.push_back({detail::concat("tdist ", to_string(method)), [&, method](int s) { run(method, s, d.get()); }});
      const size_t first_part = vs.size();
      vs.push_back({"gemm", [&](int s) { gemm.run(gemm_alone(s), stream); }});
      vs.push_back({"baseline", [&](int s) { run(OverlapMethod::kBaseline, s, d_base.get()); }});
      vs.push_back({"nccl", nccl_alone});
      vs.push_back({"cublas", [&](int s) { cublas.run(gemm_alone(s), stream); }});
      const std::vector<double> ms = time_alternating(world, stream, o.iters, sets, vs, o.align, align_buf);
      const double gemm_ms = ms[first_part], base_ms = ms[first_part + 1], nccl_ms = ms[first_part + 2],
                   cublas_ms = ms[first_part + 3];
      const double flop = 2.0 * m * n * static_cast<double>(k);
      for (size_t i = 0; i < methods.size(); ++i) {
        rows.push_back({op, sh, m, n, k, to_string(methods[i]), resolved[i], ms[i] * 1e3, gemm_ms * 1e3,
                        cublas_ms * 1e3, nccl_ms * 1e3, base_ms * 1e3, flop / ms[i] * 1e-9, diffs[i]});
      }
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
};

void print_table(const std::vector<Row>& rows, Op op, int world, const Options& o) {
  std::string note;
  for (const Row& r : rows) {
    if (r.op != op) continue;
    const std::string shape_note = detail::concat(
        r.shape.note, op == Op::kAllGather ? ": N_local = " : ": K_local = ", op == Op::kAllGather ? r.n : r.k);
    if (shape_note != note) {
      note = shape_note;
      std::printf("\n%s, %s, %d ranks, %s, median of %d, max over ranks\n", op_name(op), note.c_str(), world,
                  to_string(o.dtype), o.iters);
      std::printf("%6s %-20s %10s %10s %11s %9s %9s %8s %8s %8s %10s\n", "M", "method", "tdist us", "gemm us",
                  "baseline us", "nccl us", "cublas us", "t/gemm", "t/base", "TFLOP/s", "diff");
    }
    const std::string method = r.method == r.resolved ? r.method : r.method + " (" + r.resolved + ")";
    std::printf("%6lld %-20s %10.1f %10.1f %11.1f %9.1f %9.1f %8.3f %8.3f %8.1f %10.2e\n", static_cast<long long>(r.m),
                method.c_str(), r.tdist_us, r.gemm_us, r.baseline_us, r.nccl_us, r.cublas_us, r.tdist_us / r.gemm_us,
                r.tdist_us / r.baseline_us, r.tflops, r.max_rel_diff);
  }
  std::fflush(stdout);
}

// Rows of schema tdist.bench/1: for each op and M, one row per tdist method, then the GEMM alone,
// the NCCL + cuBLAS baseline and its two parts.
void write_json(const std::string& path, const std::vector<Row>& rows, int world, const Options& o,
                const std::string& gpu, int argc, char** argv) {
  json::Value doc = bench::document("gemm_overlap", gpu, world, to_string(o.dtype), argc, argv);
  doc["iters"] = o.iters;
  doc["seed"] = o.seed;
  doc["statistic"] = "median of per-call CUDA-event times, max over ranks (us)";
  std::string last;  // op and M of the previous row: the baselines are written once per shape
  for (const Row& r : rows) {
    const double flop = 2.0 * r.m * r.n * static_cast<double>(r.k);
    auto row = [&](const char* impl, const std::string& method, double us) {
      return json::Value(json::Object{{"op", op_name(r.op)},
                                      {"m", r.m},
                                      {"n", r.n},
                                      {"k", r.k},
                                      {"n_total", r.shape.n_total},
                                      {"k_total", r.shape.k_total},
                                      {"note", r.shape.note},
                                      {"impl", impl},
                                      {"method", method},
                                      {"us", us},
                                      {"tflops", flop / us * 1e-6}});
    };
    json::Value t = row("tdist", r.method, r.tdist_us);
    t["resolved"] = r.resolved;
    t["max_rel_diff"] = r.max_rel_diff;
    t["ratio_gemm"] = r.tdist_us / r.gemm_us;
    t["ratio_baseline"] = r.tdist_us / r.baseline_us;
    doc["rows"].push_back(t);
    const std::string shape = detail::concat(op_name(r.op), "/", r.m, "/", r.n, "/", r.k);
    if (shape == last) continue;
    last = shape;
    doc["rows"].push_back(row("gemm", "tdist::Gemm", r.gemm_us));
    doc["rows"].push_back(row("nccl+cublas", "baseline", r.baseline_us));
    doc["rows"].push_back(row("nccl", "nccl", r.nccl_us));
    doc["rows"].push_back(row("cublas", "cublas", r.cublas_us));
  }
  json::write_file(path, doc);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  cli::Parser p("bench_gemm_overlap",
                "The overlapped tensor-parallel linear layers beside the GEMM alone and NCCL + cuBLAS.\n"
                "Run under a launcher: tdistrun -n 2 bench_gemm_overlap --quick");
  std::string dtype = "bf16";
  p.option("--ops", "LIST", "ag_gemm,gemm_rs,gemm_ar (default all three)", [&](const std::string& v) {
    o.ops.clear();
    for (const auto& s : cli::split_list(v, "--ops")) {
      try {
        o.ops.push_back(parse_op(s));
      } catch (const tdist::Error&) {
        throw cli::UsageError("--ops expects ag_gemm, gemm_rs or gemm_ar, got '" + s + "'");
      }
    }
  });
  p.option("--shapes", "random:N|MxNxK,..",
           "whole layers instead of the default shapes and --m: N random ones (M 128..16384, N and K multiples of 8 "
           "in 1024..28672; see --seed) or a list; ag_gemm splits N over the ranks, gemm_rs / gemm_ar split K",
           &o.shapes_spec);
  p.option("--seed", "S", "seed of --shapes random:N: the same S gives the same shapes (default 1)", &o.seed, 0,
           std::numeric_limits<int64_t>::max());
  p.flag("--print-sweep", "print the --shapes list as MxNxK, one per line, and exit", &o.print_sweep);
  p.option("--m,--rows", "LIST", "M (all ranks' rows), e.g. 1024,4096 (default 1024,4096,8192,16384)",
           [&](const std::string& v) {
             o.ms.clear();
             for (const auto& s : cli::split_list(v, "--m"))
               o.ms.push_back(cli::parse_int(s, "--m", 1, int64_t{1} << 40));
             o.ms_given = true;
           });
  p.option("--methods", "LIST", "auto,fused,chunked,sequential,baseline (default auto)", [&](const std::string& v) {
    o.methods.clear();
    for (const auto& s : cli::split_list(v, "--methods")) {
      try {
        o.methods.push_back(parse_overlap_method(s, "--methods"));
      } catch (const tdist::Error& e) {
        throw cli::UsageError(e.what());
      }
    }
  });
  p.choice("--dtype", "element type (default bf16)", {"bf16", "fp16", "f16"}, &dtype);
  p.option("--iters", "N", "timed launches per variant, the median is kept (default 20)", &o.iters, 1, 1000000);
  p.option("--heap,--heap-size", "BYTES", "symmetric heap per rank (default 8G)",
           [&](const std::string& v) { o.heap = cli::parse_size(v, "--heap"); });
  p.option("--json", "FILE", "also write the results as JSON (rank 0)", &o.json);
  bool no_align = false;
  p.flag("--no-align", "no one-element NCCL AllReduce before each timed launch", &no_align);
  p.flag("--quick", "M in {1024, 8192} unless --m is given", &o.quick);
  p.parse(argc, argv);
  if (!o.shapes_spec.empty()) {
    if (o.ms_given) p.fail("--shapes and --m are exclusive: --shapes gives M too");
    try {
      o.layers = parse_shapes(o.shapes_spec, o.seed);
    } catch (const cli::UsageError& e) {
      p.fail(e.what());
    }
  }
  if (o.print_sweep) {
    if (o.layers.empty()) p.fail("--print-sweep lists --shapes: give --shapes");
    for (const sweep::GemmShape& l : o.layers)
      std::printf("%lldx%lldx%lld\n", static_cast<long long>(l.m), static_cast<long long>(l.n),
                  static_cast<long long>(l.k));
    return 0;
  }
  o.align = !no_align;
  o.dtype = dtype == "bf16" ? DType::kBFloat16 : DType::kFloat16;
  return cli::run_main("bench_gemm_overlap", [&]() -> int {
    World world;
    SymmetricHeap heap(world, o.heap);
    cudaStream_t stream;
    TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    TDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, world.device()));
    std::vector<Row> rows;
    {
      Bench bench(world, heap, o, stream);
      if (world.rank() == 0) {
        std::printf(
            "gemm_overlap: %d ranks on %s (%d SMs, L2 %zu MB), %s; columns: tdist = the op, gemm = tdist::Gemm "
            "alone on this rank's GEMM, baseline = NCCL then cuBLAS (kBaseline), nccl / cublas = its parts\n",
            world.world_size(), prop.name, prop.multiProcessorCount, bench.l2 >> 20, to_string(o.dtype));
        std::fflush(stdout);
      }
      for (Op op : o.ops) {
        bench.run_op(op);
        if (world.rank() == 0) print_table(bench.rows, op, world.world_size(), o);
      }
      rows = bench.rows;
    }
    if (world.rank() == 0) {
      std::printf(
          "\nt/gemm: tdist time / GEMM-alone time (1 = communication fully hidden); t/base: tdist time / "
          "baseline time (below 1: tdist faster); TFLOP/s: this rank's GEMM flops / tdist time; diff: "
          "max |tdist - baseline| / max |baseline| on the same inputs\n");
      if (!o.json.empty()) write_json(o.json, rows, world.world_size(), o, prop.name, argc, argv);
    }
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
  });
}
