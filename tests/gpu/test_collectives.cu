// tdist::Collectives across ranks: every op x dtype x method against a reference computed in double
// from (seed, rank, index), sizes from one element to 256 MB (odd counts, unaligned buffers), ordinary
// and symmetric (zero-copy) buffers, in place and out of place, outputs poisoned first; 1000 replays of
// captured CUDA graphs whose inputs are regenerated inside the graph; the stream barrier; argument
// errors. Run with tdistrun -n N (N >= 2), one GPU per rank.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu/collective_reference.cuh"
#include "gpu/harness.cuh"
#include "tdist/ops/collectives.hpp"

using namespace tdist;
using tdist::device::u64;

namespace {

using namespace tdist::test::collective_reference;

constexpr size_t kMaxBytes = 256ull << 20;

// Barrier test: write this round's value into a cell, meet, then read every peer's cell.
__global__ void write_cell_kernel(u64* cell, u64 value) { *cell = value; }
__global__ void read_cells_kernel(device::SymmetricHeapView heap, u64* cell, u64 value, unsigned long long* bad) {
  for (int p = threadIdx.x; p < heap.num_ranks; p += blockDim.x)
    if (device::ld_relaxed<device::Scope::kSystem>(heap.symm_at(cell, p)) != value) atomicAdd(bad, 1ull);
}

enum class Kind { kOrdinary, kUnaligned, kInPlace, kSymmetric, kSymmetricInPlace };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kOrdinary: return "ordinary";
    case Kind::kUnaligned: return "unaligned";
    case Kind::kInPlace: return "in-place";
    case Kind::kSymmetric: return "symmetric";
    default: return "symmetric in-place";
  }
}

struct Env {
  World& world;
  SymmetricHeap& heap;
  Collectives& coll;
  char *d_in, *d_out, *s_in, *s_out;  // ordinary and symmetric, kMaxBytes + 256 each
  unsigned long long* counters;       // bad, first_bad
  u64 seed_base;
  u64 cases = 0;
  cudaStream_t stream;
  int n() const { return world.world_size(); }
  int me() const { return world.rank(); }
};

// Every rank's mismatch count: all ranks pass or fail a case together.
void agree(Env& env, unsigned long long bad, unsigned long long first, const std::string& what) {
  tdist::test::fail_unless_every_rank_clean(env.world, "coll check", bad, what + ": ",
                                            detail::concat(", first at ", first));
}

void reset_counters(Env& env, cudaStream_t s) {
  const unsigned long long init[2] = {0, ~0ull};
  TDIST_CUDA_CHECK(cudaMemcpyAsync(env.counters, init, sizeof(init), cudaMemcpyHostToDevice, s));
}

// Buffers of one case: where the input is filled, what the op gets, where the output is checked.
struct Layout {
  char* fill;  // input elements go here (in_count of them)
  const void* in;
  void* out;
  bool poison;  // the output is separate from the input
};

Layout layout(Env& env, Op op, Kind kind, size_t c, size_t sz) {
  const bool sym = kind == Kind::kSymmetric || kind == Kind::kSymmetricInPlace;
  char* in = sym ? env.s_in : env.d_in;
  char* out = sym ? env.s_out : env.d_out;
  if (kind == Kind::kUnaligned) {
    in += sz;       // one element off 16-byte alignment
    out += 3 * sz;  // another
  }
  if (kind == Kind::kInPlace || kind == Kind::kSymmetricInPlace) {
    if (op == Op::kAllReduce) return {out, out, out, false};
    if (op == Op::kAllGather) return {out + env.me() * c * sz, out + env.me() * c * sz, out, true};
    return {in, in, in + env.me() * c * sz, false};
  }
  return {in, in, out, true};
}

