// The overlapped tensor-parallel linear layers (tdist::AllGatherGemm, GemmReduceScatter,
// GemmAllReduce) across ranks, against a float64 reference computed on each rank's GPU from the full
// math: every rank generates its own shards from (case seed, rank, index) and can regenerate every
// other rank's, so it builds the gathered A (AllGather-GEMM) or the K-concatenated A and B
// (ReduceScatter / AllReduce: sum_r A_r B_r^T = [A_0 .. A_n-1] [B_0 .. B_n-1]^T) locally.
//
//   * every op x method (fused, chunked, sequential, baseline, auto) x dtype (bf16, fp16) on odd
//     shapes: M not a multiple of world x 128 (1000, 4097, 257, 3000), M smaller than the team (1, 3),
//     N and K odd multiples of 8, one odd N (D's rows then not 16-byte multiples: accepted and right,
//     or refused with an error naming 'n'), one tile-aligned shape and one large LLaMA-3-70B shape
//     (sequential may refuse, naming 'method', unequal per-rank counts and large collectives); fresh
//     inputs per case, outputs poisoned (NaN) first, max |err| <= 1e-2 max |ref| per element; the
//     optional gathered A of AllGather-GEMM compared bit for bit;
//   * AllGather-GEMM zero copy: a_local = local_rows(m), written in place;
//   * 200 calls back to back per op and method, fresh inputs generated on the stream before each
//     call and a rank-dependent delay, every call's output checked (flag and buffer reuse races);
//   * a CUDA graph of each op and method captured once and replayed 50 times, fresh inputs written
//     before each replay, each replay checked;
//   * the chunked ReduceScatter and AllReduce cut into 2, 3 and 4 row pieces (TDIST_OVERLAP_PIECES)
//     on a small shape, once, back to back and from a CUDA graph;
//   * argument errors through the classes and the pure check functions, each naming the argument,
//     and the context still right after the rejected calls.
//
//   build-gpu/tools/tdistrun -n 2 -- build-gpu/tests/gpu_test_gemm_overlap [--quick | --small]
// --small: two small shapes with the fused and chunked methods (what compute-sanitizer runs).
// Any world size (the team of one NVLink domain). Prints "rank R: N passed, M failed" last.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "gpu/test_values.cuh"
#include "tdist/common/device_buffer.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/detail/overlap_model.hpp"
#include "tdist/ops/gemm_overlap.hpp"

using namespace tdist;
using tdist::device::u64;
using tdist::kernels::gemm::RowChunks;

namespace {

// ---------------------------------------------------------------------------------------------
// Inputs: element i of `rank`'s shard is test::input_value(seed, rank, i).
using test::input_value;
using test::to_f;
using test::to_t;

#define GRID_STRIDE(i, count)                                                        \
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<u64>(gridDim.x) * blockDim.x)

// One rank's shard: p[i] = input_value(seed, rank, i).
template <typename T>
__global__ void fill_shard(T* p, u64 count, u64 seed, int rank) {
  GRID_STRIDE(i, count) p[i] = to_t<T>(input_value(seed, rank, i));
}

// The gathered M x K matrix: row i is row i - begin(r) of the shard of the rank r that owns it.
template <typename T>
__global__ void fill_gathered(T* p, u64 m, u64 k, int world, u64 seed) {
  const RowChunks split{m, world};
  GRID_STRIDE(idx, m * k) {
    const u64 i = idx / k;
    const int r = split.chunk_of(i);
    p[idx] = to_t<T>(input_value(seed, r, idx - split.begin(r) * k));
  }
}

// The K-concatenated rows x (world K) matrix: row i = [row i of rank 0's rows x K shard | rank 1's | ...].
template <typename T>
__global__ void fill_concat(T* p, u64 rows, u64 k, int world, u64 seed) {
  const u64 width = k * world;
  GRID_STRIDE(idx, rows * width) {
    const u64 i = idx / width, c = idx % width;
    const int r = static_cast<int>(c / k);
    p[idx] = to_t<T>(input_value(seed, r, i * k + c % k));
  }
}

__global__ void fill_u16(unsigned short* p, u64 count, unsigned short v) { GRID_STRIDE(i, count) p[i] = v; }

constexpr unsigned short kPoison = 0x7FC1;  // a NaN in bf16 and fp16 alike

// What one checked call found. Doubles are kept as their bits (non-negative doubles order as u64).
struct Check {
  unsigned long long bad, first_bad, max_err, ref_max, gathered_bad, gathered_first_bad;
};

__global__ void init_checks(Check* c, int count) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    c[i] = Check{0, ~0ull, 0, 0, 0, ~0ull};
}

