// The catalogue op ag_gemm_swiglu across ranks, called as a plug-in is (find_overlap_op, the
// OverlapContextCache, OverlapContext::run), against a float64 host reference of the whole math:
// every rank draws its shard of A from (seed, rank) and can redraw every other rank's, so it builds
// the gathered A and computes d = silu(A W_gate^T) * (A W_up^T) itself.
//
//   * every method (auto, fused, chunked, sequential, baseline) x bf16 / fp16 on odd shapes (M not a
//     multiple of world x 128, M smaller than the team, N / 2 and K odd multiples of 8), outputs
//     poisoned (NaN) first, max |err| <= 2e-2 max |ref|; the optional gathered A bit for bit;
//   * the context cache growing across calls of larger M and N;
//   * a CUDA graph captured once and replayed with fresh inputs, each replay checked;
//   * argument errors naming the argument (N not a multiple of 16, a misaligned operand).
//
//   build-gpu/tools/tdistrun -n 2 -- build-gpu/tests/gpu_test_ag_gemm_swiglu
// Prints "rank R: N passed, M failed" last.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "gpu/test_values.cuh"
#include "tdist/common/device_buffer.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/overlap_ops.hpp"

using namespace tdist;
using tdist::kernels::gemm::RowChunks;

namespace {

struct Shape {
  int64_t m, n, k;  // n: the GEMM's N (gate and up), d has n / 2 columns
};

using test::input_value;
using test::to_f;
using test::to_t;

template <typename T>
std::vector<T> shard(uint64_t seed, int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = to_t<T>(input_value(seed, rank, i));
  return v;
}

template <typename T>
struct Case {
  Shape s;
  uint64_t seed;
  std::vector<T> a_local, b;     // this rank's rows of A, its weight shard [gate; up]
  std::vector<double> gathered;  // M x K, every rank's rows
  std::vector<double> ref;       // M x N/2
  DeviceBuffer d_a, d_b, d_d, d_g;

  Case(World& world, const Shape& shape, uint64_t s_seed) : s(shape), seed(s_seed) {
    const int w = world.world_size(), me = world.rank();
    const RowChunks rows{static_cast<uint64_t>(s.m), w};
    a_local = shard<T>(seed, me, rows.rows(me) * s.k);
    b = shard<T>(seed ^ 0xB, me, s.n * s.k);
    gathered.resize(s.m * s.k);
    for (int r = 0; r < w; ++r) {
      const std::vector<T> part = shard<T>(seed, r, rows.rows(r) * s.k);
      for (size_t i = 0; i < part.size(); ++i) gathered[rows.begin(r) * s.k + i] = to_f(part[i]);
    }
    const int64_t half = s.n / 2;
    ref.resize(s.m * half);
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < half; ++j) {
        double gate = 0, up = 0;
        for (int64_t kk = 0; kk < s.k; ++kk) {
          const double x = gathered[i * s.k + kk];
          gate += x * to_f(b[j * s.k + kk]);
          up += x * to_f(b[(half + j) * s.k + kk]);
        }
        ref[i * half + j] = gate / (1.0 + std::exp(-gate)) * up;
      }
    }
    d_a = DeviceBuffer(std::max<size_t>(a_local.size(), 1) * sizeof(T));
    d_b = DeviceBuffer(b.size() * sizeof(T));
    d_d = DeviceBuffer(s.m * half * sizeof(T));
    d_g = DeviceBuffer(s.m * s.k * sizeof(T));
    upload();
  }

  void upload() {
    test::copy_to_device(d_a.get(), a_local.data(), a_local.size() * sizeof(T));
    test::copy_to_device(d_b.get(), b.data(), b.size() * sizeof(T));
  }

  void poison() {
    tdist::test::fill_device(d_d.get(), 0xFF, s.m * (s.n / 2) * sizeof(T));  // NaN in bf16 and fp16
    tdist::test::fill_device(d_g.get(), 0xFF, s.m * s.k * sizeof(T));
  }

  OverlapCall call(bool with_gathered) const {
    OverlapCall c;
    c.operands = {d_a.get(), d_b.get(), d_d.get(), with_gathered ? d_g.get() : nullptr};
    c.m = s.m;
    c.n = s.n;
    c.k = s.k;
    return c;
  }

  void check(bool with_gathered) const {
    const int64_t half = s.n / 2;
    std::vector<T> d(s.m * half);
    TDIST_CUDA_CHECK(cudaMemcpy(d.data(), d_d.get(), d.size() * sizeof(T), cudaMemcpyDeviceToHost));
    double max_ref = 0, max_err = 0;
    size_t worst = 0;
    for (size_t i = 0; i < d.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(ref[i]));
      const double err = std::fabs(static_cast<double>(to_f(d[i])) - ref[i]);
      if (!(err <= max_err)) {  // NaN (an unwritten element) counts as the worst
        max_err = std::isnan(err) ? INFINITY : err;
        worst = i;
      }
    }
    if (!(max_err <= 2e-2 * std::max(max_ref, 1e-3)))
      TDIST_FAIL("d: max |err| ", max_err, " at row ", worst / half, " column ", worst % half, " (got ", to_f(d[worst]),
                 ", want ", ref[worst], "), max |ref| ", max_ref);
    if (!with_gathered) return;
    std::vector<T> g(s.m * s.k);
    TDIST_CUDA_CHECK(cudaMemcpy(g.data(), d_g.get(), g.size() * sizeof(T), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < g.size(); ++i)
      if (static_cast<double>(to_f(g[i])) != gathered[i])
        TDIST_FAIL("gathered: element ", i, " is ", to_f(g[i]), ", want ", gathered[i]);
  }
};