// Enqueues one case (poison, fill, op, check into counters[0] / counters[1]) without waiting.
template <typename T>
void enqueue_case(Env& env, Op op, DType dtype, size_t c, Kind kind, int method, unsigned long long* counters) {
  const size_t sz = sizeof(T), n = env.n();
  const size_t in_count = op == Op::kReduceScatter ? n * c : c;
  const size_t out_count = op == Op::kAllGather ? n * c : c;
  const Layout L = layout(env, op, kind, c, sz);
  const u64 seed = env.seed_base + 7919 * ++env.cases;
  cudaStream_t s = env.stream;
  if (L.poison) TDIST_CUDA_CHECK(cudaMemsetAsync(L.out, 0xFF, out_count * sz, s));  // NaN in every dtype
  fill_kernel<T><<<1024, 256, 0, s>>>(reinterpret_cast<T*>(L.fill), in_count, seed, nullptr, env.me(), 0);
  if (op == Op::kAllReduce) env.coll.all_reduce(L.in, L.out, c, dtype, s, static_cast<AllReduceMethod>(method));
  if (op == Op::kAllGather) env.coll.all_gather(L.in, L.out, c, dtype, s, static_cast<AllGatherMethod>(method));
  if (op == Op::kReduceScatter)
    env.coll.reduce_scatter(L.in, L.out, c, dtype, s, static_cast<ReduceScatterMethod>(method));
  check_kernel<T><<<1024, 256, 0, s>>>(reinterpret_cast<const T*>(L.out), out_count, op, c, env.n(), env.me(), seed,
                                       nullptr, op == Op::kAllGather ? 0.0 : tolerance(dtype), counters, counters + 1);
  TDIST_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void run_case(Env& env, Op op, DType dtype, size_t c, Kind kind, int method) {
  cudaStream_t s = env.stream;
  reset_counters(env, s);
  enqueue_case<T>(env, op, dtype, c, kind, method, env.counters);
  unsigned long long host[2];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, s));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  agree(env, host[0], host[1], detail::concat(kind_name(kind), ", ", c, " elements"));
}

// Whether the context can run `method` on this case (explicit infeasible methods are errors).
bool runnable(Env& env, Op op, DType dtype, size_t c, Kind kind, int method) {
  const size_t sz = dtype_size(dtype);
  const Layout L = layout(env, op, kind, c, sz);
  try {
    if (op == Op::kAllReduce) env.coll.all_reduce_method(L.in, L.out, c, dtype, static_cast<AllReduceMethod>(method));
    if (op == Op::kAllGather) env.coll.all_gather_method(L.in, L.out, c, dtype, static_cast<AllGatherMethod>(method));
    if (op == Op::kReduceScatter)
      env.coll.reduce_scatter_method(L.in, L.out, c, dtype, static_cast<ReduceScatterMethod>(method));
  } catch (const tdist::Error&) {
    return false;
  }
  return true;
}

std::string method_name(Op op, int m) {
  if (op == Op::kAllReduce) return to_string(static_cast<AllReduceMethod>(m));
  if (op == Op::kAllGather) return to_string(static_cast<AllGatherMethod>(m));
  return to_string(static_cast<ReduceScatterMethod>(m));
}

std::vector<int> methods_of(Op op) {
  if (op == Op::kAllReduce) return {0, 1, 2, 3, 4, 5, 6};
  if (op == Op::kAllGather) return {0, 1, 2, 3, 4, 5, 6};
  return {0, 1, 2, 3, 4};
}

void run_sweep(Env& env, tdist::test::Suite& suite, Op op) {
  const size_t n = env.n();
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const size_t sz = dtype_size(dtype);
    // Per-op element count c: the AllReduce count, the per-rank AllGather input, the per-rank
    // ReduceScatter output. The largest makes the op's buffer 256 MB.
    const size_t largest = (kMaxBytes / sz) / (op == Op::kAllReduce ? 1 : n);
    // 131069 and 524285 bf16 elements fill the default 256 KB LL and 1 MB LL128 buffers to within
    // 6 bytes.
    std::vector<size_t> counts = {1, 3, 8, 1001, 4096 + 5, 65536, 131069, 262147, 524285, (1u << 20) + 1, 8u << 20};
    if (dtype == DType::kBFloat16) counts.push_back(largest);
    for (int m : methods_of(op)) {
      suite.run(detail::concat(op_name(op), " ", to_string(dtype), " ", method_name(op, m)), [&] {
        size_t ran = 0;
        for (size_t c : counts) {
          if (c * sz * (op == Op::kAllReduce ? 1 : n) > kMaxBytes) continue;
          for (Kind kind :
               {Kind::kOrdinary, Kind::kUnaligned, Kind::kInPlace, Kind::kSymmetric, Kind::kSymmetricInPlace}) {
            if (c == largest && kind != Kind::kOrdinary && kind != Kind::kSymmetric) continue;  // time
            if (!runnable(env, op, dtype, c, kind, m)) continue;
            dispatch(dtype, [&](auto t) {
              using T = decltype(t);
              run_case<T>(env, op, dtype, c, kind, m);
            });
            ++ran;
          }
        }
        TDIST_CHECK(ran > 0, "no size was runnable");
      });
    }
  }
}