// ref[i][j] = sum_k a[i][k] * b[j][k] in float64 (a: m x k, b: n x k, row-major). 64 x 64 outputs
// per block of 256 threads, 4 x 4 per thread, K in steps of 16 through shared memory.
template <typename T>
__global__ void __launch_bounds__(256) reference_gemm(const T* a, const T* b, double* ref, int m, int n, int k) {
  __shared__ float sa[16][65], sb[16][65];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const long row0 = blockIdx.y * 64l, col0 = blockIdx.x * 64l;
  double acc[4][4] = {};
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (int e = threadIdx.x; e < 1024; e += 256) {
      const int r = e / 16, kk = e % 16;
      const bool kin = k0 + kk < k;
      sa[kk][r] = row0 + r < m && kin ? to_f(a[(row0 + r) * k + k0 + kk]) : 0.0f;
      sb[kk][r] = col0 + r < n && kin ? to_f(b[(col0 + r) * k + k0 + kk]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      double av[4], bv[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) av[q] = sa[kk][ty + 16 * q], bv[q] = sb[kk][tx + 16 * q];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long r = row0 + ty + 16 * i, c = col0 + tx + 16 * j;
      if (r < m && c < n) ref[r * n + c] = acc[i][j];
    }
}

__global__ void abs_max(const double* ref, u64 count, Check* c) {
  double mx = 0;
  GRID_STRIDE(i, count) mx = fmax(mx, fabs(ref[i]));
  atomicMax(&c->ref_max, static_cast<unsigned long long>(__double_as_longlong(mx)));
}

// Per element |d - ref| <= tol * max |ref| (NaN, i.e. poison left behind, fails).
template <typename T>
__global__ void compare(const T* d, const double* ref, u64 count, double tol, Check* c) {
  const double limit = tol * __longlong_as_double(static_cast<long long>(c->ref_max));
  unsigned long long bad = 0, first = ~0ull;
  double worst = 0;
  GRID_STRIDE(i, count) {
    const double err = fabs(static_cast<double>(to_f(d[i])) - ref[i]);
    if (!(err <= limit)) {
      ++bad;
      first = first < i ? first : i;
    }
    worst = fmax(worst, isnan(err) ? 1e300 : err);
  }
  if (bad) {
    atomicAdd(&c->bad, bad);
    atomicMin(&c->first_bad, first);
  }
  atomicMax(&c->max_err, static_cast<unsigned long long>(__double_as_longlong(worst)));
}

// Bit-exact comparison of two 16-bit arrays (the gathered A).
__global__ void compare_exact(const unsigned short* got, const unsigned short* want, u64 count, Check* c) {
  GRID_STRIDE(i, count) {
    if (got[i] != want[i]) {
      atomicAdd(&c->gathered_bad, 1ull);
      atomicMin(&c->gathered_first_bad, static_cast<unsigned long long>(i));
    }
  }
}

// Holds this rank's stream for `ns` nanoseconds, so ranks enter a call at different times.
__global__ void skew_kernel(u64 ns) {
  for (u64 waited = 0; waited < ns; waited += 1000) __nanosleep(1000);
}

double bits_to_double(unsigned long long b) {
  double d;
  std::memcpy(&d, &b, sizeof(d));
  return d;
}

// ---------------------------------------------------------------------------------------------
enum class Op { kAllGather, kReduceScatter, kAllReduce };
const char* op_name(Op op) {
  return op == Op::kAllGather ? "ag_gemm" : op == Op::kReduceScatter ? "gemm_rs" : "gemm_ar";
}

// AllGather-GEMM: m total rows, n = columns of this rank's B shard, k. ReduceScatter / AllReduce:
// m total rows, n, k = this rank's K slice.
struct Shape {
  int64_t m, n, k;
};

constexpr int kMaxChecks = 1024;
const OverlapMethod kMethods[] = {OverlapMethod::kFused, OverlapMethod::kChunked, OverlapMethod::kSequential,
                                  OverlapMethod::kBaseline, OverlapMethod::kAuto};

struct Env {
  World& world;
  SymmetricHeap& heap;
  cudaStream_t stream = nullptr;
  Check* checks = nullptr;  // kMaxChecks
  u64 seed_base = 0;
  u64 cases = 0;
  int n() const { return world.world_size(); }
  int me() const { return world.rank(); }
  u64 next_seed() { return seed_base + 0x9E3779B97F4A7C15ull * ++cases; }
};

// The contexts of one dtype (AllGather-GEMM: one per K).
struct Contexts {
  std::map<int64_t, std::unique_ptr<AllGatherGemm>> ag;
  std::unique_ptr<GemmReduceScatter> rs;
  std::unique_ptr<GemmAllReduce> ar;
};

constexpr unsigned kFillBlocks = 1024, kThreads = 256;

// One op's problem on this rank: its own shards, the outputs, the reference operands and the
// float64 reference. fill() writes fresh inputs and the reference, poison() the outputs, run() makes
// the call, check() compares; all stream-ordered, no host synchronisation.
template <typename T>
class Problem {
 public:
  Problem(Env& env, Contexts& ctx, Op op, Shape s, bool with_gathered, bool zero_copy = false)
      : env_(env), ctx_(ctx), op_(op), s_(s), split_{static_cast<u64>(s.m), env.n()}, with_gathered_(with_gathered) {
    const int n = env.n();
    rows_ = split_.rows(env.me());
    row0_ = split_.begin(env.me());
    const size_t e = sizeof(T);
    if (op == Op::kAllGather) {
      if (zero_copy) {
        TDIST_CHECK(ctx_.ag.count(s.k), "no AllGather-GEMM context for k = ", s.k);
        a_local_ = static_cast<T*>(ctx_.ag.at(s.k)->local_rows(s.m));
        TDIST_CHECK(a_local_ != nullptr, "local_rows(", s.m, ") is null");
      } else {
        a_own_ = DeviceBuffer(e * rows_ * s.k);
        a_local_ = a_own_.get<T>();
      }
      b_ = DeviceBuffer(e * s.n * s.k);
      d_ = DeviceBuffer(e * s.m * s.n);
      d_count_ = static_cast<u64>(s.m) * s.n;
      ref_a_ = DeviceBuffer(e * s.m * s.k);
      if (with_gathered) gathered_ = DeviceBuffer(e * s.m * s.k);
    } else {
      a_own_ = DeviceBuffer(e * s.m * s.k);
      a_local_ = a_own_.get<T>();
      b_ = DeviceBuffer(e * s.n * s.k);
      d_count_ = (op == Op::kReduceScatter ? rows_ : static_cast<u64>(s.m)) * s.n;
      d_ = DeviceBuffer(e * d_count_);
      ref_a_ = DeviceBuffer(e * s.m * s.k * n);
      ref_b_ = DeviceBuffer(e * s.n * s.k * n);
    }
    ref_ = DeviceBuffer(sizeof(double) * d_count_);
  }

  // Fresh inputs from `seed` and their reference; c->ref_max receives max |ref|.
  void fill(u64 seed, Check* c) {
    cudaStream_t st = env_.stream;
    const int n = env_.n(), me = env_.me();
    const u64 seed_a = seed, seed_b = seed ^ 0x5851F42D4C957F2Dull;
    const u64 m = s_.m, nn = s_.n, k = s_.k;
    if (op_ == Op::kAllGather) {
      fill_shard<T><<<kFillBlocks, kThreads, 0, st>>>(a_local_, rows_ * k, seed_a, me);
      fill_shard<T><<<kFillBlocks, kThreads, 0, st>>>(b_.get<T>(), nn * k, seed_b, me);
      fill_gathered<T><<<kFillBlocks, kThreads, 0, st>>>(ref_a_.get<T>(), m, k, n, seed_a);
      launch_reference(ref_a_.get<T>(), b_.get<T>(), m, nn, k);
    } else {
      fill_shard<T><<<kFillBlocks, kThreads, 0, st>>>(a_local_, m * k, seed_a, me);
      fill_shard<T><<<kFillBlocks, kThreads, 0, st>>>(b_.get<T>(), nn * k, seed_b, me);
      fill_concat<T><<<kFillBlocks, kThreads, 0, st>>>(ref_a_.get<T>(), m, k, n, seed_a);
      fill_concat<T><<<kFillBlocks, kThreads, 0, st>>>(ref_b_.get<T>(), nn, k, n, seed_b);
      const bool rs = op_ == Op::kReduceScatter;
      launch_reference(ref_a_.get<T>() + (rs ? row0_ * k * n : 0), ref_b_.get<T>(), rs ? rows_ : m, nn, k * n);
    }
    abs_max<<<264, kThreads, 0, st>>>(ref_.get<double>(), d_count_, c);
    TDIST_CUDA_CHECK(cudaGetLastError());
  }

  void poison() {
    fill_u16<<<kFillBlocks, kThreads, 0, env_.stream>>>(d_.get<unsigned short>(), d_count_, kPoison);
    if (gathered_.get())
      fill_u16<<<kFillBlocks, kThreads, 0, env_.stream>>>(gathered_.get<unsigned short>(),
                                                          static_cast<u64>(s_.m) * s_.k, kPoison);
    TDIST_CUDA_CHECK(cudaGetLastError());
  }

  AllGatherGemmArgs ag_args() const {
    AllGatherGemmArgs a;
    a.a_local = a_local_;
    a.b = b_.get();
    a.d = d_.get();
    a.a_gathered = with_gathered_ ? gathered_.get() : nullptr;
    a.m = s_.m;
    a.n = s_.n;
    return a;
  }
  template <typename Args>
  Args reduce_args() const {
    Args a;
    a.a = a_local_;
    a.b = b_.get();
    a.d = d_.get();
    a.m = s_.m;
    a.n = s_.n;
    a.k = s_.k;
    return a;
  }

  // The method the context resolves (checks the arguments too).
  OverlapMethod resolve(OverlapMethod method) const {
    if (op_ == Op::kAllGather) return ag().method(ag_args(), method);
    if (op_ == Op::kReduceScatter) return rs().method(reduce_args<GemmReduceScatterArgs>(), method);
    return ar().method(reduce_args<GemmAllReduceArgs>(), method);
  }

  void run(OverlapMethod method) {
    if (op_ == Op::kAllGather)
      ag().run(ag_args(), env_.stream, method);
    else if (op_ == Op::kReduceScatter)
      rs().run(reduce_args<GemmReduceScatterArgs>(), env_.stream, method);
    else
      ar().run(reduce_args<GemmAllReduceArgs>(), env_.stream, method);
  }

  void check(Check* c) {
    compare<T><<<kFillBlocks, kThreads, 0, env_.stream>>>(d_.get<T>(), ref_.get<double>(), d_count_, 1e-2, c);
    if (gathered_.get())
      compare_exact<<<kFillBlocks, kThreads, 0, env_.stream>>>(
          gathered_.get<unsigned short>(), ref_a_.get<unsigned short>(), static_cast<u64>(s_.m) * s_.k, c);
    TDIST_CUDA_CHECK(cudaGetLastError());
  }

  u64 d_count() const { return d_count_; }

 private:
  void launch_reference(const T* a, const T* b, u64 m, u64 n, u64 k) {
    if (m == 0 || n == 0) return;
    const dim3 grid(static_cast<unsigned>((n + 63) / 64), static_cast<unsigned>((m + 63) / 64));
    reference_gemm<T><<<grid, 256, 0, env_.stream>>>(a, b, ref_.get<double>(), static_cast<int>(m), static_cast<int>(n),
                                                     static_cast<int>(k));
  }
  AllGatherGemm& ag() const {
    TDIST_CHECK(ctx_.ag.count(s_.k) && ctx_.ag.at(s_.k), "no AllGather-GEMM context for k = ", s_.k);
    return *ctx_.ag.at(s_.k);
  }
  GemmReduceScatter& rs() const {
    TDIST_CHECK(ctx_.rs != nullptr, "no GemmReduceScatter context");
    return *ctx_.rs;
  }
  GemmAllReduce& ar() const {
    TDIST_CHECK(ctx_.ar != nullptr, "no GemmAllReduce context");
    return *ctx_.ar;
  }

  Env& env_;
  Contexts& ctx_;
  Op op_;
  Shape s_;
  RowChunks split_;
  bool with_gathered_;
  u64 rows_ = 0, row0_ = 0, d_count_ = 0;
  T* a_local_ = nullptr;
  DeviceBuffer a_own_, b_, d_, gathered_, ref_a_, ref_b_, ref_;
};

// Reads checks [first, first + count) back, and fails on every rank when any rank found a wrong
// element (so that all ranks leave a case together and the next collective calls stay matched).
void agree(Env& env, int first, int count, const std::string& what) {
  std::vector<Check> host(count);
  TDIST_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), env.checks + first, count * sizeof(Check), cudaMemcpyDeviceToHost, env.stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  unsigned long long bad = 0;
  double worst = 0;
  std::string first_problem;
  for (int i = 0; i < count; ++i) {
    const Check& c = host[i];
    const double ref_max = bits_to_double(c.ref_max), err = bits_to_double(c.max_err);
    worst = std::max(worst, ref_max > 0 ? err / ref_max : err);
    if ((c.bad || c.gathered_bad) && first_problem.empty()) {
      first_problem = detail::concat(count > 1 ? detail::concat("call ", i, ": ") : "", c.bad, " wrong elements of D");
      if (c.bad)
        first_problem +=
            detail::concat(" (first at ", c.first_bad, ", max |err| / max |ref| = ", ref_max > 0 ? err / ref_max : err,
                           ", max |ref| = ", ref_max, ")");
      if (c.gathered_bad)
        first_problem +=
            detail::concat(", ", c.gathered_bad, " wrong elements of a_gathered (first at ", c.gathered_first_bad, ")");
    }
    bad += c.bad + c.gathered_bad;
  }
  tdist::test::fail_unless_every_rank_clean(env.world, "overlap check", bad, what + ": ", ": " + first_problem);
  if (env.me() == 0) std::printf("  %s: max |err| / max |ref| = %.3g on rank 0\n", what.c_str(), worst);
}