using test::expect_error;

const OverlapMethod kMethods[] = {OverlapMethod::kAuto, OverlapMethod::kFused, OverlapMethod::kChunked,
                                  OverlapMethod::kSequential, OverlapMethod::kBaseline};

}  // namespace

int main() {
  World world;
  test::Suite suite(world);
  SymmetricHeap heap(world, size_t{2} << 30);
  OverlapContextCache cache(world, heap);
  const OverlapOpTraits& op = find_overlap_op("ag_gemm_swiglu");
  const int w = world.world_size(), me = world.rank();
  const uint64_t seed = test::all_gather_u64(world, "seed", test::fresh_seed(0))[0];
  if (me == 0) std::printf("ag_gemm_swiglu test: %d ranks, seed %llx\n", w, static_cast<unsigned long long>(seed));
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const Shape shapes[] = {{3, 16, 72}, {1000, 528, 264}, {257, 1040, 136}, {2048, 512, 512}};
  uint64_t case_seed = seed;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (const Shape& s : shapes) {
      for (OverlapMethod method : kMethods) {
        const bool gathered = (s.m + static_cast<int>(method)) % 2 == 0;
        const std::string name = detail::concat("ag_gemm_swiglu ", to_string(dtype), " ", to_string(method), " m ", s.m,
                                                " n ", s.n, " k ", s.k, gathered ? " +gathered" : "");
        suite.run(name, [&] {
          auto body = [&](auto tag) {
            using T = decltype(tag);
            Case<T> c(world, s, ++case_seed);
            c.poison();
            const OverlapCall call = c.call(gathered);
            check_overlap_call(op, dtype, call, w, me);
            OverlapContext& ctx = cache.get(op, dtype, s.m, s.n, s.k, stream);
            if (method == OverlapMethod::kSequential && s.m % w != 0) {
              expect_error("method", [&] { ctx.run(call, stream, method); });
              return;
            }
            ctx.run(call, stream, method);
            TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
            c.check(gathered);
          };
          if (dtype == DType::kBFloat16)
            body(__nv_bfloat16{});
          else
            body(__half{});
        });
      }
    }
  }

  suite.run("ag_gemm_swiglu bf16 chunked, CUDA graph captured once, 10 replays with fresh inputs", [&] {
    const Shape s{1000, 528, 264};
    Case<__nv_bfloat16> c(world, s, ++case_seed);
    OverlapContext& ctx = cache.get(op, DType::kBFloat16, s.m, s.n, s.k, stream);  // created before the capture
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    ctx.run(c.call(false), stream, OverlapMethod::kChunked);
    TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 10; ++replay) {
      Case<__nv_bfloat16> fresh(world, s, ++case_seed);
      c.a_local = fresh.a_local;
      c.b = fresh.b;
      c.ref = fresh.ref;
      c.upload();
      c.poison();
      test::sync_all(world, "swiglu graph replay");  // every rank's inputs are in place
      TDIST_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
      c.check(false);
    }
    TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TDIST_CUDA_CHECK(cudaGraphDestroy(graph));
  });

  suite.run("ag_gemm_swiglu argument errors name the argument", [&] {
    Case<__nv_bfloat16> c(world, {64, 32, 16}, ++case_seed);
    OverlapCall call = c.call(false);
    call.n = 24;  // a multiple of 8, not of 16
    expect_error("n", [&] { check_overlap_call(op, DType::kBFloat16, call, w, me); });
    call = c.call(false);
    call.operands[1] = static_cast<char*>(call.operands[1]) + 8;
    expect_error("b", [&] { check_overlap_call(op, DType::kBFloat16, call, w, me); });
    expect_error("dtype", [&] { check_overlap_call(op, DType::kFloat32, c.call(false), w, me); });
  });

  suite.run("the context cache holds one context per dtype and K, grown to every call's M and N", [&] {
    int found = 0;
    for (const auto& [traits, config] : cache.contexts()) {
      if (traits != &op) continue;
      ++found;
      for (const Shape& s : shapes)
        if (s.k == config.k && (config.max_m < s.m || config.max_n < s.n))
          TDIST_FAIL("the K = ", s.k, " context has max_m ", config.max_m, ", max_n ", config.max_n,
                     " after a call of m ", s.m, ", n ", s.n);
    }
    if (found != 2 * 4) TDIST_FAIL("expected 8 contexts (2 dtypes x 4 K), found ", found);
  });

  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  cache.clear();
  return suite.finish();
}