// Every count from 1 to 2 x world x 16 elements (below, at and above world size x vector width, where
// slices and block ranges are empty or partial), every buffer kind, every method, back to back on the
// stream with no host synchronisation between cases (as an application issues them: a rank refills
// its buffers for case k + 1 while slower peers may still run case k). Each case counts into its own
// pair of counters; one agreement at the end.
void run_small_sweep(Env& env, tdist::test::Suite& suite, Op op) {
  const size_t n = env.n(), max_count = 2 * n * 16;
  const Kind kinds[] = {Kind::kOrdinary, Kind::kUnaligned, Kind::kInPlace, Kind::kSymmetric, Kind::kSymmetricInPlace};
  const size_t kinds_n = sizeof(kinds) / sizeof(kinds[0]);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (int m : methods_of(op)) {
      suite.run(detail::concat(op_name(op), " ", to_string(dtype), " ", method_name(op, m), ", counts 1..", max_count,
                               " back to back"),
                [&] {
                  const size_t cases = max_count * kinds_n;
                  unsigned long long* counters = nullptr;
                  TDIST_CUDA_CHECK(cudaMalloc(&counters, 2 * cases * sizeof(unsigned long long)));
                  std::vector<unsigned long long> host(2 * cases);
                  for (size_t i = 0; i < cases; ++i) host[2 * i] = 0, host[2 * i + 1] = ~0ull;
                  TDIST_CUDA_CHECK(cudaMemcpyAsync(counters, host.data(), host.size() * sizeof(host[0]),
                                                   cudaMemcpyHostToDevice, env.stream));
                  std::vector<bool> ran(cases, false);
                  for (size_t c = 1; c <= max_count; ++c) {
                    for (size_t k = 0; k < kinds_n; ++k) {
                      if (!runnable(env, op, dtype, c, kinds[k], m)) continue;
                      const size_t i = (c - 1) * kinds_n + k;
                      dispatch(dtype, [&](auto t) {
                        using T = decltype(t);
                        enqueue_case<T>(env, op, dtype, c, kinds[k], m, counters + 2 * i);
                      });
                      ran[i] = true;
                    }
                  }
                  TDIST_CUDA_CHECK(cudaMemcpyAsync(host.data(), counters, host.size() * sizeof(host[0]),
                                                   cudaMemcpyDeviceToHost, env.stream));
                  TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
                  TDIST_CUDA_CHECK(cudaFree(counters));
                  unsigned long long bad = 0;
                  std::string first;
                  for (size_t i = 0; i < cases; ++i) {
                    if (!ran[i] || host[2 * i] == 0) continue;
                    if (bad == 0)
                      first = detail::concat(kind_name(kinds[i % kinds_n]), ", ", i / kinds_n + 1,
                                             " elements: ", host[2 * i], " wrong, first at ", host[2 * i + 1]);
                    bad += host[2 * i];
                  }
                  tdist::test::fail_unless_every_rank_clean(env.world, "coll small sweep", bad, "",
                                                            detail::concat(" (first case: ", first, ")"));
                  TDIST_CHECK(std::count(ran.begin(), ran.end(), true) > 0, "no size was runnable");
                });
    }
  }
}