// Whether the call may run; the refusals the header allows return false (noted on rank 0), any other
// error is a failure: an odd N (D's rows not 16-byte multiples) with an error naming 'n'; the
// sequential method, with an error naming 'method', for AllGather / ReduceScatter with unequal
// per-rank counts and for collectives beyond its buffer (it must run small even ones: <= 16 MB).
template <typename T>
bool runnable(Env& env, const Problem<T>& p, Op op, Shape s, OverlapMethod method) {
  OverlapMethod resolved = OverlapMethod::kAuto;
  try {
    resolved = p.resolve(method);
  } catch (const tdist::Error& e) {
    const std::string what = e.what();
    const bool odd_n = s.n % 8 != 0 && what.find("'n'") != std::string::npos;
    const uint64_t bytes = 2ull * s.m * (op == Op::kAllGather ? s.k : s.n);
    const bool even = op == Op::kAllReduce || s.m % env.n() == 0;
    const bool sequential = method == OverlapMethod::kSequential && what.find("'method'") != std::string::npos &&
                            (!even || bytes > (16ull << 20));
    if (odd_n || sequential) {
      if (env.me() == 0) std::printf("  refused, as allowed: %s\n", what.c_str());
      return false;
    }
    throw;
  }
  TDIST_CHECK(resolved != OverlapMethod::kAuto, "method() returned auto");
  TDIST_CHECK(method == OverlapMethod::kAuto || resolved == method, "method(", to_string(method), ") returned ",
              to_string(resolved));
  if (method == OverlapMethod::kAuto && env.me() == 0) std::printf("  auto runs %s\n", to_string(resolved));
  return true;
}

// One case: fresh inputs, poisoned outputs, one call, the check.
template <typename T>
void run_case(Env& env, Contexts& ctx, Op op, Shape s, OverlapMethod method, bool with_gathered, bool zero_copy) {
  Problem<T> p(env, ctx, op, s, with_gathered, zero_copy);
  if (!runnable(env, p, op, s, method)) return;
  init_checks<<<1, 32, 0, env.stream>>>(env.checks, 1);
  p.fill(env.next_seed(), env.checks);
  p.poison();
  p.run(method);
  p.check(env.checks);
  agree(env, 0, 1, "output");
}

// `calls` calls back to back on the stream: fresh inputs and a rank-dependent delay before each,
// each call's output checked into its own slot; one agreement at the end.
template <typename T>
void run_back_to_back(Env& env, Contexts& ctx, Op op, Shape s, OverlapMethod method, int calls, bool zero_copy) {
  TDIST_CHECK(calls <= kMaxChecks, "too many calls");
  Problem<T> p(env, ctx, op, s, op == Op::kAllGather, zero_copy);
  if (!runnable(env, p, op, s, method)) return;
  init_checks<<<8, 128, 0, env.stream>>>(env.checks, calls);
  tdist::test::sync_all(env.world, "back to back start");
  for (int i = 0; i < calls; ++i) {
    const u64 seed = env.next_seed();
    p.poison();
    p.fill(seed, env.checks + i);
    if (i % 3 != 0) skew_kernel<<<1, 1, 0, env.stream>>>((seed ^ (env.me() * 0x2545F4914F6CDD1Dull)) % 20000);
    p.run(method);
    p.check(env.checks + i);
  }
  agree(env, 0, calls, detail::concat(calls, " calls"));
}