// Diagnostic: NCCL's own AllGather / ReduceScatter on buffers inside the heap's window (registered
// NCCL_WIN_COLL_SYMMETRIC, so NCCL may pick its symmetric kernels), called directly rather than
// through tdist, at per-rank sizes on and off 16 bytes. It reports what NCCL returns and does not
// fail on NCCL's behaviour: tdist routes such unaligned calls around the window
// (nccl_avoid_symmetric_kernels), which the sweeps check. One case per line, entry and exit
// synchronised on the host so no other work overlaps.
template <typename T>
void nccl_window_diagnostic(Env& env, Op op, DType dtype, ncclDataType_t nt, size_t c) {
  const size_t n = env.n(), sz = sizeof(T);
  const size_t in_count = op == Op::kReduceScatter ? n * c : c;
  const size_t out_count = op == Op::kAllGather ? n * c : c;
  const u64 seed = env.seed_base + 7919 * ++env.cases;
  cudaStream_t s = env.stream;
  reset_counters(env, s);
  TDIST_CUDA_CHECK(cudaMemsetAsync(env.s_out, 0xFF, out_count * sz, s));
  fill_kernel<T><<<1024, 256, 0, s>>>(reinterpret_cast<T*>(env.s_in), in_count, seed, nullptr, env.me(), 0);
  tdist::test::sync_all(env.world, "nccl diag in");
  if (op == Op::kAllGather)
    TDIST_NCCL_CHECK(ncclAllGather(env.s_in, env.s_out, c, nt, env.world.comm(), s));
  else
    TDIST_NCCL_CHECK(ncclReduceScatter(env.s_in, env.s_out, c, nt, ncclSum, env.world.comm(), s));
  check_kernel<T><<<1024, 256, 0, s>>>(reinterpret_cast<const T*>(env.s_out), out_count, op, c, env.n(), env.me(), seed,
                                       nullptr, op == Op::kAllGather ? 0.0 : tolerance(dtype), env.counters,
                                       env.counters + 1);
  TDIST_CUDA_CHECK(cudaGetLastError());
  unsigned long long host[2];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, s));
  tdist::test::sync_all(env.world, "nccl diag out");
  const auto all = tdist::test::all_gather_u64(env.world, "nccl diag", host[0]);
  if (env.me() == 0) {
    std::string per_rank;
    for (int r = 0; r < env.n(); ++r) per_rank += detail::concat(r ? ", " : "", all[r]);
    std::printf(
        "DIAG nccl %s on symmetric-window buffers, %s, %zu elements (%zu bytes per rank%s): wrong elements "
        "per rank [%s]%s\n",
        op_name(op), to_string(dtype), c, c * sz, (c * sz) % 16 ? ", not a multiple of 16" : "", per_rank.c_str(),
        std::count_if(all.begin(), all.end(), [](unsigned long long v) { return v != 0; }) ? "  <-- WRONG" : "");
    std::fflush(stdout);
  }
}

// Runs `launches` x `per_launch` rounds of enqueue_round(counter, seed) on the stream: eagerly, or
// as `launches` replays of one captured graph holding `per_launch` rounds. Each round regenerates its
// inputs from the device `counter`, checks its output into env.counters and bumps the counter, so
// graph replays see fresh inputs. Then checks that every round ran and that every rank agrees.
template <typename EnqueueRound>
void run_rounds(Env& env, u64 seed_step, bool graph, int per_launch, int launches, const std::string& what,
                EnqueueRound&& enqueue_round) {
  u64* counter;
  TDIST_CUDA_CHECK(cudaMalloc(&counter, sizeof(u64)));
  tdist::test::fill_device(counter, 0, sizeof(u64));
  const u64 seed = env.seed_base + seed_step * ++env.cases;
  cudaStream_t s = env.stream;
  reset_counters(env, s);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  auto enqueue_launch = [&] {
    for (int k = 0; k < per_launch; ++k) enqueue_round(counter, seed);
  };
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g;
    TDIST_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    enqueue_launch();
    TDIST_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    TDIST_CUDA_CHECK(cudaGraphDestroy(g));
  }
  tdist::test::sync_all(env.world, "rounds ready");
  for (int r = 0; r < launches; ++r) {
    if (graph)
      TDIST_CUDA_CHECK(cudaGraphLaunch(exec, s));
    else
      enqueue_launch();
  }
  unsigned long long host[2];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, s));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  u64 done = 0;
  TDIST_CUDA_CHECK(cudaMemcpy(&done, counter, sizeof(done), cudaMemcpyDeviceToHost));
  if (exec) TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TDIST_CUDA_CHECK(cudaFree(counter));
  TDIST_CHECK(done == static_cast<u64>(launches) * per_launch, what, ": ran ", done, " rounds");
  agree(env, host[0], host[1], what);
}