// One graph of (poison, call), captured once after an eager call, replayed `replays` times with
// fresh inputs written before each replay and each replay checked.
template <typename T>
void run_graph(Env& env, Contexts& ctx, Op op, Shape s, OverlapMethod method, int replays) {
  TDIST_CHECK(replays + 1 <= kMaxChecks, "too many replays");
  Problem<T> p(env, ctx, op, s, op == Op::kAllGather);
  if (!runnable(env, p, op, s, method)) return;
  cudaStream_t st = env.stream;
  init_checks<<<8, 128, 0, st>>>(env.checks, replays + 1);
  p.fill(env.next_seed(), env.checks);
  p.poison();
  p.run(method);  // eager first: anything loaded lazily is loaded before the capture
  p.check(env.checks);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TDIST_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  try {
    p.poison();
    p.run(method);
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(st, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  TDIST_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  tdist::test::sync_all(env.world, "graph ready");
  for (int r = 1; r <= replays; ++r) {
    p.fill(env.next_seed(), env.checks + r);
    TDIST_CUDA_CHECK(cudaGraphLaunch(exec, st));
    p.check(env.checks + r);
  }
  TDIST_CUDA_CHECK(cudaStreamSynchronize(st));
  TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TDIST_CUDA_CHECK(cudaGraphDestroy(graph));
  agree(env, 0, replays + 1, detail::concat("eager call and ", replays, " replays"));
}

template <typename F>
void dispatch(DType t, F&& f) {
  if (t == DType::kFloat16)
    f(__half{});
  else
    f(__nv_bfloat16{});
}

// Expects a tdist::Error whose message holds `needle`.
template <typename F>
void expect_error_text(const std::string& needle, F&& f) {
  try {
    f();
  } catch (const tdist::Error& e) {
    if (std::string(e.what()).find(needle) == std::string::npos) TDIST_FAIL("error without ", needle, ": ", e.what());
    return;
  }
  TDIST_FAIL("no error (expected one naming ", needle, ")");
}

// Expects a tdist::Error naming the argument 'arg'.
template <typename F>
void expect_error(const std::string& arg, F&& f) {
  expect_error_text("'" + arg + "'", std::forward<F>(f));
}

// Shapes of the sweep (see Shape for what n and k mean per op).
std::vector<Shape> sweep_shapes(Op op, int world, bool quick) {
  const int64_t n_ag = std::max<int64_t>(8, 14336 / world / 8 * 8), k_rs = std::max<int64_t>(8, 14336 / world / 8 * 8);
  std::vector<Shape> v;
  if (op == Op::kAllGather) {
    v = {{1000, 520, 264},   {4097, 1000, 520}, {1, 520, 264},    {257, 264, 520},   {3, 136, 264},
         {3000, 1784, 2056}, {2048, 1024, 264}, {1000, 521, 264}, {8192, n_ag, 8192}};
  } else {
    v = {{1000, 520, 264},   {4097, 1000, 520}, {1, 520, 264},    {257, 264, 1032},  {3, 136, 72},
         {3000, 1784, 2056}, {2048, 1024, 264}, {1000, 521, 264}, {8192, 8192, k_rs}};
  }
  if (quick) v.resize(3);
  return v;
}

std::string shape_name(Op op, Shape s) {
  return op == Op::kAllGather ? detail::concat("M=", s.m, " N_local=", s.n, " K=", s.k)
                              : detail::concat("M=", s.m, " N=", s.n, " K_local=", s.k);
}

// Builds the contexts one dtype's shapes need (collective; every rank the same).
void create_contexts(Env& env, Contexts& ctx, Op op, DType dtype, const std::vector<Shape>& shapes) {
  if (op == Op::kAllGather) {
    std::map<int64_t, int64_t> max_m;  // by K
    for (const Shape& s : shapes) max_m[s.k] = std::max(max_m[s.k], s.m);
    for (const auto& [k, m] : max_m) {
      AllGatherGemmConfig c;
      c.max_m = m;
      c.k = k;
      c.dtype = dtype;
      ctx.ag[k] = std::make_unique<AllGatherGemm>(env.world, env.heap, c);
    }
    return;
  }
  GemmReduceScatterConfig c;
  c.dtype = dtype;
  for (const Shape& s : shapes) c.max_m = std::max(c.max_m, s.m), c.max_n = std::max(c.max_n, s.n);
  if (op == Op::kReduceScatter)
    ctx.rs = std::make_unique<GemmReduceScatter>(env.world, env.heap, c);
  else
    ctx.ar = std::make_unique<GemmAllReduce>(env.world, env.heap, c);
}

// Argument errors of one op through its context and its pure check, then one right call.
template <typename T>
void argument_errors(Env& env, Contexts& ctx, Op op, Shape s) {
  Problem<T> p(env, ctx, op, s, false);
  cudaStream_t st = env.stream;
  if (op == Op::kAllGather) {
    AllGatherGemm& ag = *ctx.ag.at(s.k);
    const AllGatherGemmArgs good = p.ag_args();
    const int w = env.n(), me = env.me();
    auto bad = [&](const char* arg, auto change) {
      AllGatherGemmArgs a = good;
      change(a);
      expect_error(arg, [&] { ag.run(a, st, OverlapMethod::kFused); });
      expect_error(arg, [&] { ag.run(a, st); });
      expect_error(arg, [&] { ag.method(a); });
      expect_error(arg, [&] { check_all_gather_gemm_args(a, ag.config(), w, me); });
    };
    bad("m", [&](AllGatherGemmArgs& a) { a.m = ag.config().max_m + 1; });
    bad("m", [&](AllGatherGemmArgs& a) { a.m = -1; });
    bad("n", [&](AllGatherGemmArgs& a) { a.n = 521; });
    bad("a_local", [&](AllGatherGemmArgs& a) { a.a_local = nullptr; });
    bad("b", [&](AllGatherGemmArgs& a) { a.b = nullptr; });
    bad("d", [&](AllGatherGemmArgs& a) { a.d = nullptr; });
    bad("a_local", [&](AllGatherGemmArgs& a) { a.a_local = static_cast<const char*>(a.a_local) + 8; });
    bad("b", [&](AllGatherGemmArgs& a) { a.b = static_cast<const char*>(a.b) + 2; });
    bad("d", [&](AllGatherGemmArgs& a) { a.d = static_cast<char*>(a.d) + 8; });
    bad("a_gathered", [&](AllGatherGemmArgs& a) { a.a_gathered = static_cast<char*>(a.d) + 8; });
    AllGatherGemmConfig c = ag.config();
    c.dtype = DType::kFloat32;
    expect_error("dtype", [&] { check_all_gather_gemm_args(good, c, w, me); });
  } else {
    // ReduceScatter's d (this rank's rows) is checked by run() only: the pure check takes no rank.
    const bool rs_op = op == Op::kReduceScatter;
    auto errors = [&](auto& context, auto good, auto check) {
      using Args = decltype(good);
      auto bad = [&](const char* arg, auto change) {
        Args a = good;
        change(a);
        expect_error(arg, [&] { context.run(a, st, OverlapMethod::kFused); });
        expect_error(arg, [&] { context.run(a, st); });
        if (rs_op && std::string(arg) == "d") return;
        expect_error(arg, [&] { context.method(a); });
        expect_error(arg, [&] { check(a, context.config()); });
      };
      bad("m", [&](Args& a) { a.m = context.config().max_m + 1; });
      bad("n", [&](Args& a) { a.n = context.config().max_n + 1; });
      bad("n", [&](Args& a) { a.n = 521; });
      bad("k", [&](Args& a) { a.k = 12; });
      bad("k", [&](Args& a) { a.k = 0; });
      bad("a", [&](Args& a) { a.a = nullptr; });
      bad("b", [&](Args& a) { a.b = nullptr; });
      bad("d", [&](Args& a) { a.d = nullptr; });
      bad("a", [&](Args& a) { a.a = static_cast<const char*>(a.a) + 8; });
      bad("b", [&](Args& a) { a.b = static_cast<const char*>(a.b) + 2; });
      bad("d", [&](Args& a) { a.d = static_cast<char*>(a.d) + 8; });
      GemmReduceScatterConfig c = context.config();
      c.dtype = DType::kFloat32;
      expect_error("dtype", [&] { check(good, c); });
    };
    if (op == Op::kReduceScatter)
      errors(*ctx.rs, p.template reduce_args<GemmReduceScatterArgs>(),
             [](const GemmReduceScatterArgs& a, const GemmReduceScatterConfig& c) {
               check_gemm_reduce_scatter_args(a, c);
             });
    else
      errors(*ctx.ar, p.template reduce_args<GemmAllReduceArgs>(),
             [](const GemmAllReduceArgs& a, const GemmAllReduceConfig& c) { check_gemm_all_reduce_args(a, c); });
  }
  // Nothing was launched by the rejected calls: the context still runs right (flags and epochs in step).
  TDIST_CUDA_CHECK(cudaStreamSynchronize(st));
  for (OverlapMethod m : {OverlapMethod::kFused, OverlapMethod::kChunked}) {
    init_checks<<<1, 32, 0, st>>>(env.checks, 1);
    p.fill(env.next_seed(), env.checks);
    p.poison();
    p.run(m);
    p.check(env.checks);
    agree(env, 0, 1, detail::concat("a ", to_string(m), " call after the rejected ones"));
  }
}

// A broken CUDA context (a trapped kernel) fails everything after it: stop there.
bool context_broken() {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) return false;
  std::printf("FAIL: the CUDA context is broken (%s); stopping\n", cudaGetErrorString(e));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, small = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--small") == 0) {
      small = quick = true;  // two small shapes, fused and chunked only: for compute-sanitizer
    } else {
      std::fprintf(stderr, "usage: %s [--quick | --small]\n", argv[0]);
      return 2;
    }
  }
  World world;
  tdist::test::Suite suite(world);
  // One dtype's contexts at a time: the largest (M = N = 8192) may stage fp32 partials of every
  // peer. TDIST_SYMMETRIC_HEAP_SIZE overrides.
  const char* heap_env = std::getenv("TDIST_SYMMETRIC_HEAP_SIZE");
  SymmetricHeap heap(world, heap_env && *heap_env ? 0 : (8ull << 30));
  Env env{world, heap};
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
  TDIST_CUDA_CHECK(cudaMalloc(&env.checks, kMaxChecks * sizeof(Check)));
  env.seed_base = tdist::test::all_gather_u64(world, "seed", tdist::test::fresh_seed(0))[0];
  const int w = world.world_size();
  if (world.rank() == 0)
    std::printf("gemm_overlap test: %d ranks%s, seed %llx\n", w, quick ? ", quick" : "", env.seed_base);

  const Op ops[] = {Op::kAllGather, Op::kReduceScatter, Op::kAllReduce};

  // 1. Every op x dtype x shape x method, fresh inputs per case.
  for (Op op : ops) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      std::vector<Shape> shapes = sweep_shapes(op, w, quick);
      if (small) shapes = {shapes[0], shapes[2]};
      Contexts ctx;
      suite.run(detail::concat(op_name(op), " ", to_string(dtype), ": create contexts"),
                [&] { create_contexts(env, ctx, op, dtype, shapes); });
      for (size_t si = 0; si < shapes.size(); ++si) {
        const Shape s = shapes[si];
        const bool gathered = op == Op::kAllGather && si % 2 == 0;  // a_gathered on every other shape
        for (OverlapMethod method : kMethods) {
          if (small && method != OverlapMethod::kFused && method != OverlapMethod::kChunked) continue;
          suite.run(detail::concat(op_name(op), " ", to_string(dtype), " ", to_string(method), " ", shape_name(op, s),
                                   gathered ? " +a_gathered" : ""),
                    [&] {
                      dispatch(dtype, [&](auto t) { run_case<decltype(t)>(env, ctx, op, s, method, gathered, false); });
                    });
          if (context_broken()) return suite.finish();
        }
      }
    }
  }

  if (small) return suite.finish();

  // 2. AllGather-GEMM zero copy: this rank's rows written straight into local_rows(m).
  {
    const std::vector<Shape> shapes = {{1000, 520, 264}, {4097, 1000, 264}, {1, 520, 264}};
    Contexts ctx;
    suite.run("ag_gemm bf16 zero copy: create context",
              [&] { create_contexts(env, ctx, Op::kAllGather, DType::kBFloat16, shapes); });
    for (const Shape& s : shapes) {
      for (OverlapMethod method : kMethods) {
        suite.run(detail::concat("ag_gemm bf16 ", to_string(method), " zero copy (a_local = local_rows) ",
                                 shape_name(Op::kAllGather, s), " +a_gathered"),
                  [&] { run_case<__nv_bfloat16>(env, ctx, Op::kAllGather, s, method, true, true); });
        if (context_broken()) return suite.finish();
      }
    }
    const int calls = quick ? 50 : 200;
    for (OverlapMethod method : {OverlapMethod::kFused, OverlapMethod::kChunked}) {
      suite.run(detail::concat("ag_gemm bf16 ", to_string(method), " zero copy, ", calls, " calls back to back"),
                [&] { run_back_to_back<__nv_bfloat16>(env, ctx, Op::kAllGather, shapes[0], method, calls, true); });
      if (context_broken()) return suite.finish();
    }
  }

  // 3. Per op (bf16, a small odd shape): back to back, CUDA graphs, argument errors.
  for (Op op : ops) {
    const Shape s{1000, 520, 264};
    const Shape s2 = op == Op::kAllGather ? Shape{257, 136, 264} : Shape{257, 136, 72};
    Contexts ctx;
    suite.run(detail::concat(op_name(op), " bf16 stress: create context"), [&] {
      create_contexts(env, ctx, op, DType::kBFloat16, {s, s2});
    });
    const int calls = quick ? 50 : 200;
    for (OverlapMethod method : kMethods) {
      if (quick && (method == OverlapMethod::kBaseline || method == OverlapMethod::kAuto)) continue;
      suite.run(detail::concat(op_name(op), " bf16 ", to_string(method), " ", shape_name(op, s), ", ", calls,
                               " calls back to back"),
                [&] { run_back_to_back<__nv_bfloat16>(env, ctx, op, s, method, calls, false); });
      if (context_broken()) return suite.finish();
    }
    // Alternating shapes and methods on one context: buffers and flags sized for one call are
    // reused by a call of another shape or method.
    suite.run(detail::concat(op_name(op), " bf16 alternating shapes and methods, back to back"), [&] {
      for (int round = 0; round < (quick ? 2 : 8); ++round) {
        for (OverlapMethod method : kMethods) {
          run_case<__nv_bfloat16>(env, ctx, op, round % 2 ? s2 : s, method, op == Op::kAllGather, false);
        }
      }
    });
    if (context_broken()) return suite.finish();
    const int replays = quick ? 10 : 50;
    for (OverlapMethod method : kMethods) {
      if (quick && method != OverlapMethod::kFused) continue;
      suite.run(detail::concat(op_name(op), " bf16 ", to_string(method), " ", shape_name(op, s),
                               ", CUDA graph captured once, ", replays, " replays with fresh inputs"),
                [&] { run_graph<__nv_bfloat16>(env, ctx, op, s, method, replays); });
      if (context_broken()) return suite.finish();
    }
    suite.run(detail::concat(op_name(op), " argument errors name the argument (class and check function)"),
              [&] { argument_errors<__nv_bfloat16>(env, ctx, op, s); });
    if (context_broken()) return suite.finish();
  }

  // 4. The chunked ReduceScatter and AllReduce in row pieces (TDIST_OVERLAP_PIECES; a small shape
  // has one piece by default): uneven pieces, back to back, and replayed from a CUDA graph.
  for (Op op : {Op::kReduceScatter, Op::kAllReduce}) {
    const Shape s{1000, 520, 264};
    Contexts ctx;
    suite.run(detail::concat(op_name(op), " bf16 row pieces: create context"),
              [&] { create_contexts(env, ctx, op, DType::kBFloat16, {s}); });
    for (int pieces : {2, 3, 4}) {
      setenv("TDIST_OVERLAP_PIECES", std::to_string(pieces).c_str(), 1);
      const std::string what = detail::concat(op_name(op), " bf16 chunked in ", pieces, " pieces ", shape_name(op, s));
      suite.run(what, [&] { run_case<__nv_bfloat16>(env, ctx, op, s, OverlapMethod::kChunked, false, false); });
      if (pieces == 3) {
        const int calls = quick ? 50 : 200;
        suite.run(detail::concat(what, ", ", calls, " calls back to back"),
                  [&] { run_back_to_back<__nv_bfloat16>(env, ctx, op, s, OverlapMethod::kChunked, calls, false); });
        suite.run(detail::concat(what, ", CUDA graph replays with fresh inputs"),
                  [&] { run_graph<__nv_bfloat16>(env, ctx, op, s, OverlapMethod::kChunked, quick ? 10 : 50); });
      }
      if (context_broken()) return suite.finish();
    }
    unsetenv("TDIST_OVERLAP_PIECES");
  }

  // 5. Configurations the constructors refuse (every rank alike, before any collective step).
  suite.run("constructor errors name the argument", [&] {
    AllGatherGemmConfig ag;
    ag.max_m = 1024;
    ag.k = 12;
    expect_error_text("k'", [&] { AllGatherGemm bad(world, heap, ag); });  // 'k' or 'config.k'
    ag.k = 264;
    ag.dtype = DType::kFloat32;
    expect_error("dtype", [&] { AllGatherGemm bad(world, heap, ag); });
    GemmReduceScatterConfig rs;
    rs.max_m = 1024;
    rs.max_n = 1024;
    rs.dtype = DType::kFloat32;
    expect_error("dtype", [&] { GemmReduceScatter bad(world, heap, rs); });
    expect_error("dtype", [&] { GemmAllReduce bad(world, heap, rs); });
  });

  TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  TDIST_CUDA_CHECK(cudaFree(env.checks));
  TDIST_CUDA_CHECK(cudaStreamDestroy(env.stream));
  return suite.finish();
}