// `replays` replays of one graph holding 4 rounds of (regenerate input from the device counter, op,
// check, bump counter): flags and epochs must survive replay.
template <typename T>
void run_graph(Env& env, Op op, DType dtype, size_t c, int method, bool symmetric, int replays) {
  const size_t n = env.n(), sz = sizeof(T);
  const size_t in_count = op == Op::kReduceScatter ? n * c : c;
  const size_t out_count = op == Op::kAllGather ? n * c : c;
  char* in = symmetric ? env.s_in : env.d_in;
  char* out = symmetric ? env.s_out : env.d_out;
  constexpr int kOpsPerGraph = 4;
  run_rounds(env, 104729, true, kOpsPerGraph, replays / kOpsPerGraph, detail::concat("graph replays, ", c, " elements"),
             [&](u64* counter, u64 seed) {
               cudaStream_t s = env.stream;
               TDIST_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, out_count * sz, s));
               fill_kernel<T><<<256, 256, 0, s>>>(reinterpret_cast<T*>(in), in_count, seed, counter, env.me(), 0);
               if (op == Op::kAllReduce)
                 env.coll.all_reduce(in, out, c, dtype, s, static_cast<AllReduceMethod>(method));
               if (op == Op::kAllGather)
                 env.coll.all_gather(in, out, c, dtype, s, static_cast<AllGatherMethod>(method));
               if (op == Op::kReduceScatter)
                 env.coll.reduce_scatter(in, out, c, dtype, s, static_cast<ReduceScatterMethod>(method));
               check_kernel<T><<<256, 256, 0, s>>>(reinterpret_cast<const T*>(out), out_count, op, c, env.n(), env.me(),
                                                   seed, counter, op == Op::kAllGather ? 0.0 : tolerance(dtype),
                                                   env.counters, env.counters + 1);
               bump_kernel<<<1, 1, 0, s>>>(counter);
             });
}

// Calls that each read the output of the call before them, on one stream with no host wait between:
// with programmatic launch every call's kernel is scheduled while the previous call's kernel still
// runs, so a kernel that touched its input, epoch or buffers before waiting for it would read stale
// data. `rounds` rounds of (fill from the device counter, chain, check, bump), eagerly or as
// replays of a graph of one round.
//   AllReduce: in place, methods[0], methods[1], ... over the same buffer: the result is
//   n^(k-1) x the sum of the inputs after k calls, with one rounding per call.
//   ReduceScatter then AllGather (methods {rs, ag}): the AllGather gathers, in place, the slices the
//   ReduceScatter just wrote: together an AllReduce of n x c elements.
template <typename T>
void run_chain(Env& env, DType dtype, size_t c, bool all_reduce, const std::vector<int>& methods, bool symmetric,
               bool graph, int rounds) {
  const size_t n = env.n(), sz = sizeof(T);
  const size_t count = all_reduce ? c : n * c;  // elements filled and checked
  char* in = symmetric ? env.s_in : env.d_in;
  char* out = symmetric ? env.s_out : env.d_out;
  double scale = 1.0;
  if (all_reduce)
    for (size_t k = 1; k < methods.size(); ++k) scale *= static_cast<double>(n);
  const double tol = (all_reduce ? methods.size() : 1) * tolerance(dtype);
  run_rounds(
      env, 15485863, graph, 1, rounds, detail::concat("chained calls, ", c, " elements"), [&](u64* counter, u64 seed) {
        cudaStream_t s = env.stream;
        char* slice = out + env.me() * c * sz;
        TDIST_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, count * sz, s));
        fill_kernel<T>
            <<<256, 256, 0, s>>>(reinterpret_cast<T*>(all_reduce ? out : in), count, seed, counter, env.me(), 0);
        if (all_reduce) {
          for (int m : methods) env.coll.all_reduce(out, out, c, dtype, s, static_cast<AllReduceMethod>(m));
        } else {
          env.coll.reduce_scatter(in, slice, c, dtype, s, static_cast<ReduceScatterMethod>(methods[0]));
          env.coll.all_gather(slice, out, c, dtype, s, static_cast<AllGatherMethod>(methods[1]));
        }
        check_kernel<T><<<256, 256, 0, s>>>(reinterpret_cast<const T*>(out), count, Op::kAllReduce, count, env.n(),
                                            env.me(), seed, counter, tol, env.counters, env.counters + 1, scale);
        bump_kernel<<<1, 1, 0, s>>>(counter);
      });
}

template <typename F>
void expect_error(const std::string& needle, F&& f) {
  try {
    f();
  } catch (const tdist::Error& e) {
    if (std::string(e.what()).find(needle) == std::string::npos) TDIST_FAIL("error without '", needle, "': ", e.what());
    return;
  }
  TDIST_FAIL("no error (expected one naming ", needle, ")");
}

}  // namespace

int main() {
  World world;
  tdist::test::Suite suite(world);
  if (world.world_size() < 2) {
    std::printf("test_collectives needs at least 2 ranks (tdistrun -n 2)\n");
    return 2;
  }
  const size_t buf = kMaxBytes + 256;
  SymmetricHeap heap(world, 2 * kMaxBytes + 2 * buf + (64ull << 20));
  Collectives coll(world, heap, kMaxBytes);
  Env env{world, heap, coll, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, nullptr};
  TDIST_CUDA_CHECK(cudaMalloc(&env.d_in, buf));
  TDIST_CUDA_CHECK(cudaMalloc(&env.d_out, buf));
  env.s_in = heap.allocate_array<char>(buf);
  env.s_out = heap.allocate_array<char>(buf);
  TDIST_CUDA_CHECK(cudaMalloc(&env.counters, 2 * sizeof(unsigned long long)));
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
  env.seed_base = tdist::test::all_gather_u64(world, "seed", tdist::test::fresh_seed(0))[0];

  run_sweep(env, suite, Op::kAllReduce);
  run_sweep(env, suite, Op::kAllGather);
  run_sweep(env, suite, Op::kReduceScatter);
  run_small_sweep(env, suite, Op::kAllReduce);
  run_small_sweep(env, suite, Op::kAllGather);
  run_small_sweep(env, suite, Op::kReduceScatter);

  suite.run("diagnostic: NCCL AllGather / ReduceScatter directly on symmetric-window buffers (reports only)", [&] {
    for (Op op : {Op::kAllGather, Op::kReduceScatter}) {
      for (size_t c : {size_t{1000}, size_t{1001}, size_t{1024}, size_t{1025}, size_t{4096 + 5}}) {
        nccl_window_diagnostic<__nv_bfloat16>(env, op, DType::kBFloat16, ncclBfloat16, c);
        nccl_window_diagnostic<float>(env, op, DType::kFloat32, ncclFloat32, c);
      }
    }
  });

  // Graph replays: every tdist method, ordinary and symmetric buffers, 1000 ops each (fresh inputs
  // generated inside the graph from a device counter).
  struct G {
    Op op;
    int method;
    size_t c;
  };
  const std::vector<G> graphs = {
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kLowLatency), 4099},
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kLowLatency), 131069},  // the whole LL buffer
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kLowLatency128), 3001},
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kLowLatency128), 524285},  // the whole LL128 buffer
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kOneShot), 65537},
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kTwoShot), 262147},
      {Op::kAllReduce, static_cast<int>(AllReduceMethod::kCe), 65536},
      {Op::kAllGather, static_cast<int>(AllGatherMethod::kLowLatency), 1025},
      {Op::kAllGather, static_cast<int>(AllGatherMethod::kSm), 65536 + 8},
      {Op::kAllGather, static_cast<int>(AllGatherMethod::kSmPush), 65536 + 5},
      {Op::kAllGather, static_cast<int>(AllGatherMethod::kCePush), 65536},
      {Op::kAllGather, static_cast<int>(AllGatherMethod::kCePull), 65536},
      {Op::kReduceScatter, static_cast<int>(ReduceScatterMethod::kFused), 65536 + 3},
      {Op::kReduceScatter, static_cast<int>(ReduceScatterMethod::kCe), 65536},
      {Op::kReduceScatter, static_cast<int>(ReduceScatterMethod::kLowLatency), 16384 + 3},
  };
  for (const G& g : graphs) {
    // sm_push stores into the peers' outputs: symmetric ones only.
    const bool symmetric_only = g.op == Op::kAllGather && g.method == static_cast<int>(AllGatherMethod::kSmPush);
    for (bool symmetric : {false, true}) {
      if (symmetric_only && !symmetric) continue;
      suite.run(detail::concat("CUDA graph, 1000 replays: ", op_name(g.op), " ", method_name(g.op, g.method), " bf16 ",
                               symmetric ? "symmetric" : "ordinary"),
                [&] { run_graph<__nv_bfloat16>(env, g.op, DType::kBFloat16, g.c, g.method, symmetric, 1000); });
    }
  }

  // Chained calls (each reads the previous call's output): programmatic launch must not let a call
  // start on data its predecessor has not finished.
  {
    using AR = AllReduceMethod;
    const int ll = static_cast<int>(AR::kLowLatency), ll128 = static_cast<int>(AR::kLowLatency128),
              one = static_cast<int>(AR::kOneShot), two = static_cast<int>(AR::kTwoShot),
              aut = static_cast<int>(AR::kAuto);
    const std::vector<int> ar_chain = {ll, ll128, one, two, ll, two, ll128, one, ll, ll};
    for (size_t c : {size_t{3001}, size_t{32771}}) {
      for (bool symmetric : {false, true}) {
        for (bool graph : {false, true}) {
          suite.run(
              detail::concat("chained calls: all_reduce in place, ", ar_chain.size(), " methods in turn, ", c,
                             " bf16, ", symmetric ? "symmetric" : "ordinary", graph ? ", graph x 100" : ", 100 rounds"),
              [&] { run_chain<__nv_bfloat16>(env, DType::kBFloat16, c, true, ar_chain, symmetric, graph, 100); });
        }
      }
    }
    const int ce = static_cast<int>(AR::kCe);
    for (bool graph : {false, true}) {
      suite.run(detail::concat("chained calls: all_reduce in place, ce between SM methods, 40960 bf16, symmetric",
                               graph ? ", graph x 100" : ", 100 rounds"),
                [&] {
                  run_chain<__nv_bfloat16>(env, DType::kBFloat16, 40960, true, {ce, ll, ce, ll128, one, ce}, true,
                                           graph, 100);
                });
    }
    suite.run("chained calls: all_reduce auto, 4 in a row, 3001 f32, graph x 250", [&] {
      run_chain<float>(env, DType::kFloat32, 3001, true, {aut, aut, aut, aut}, false, true, 250);
    });
    using RS = ReduceScatterMethod;
    using AG = AllGatherMethod;
    const std::vector<std::vector<int>> rs_ag = {
        {static_cast<int>(RS::kLowLatency), static_cast<int>(AG::kLowLatency)},
        {static_cast<int>(RS::kFused), static_cast<int>(AG::kSm)},
        {static_cast<int>(RS::kLowLatency), static_cast<int>(AG::kSm)},
        {static_cast<int>(RS::kFused), static_cast<int>(AG::kLowLatency)},
        {static_cast<int>(RS::kCe), static_cast<int>(AG::kCePush)},
    };
    for (bool graph : {false, true}) {
      suite.run(
          detail::concat("chained calls: reduce_scatter ll then all_gather sm_push in place, 4099 bf16, symmetric",
                         graph ? ", graph x 100" : ", 100 rounds"),
          [&] {
            run_chain<__nv_bfloat16>(env, DType::kBFloat16, 4099, false,
                                     {static_cast<int>(RS::kLowLatency), static_cast<int>(AG::kSmPush)}, true, graph,
                                     100);
          });
    }
    for (const auto& m : rs_ag) {
      for (bool graph : {false, true}) {
        suite.run(detail::concat("chained calls: reduce_scatter ", method_name(Op::kReduceScatter, m[0]),
                                 " then all_gather ", method_name(Op::kAllGather, m[1]), " in place, 4099 bf16",
                                 graph ? ", graph x 100" : ", 100 rounds"),
                  [&] { run_chain<__nv_bfloat16>(env, DType::kBFloat16, 4099, false, m, false, graph, 100); });
      }
    }
  }

  suite.run("barrier(stream): every peer's write is visible after it, 200 rounds", [&] {
    u64* cell = heap.allocate_signals64(1);
    reset_counters(env, env.stream);
    for (u64 round = 1; round <= 200; ++round) {
      write_cell_kernel<<<1, 1, 0, env.stream>>>(cell, round);
      coll.barrier(env.stream);
      read_cells_kernel<<<1, 64, 0, env.stream>>>(heap.view(), cell, round, env.counters);
      coll.barrier(env.stream);  // nobody overwrites its cell before every peer has read it
    }
    unsigned long long host[2];
    TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, env.stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    agree(env, host[0], 0, "barrier");
    heap.free(cell);
  });

  suite.run("argument errors name the argument", [&] {
    cudaStream_t s = env.stream;
    expect_error("'count'", [&] { coll.all_reduce(env.d_in, env.d_out, 0, DType::kBFloat16, s); });
    expect_error("'dtype'", [&] { coll.all_reduce(env.d_in, env.d_out, 16, static_cast<DType>(9), s); });
    expect_error("'in'", [&] { coll.all_gather(nullptr, env.d_out, 16, DType::kFloat32, s); });
    expect_error("'out'", [&] { coll.reduce_scatter(env.d_in, nullptr, 16, DType::kFloat32, s); });
    expect_error("overlaps", [&] { coll.all_reduce(env.d_in, env.d_in + 2, 64, DType::kFloat32, s); });
    expect_error("'method'", [&] {
      coll.all_reduce(env.d_in, env.d_out, 1 << 20, DType::kFloat32, s, AllReduceMethod::kLowLatency);
    });
    expect_error("ll128_bytes", [&] {
      coll.all_reduce(env.d_in, env.d_out, 1 << 20, DType::kFloat32, s, AllReduceMethod::kLowLatency128);
    });
    // ll ReduceScatter with a per-rank slice one vector larger than the LL buffer: 'method'.
    const size_t ll_over = coll.limits().ll_bytes / 2 + 8;  // bf16 elements per rank
    TDIST_CHECK(ll_over * 2 * env.n() <= buf, "ll reduce_scatter case does not fit");
    expect_error("'method'", [&] {
      coll.reduce_scatter(env.d_in, env.d_out, ll_over, DType::kBFloat16, s, ReduceScatterMethod::kLowLatency);
    });
    // Auto: ll for small inputs (any team up to 8 ranks), unless the environment overrides it or
    // the class was timed (the sweeps above ran it with auto; its winner may be another method).
    const char* rs_env = std::getenv(kReduceScatterMethodEnv);
    if ((rs_env == nullptr || *rs_env == '\0') && !coll.tuning())
      TDIST_CHECK(
          coll.reduce_scatter_method(env.d_in, env.d_out, 1001, DType::kBFloat16) == ReduceScatterMethod::kLowLatency,
          "auto for a small reduce_scatter is not ll");
    // ce_push staging an output one vector per rank larger than the workspace: 'method'. The
    // output (world x count) must still fit in d_out; a count whose output runs past d_out into
    // d_in is an overlap, and that error names 'out' (checked below).
    const size_t over = kMaxBytes / (2 * static_cast<size_t>(env.n())) + 8;  // bf16: 16 B per rank past
    TDIST_CHECK(over * 2 * env.n() <= buf && over * 2 * env.n() > coll.max_bytes(), "ce_push case does not fit");
    expect_error("'method'",
                 [&] { coll.all_gather(env.d_in, env.d_out, over, DType::kBFloat16, s, AllGatherMethod::kCePush); });
    // Out of place with the input inside the output, not at this rank's part: an overlap naming 'out'.
    expect_error("'out'", [&] { coll.all_gather(env.d_out + 64, env.d_out, 64, DType::kFloat32, s); });
    // A symmetric buffer that runs past the heap's end.
    const auto& v = heap.view();
    expect_error("'in'", [&] {
      coll.all_reduce(v.local_base() + v.size - 64, env.d_out, 1024, DType::kFloat32, s, AllReduceMethod::kOneShot);
    });
    // Beyond the workspace (by 8 elements; the buffers hold them), auto falls back to NCCL instead
    // of failing.
    const size_t beyond = coll.max_bytes() / 2 + 8;
    TDIST_CHECK(beyond * 2 <= buf, "the beyond-workspace case does not fit the buffers");
    TDIST_CHECK(coll.all_reduce_method(env.d_in, env.d_out, beyond, DType::kBFloat16) == AllReduceMethod::kNccl,
                "auto beyond the workspace is not nccl");
  });

  TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  TDIST_CUDA_CHECK(cudaFree(env.d_in));
  TDIST_CUDA_CHECK(cudaFree(env.d_out));
  TDIST_CUDA_CHECK(cudaFree(env.counters));
  return suite.finish();
}
