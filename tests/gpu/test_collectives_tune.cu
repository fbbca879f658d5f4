// The timed choice of tdist::Collectives (method auto) across ranks: the first call of a size class
// times every feasible method on scratch buffers and must leave the caller's data alone, so in-place
// AllReduce / AllGather / ReduceScatter on fresh classes give exactly the reference result; odd
// counts and offsets, ordinary and symmetric buffers; many classes back to back without host waits;
// capture of a class never seen (the table decides, nothing is timed); explicit methods, a heap too
// full for scratch and TDIST_COLLECTIVE_TUNE=0 time nothing; the ranks agree on every winner.
// Run with tdistrun -n N (N >= 1; with one rank nothing is timed and the results are still checked).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu/collective_reference.cuh"
#include "gpu/harness.cuh"
#include "tdist/ops/collectives.hpp"

using namespace tdist;
using tdist::device::u64;

namespace {

using namespace tdist::test::collective_reference;

constexpr size_t kMaxBytes = 64ull << 20;
constexpr size_t kRegion = kMaxBytes + 4096;  // one buffer of a case, room for offsets

const char* env_of(Op op) {
  return op == Op::kAllReduce   ? kAllReduceMethodEnv
         : op == Op::kAllGather ? kAllGatherMethodEnv
                                : kReduceScatterMethodEnv;
}

struct Env {
  World& world;
  SymmetricHeap& heap;
  Collectives& coll;
  char* d_buf;  // ordinary, 2 regions
  char* s_buf;  // symmetric, 2 regions
  unsigned long long* counters;
  u64 seed_base;
  u64 cases = 0;
  cudaStream_t stream;
  int n() const { return world.world_size(); }
  int me() const { return world.rank(); }
};

// Whether auto times a new class of `op` in this run (not with one rank, TDIST_COLLECTIVE_TUNE=0 or
// a method set in the environment).
bool expect_timing(Env& env, Op op) {
  const char* v = std::getenv(env_of(op));
  const bool env_method = v != nullptr && *v != '\0' && std::string(v) != "auto";
  return env.coll.tuning() && env.n() >= 2 && !env_method;
}

// One call: the op, its element count (AllReduce count, per-rank AllGather input, per-rank
// ReduceScatter output), the buffers' kind, in place or not, and an offset in elements from the
// regions' 256-byte aligned starts (the output region gets 3 x the offset: another alignment).
struct Case {
  Op op;
  DType dtype;
  size_t c;
  bool symmetric;
  bool in_place;
  size_t offset;
};

std::string describe(const Case& k) {
  return detail::concat(op_name(k.op), " ", to_string(k.dtype), " count ", k.c,
                        k.symmetric ? " symmetric" : " ordinary", k.in_place ? " in place" : " out of place",
                        " offset ", k.offset);
}

// The buffers of a case: where the input is filled (in_count elements), what the op gets, where
// the output is checked, and whether the output may be poisoned first (it does not hold the input).
struct Layout {
  char* fill;
  const void* in;
  void* out;
  bool poison;
};

Layout layout(Env& env, const Case& k) {
  const size_t sz = dtype_size(k.dtype), b = k.c * sz;
  char* base = k.symmetric ? env.s_buf : env.d_buf;
  char* in = base + k.offset * sz;
  char* out = base + kRegion + 3 * k.offset * sz;
  if (!k.in_place) return {in, in, out, true};
  if (k.op == Op::kAllReduce) return {out, out, out, false};
  if (k.op == Op::kAllGather) return {out + env.me() * b, out + env.me() * b, out, true};  // own part refilled after
  return {in, in, in + env.me() * b, false};
}

void call_op(Env& env, const Case& k, const Layout& L, int method, cudaStream_t s) {
  if (k.op == Op::kAllReduce) env.coll.all_reduce(L.in, L.out, k.c, k.dtype, s, static_cast<AllReduceMethod>(method));
  if (k.op == Op::kAllGather) env.coll.all_gather(L.in, L.out, k.c, k.dtype, s, static_cast<AllGatherMethod>(method));
  if (k.op == Op::kReduceScatter)
    env.coll.reduce_scatter(L.in, L.out, k.c, k.dtype, s, static_cast<ReduceScatterMethod>(method));
}

int query_method(Env& env, const Case& k, const Layout& L) {
  if (k.op == Op::kAllReduce) return static_cast<int>(env.coll.all_reduce_method(L.in, L.out, k.c, k.dtype));
  if (k.op == Op::kAllGather) return static_cast<int>(env.coll.all_gather_method(L.in, L.out, k.c, k.dtype));
  return static_cast<int>(env.coll.reduce_scatter_method(L.in, L.out, k.c, k.dtype));
}

// Enqueues poison, fill, the op (method auto unless given) and the check into counters[0..1].
template <typename T>
void enqueue_case(Env& env, const Case& k, unsigned long long* counters, int method = 0) {
  const size_t n = env.n(), sz = sizeof(T);
  const size_t in_count = k.op == Op::kReduceScatter ? n * k.c : k.c;
  const size_t out_count = k.op == Op::kAllGather ? n * k.c : k.c;
  const Layout L = layout(env, k);
  const u64 seed = env.seed_base + 7919 * ++env.cases;
  cudaStream_t s = env.stream;
  if (L.poison) TDIST_CUDA_CHECK(cudaMemsetAsync(L.out, 0xFF, out_count * sz, s));  // NaN in every dtype
  fill_kernel<T><<<512, 256, 0, s>>>(reinterpret_cast<T*>(L.fill), in_count, seed, nullptr, env.me(), 0);
  call_op(env, k, L, method, s);
  check_kernel<T><<<512, 256, 0, s>>>(reinterpret_cast<const T*>(L.out), out_count, k.op, k.c, env.n(), env.me(), seed,
                                      nullptr, k.op == Op::kAllGather ? 0.0 : tolerance(k.dtype), counters,
                                      counters + 1);
  TDIST_CUDA_CHECK(cudaGetLastError());
}

// Every rank's mismatch count: all ranks pass or fail together.
void agree(Env& env, unsigned long long bad, unsigned long long first, const std::string& what) {
  tdist::test::fail_unless_every_rank_clean(env.world, "tune check", bad, what + ": ",
                                            detail::concat(", first at ", first));
}

// After a test graph's last replay on `s`: checks the mismatch counters on every rank and returns the
// rounds the graph's `counter` saw; the graph and the counter are freed.
u64 finish_graph(Env& env, cudaStream_t s, cudaGraphExec_t exec, u64* counter, const std::string& what) {
  unsigned long long host[2];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, s));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
  u64 done = 0;
  TDIST_CUDA_CHECK(cudaMemcpy(&done, counter, sizeof(done), cudaMemcpyDeviceToHost));
  TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TDIST_CUDA_CHECK(cudaFree(counter));
  agree(env, host[0], host[1], what);
  return done;
}

void reset_counters(Env& env, unsigned long long* counters, size_t pairs) {
  std::vector<unsigned long long> init(2 * pairs);
  for (size_t i = 0; i < pairs; ++i) init[2 * i] = 0, init[2 * i + 1] = ~0ull;
  TDIST_CUDA_CHECK(
      cudaMemcpyAsync(counters, init.data(), init.size() * sizeof(init[0]), cudaMemcpyHostToDevice, env.stream));
}

// Runs one case and checks it; returns the number of classes timed by it.
size_t run_case(Env& env, const Case& k, int method = 0) {
  const size_t before = env.coll.tuned_classes();
  reset_counters(env, env.counters, 1);
  dispatch(k.dtype, [&](auto t) { enqueue_case<decltype(t)>(env, k, env.counters, method); });
  unsigned long long host[2];
  TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, env.stream));
  TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  agree(env, host[0], host[1], describe(k));
  return env.coll.tuned_classes() - before;
}

// The method auto now picks for the case is the same on every rank.
void check_ranks_agree_on_method(Env& env, const Case& k) {
  const int m = query_method(env, k, layout(env, k));
  const auto all = tdist::test::all_gather_u64(env.world, "tune method", static_cast<unsigned long long>(m));
  for (int r = 0; r < env.n(); ++r)
    TDIST_CHECK(all[r] == all[0], describe(k), ": rank ", r, " picks method ", all[r], ", rank 0 ", all[0]);
}

// In-place and out-of-place calls of classes never seen: the class is timed at its first call (on
// scratch), and the result is exactly the reference, which an in-place AllReduce run on the
// caller's buffer by the timing would not be. A second call of the class uses the winner.
void run_fresh_classes(Env& env, tdist::test::Suite& suite, Op op, DType dtype) {
  // Counts in distinct quarter-octave buckets (classes never share one), odd, up to 12 MB of f32.
  const std::vector<size_t> counts = {1, 1001, 4101, 65537, 300007, 1048579, 3145731};
  suite.run(detail::concat(op_name(op), " ", to_string(dtype), ": fresh classes timed, data exact"), [&] {
    size_t timed = 0;
    for (size_t c : counts) {
      if (c * dtype_size(dtype) * (op == Op::kAllReduce ? 1 : env.n()) + 3 * 16 * dtype_size(dtype) > kMaxBytes)
        continue;
      for (bool symmetric : {false, true}) {
        for (bool in_place : {true, false}) {
          for (size_t offset : {size_t{0}, size_t{5}}) {
            const Case k{op, dtype, c, symmetric, in_place, offset};
            const size_t t = run_case(env, k);
            TDIST_CHECK(t <= 1, describe(k), ": ", t, " classes timed by one call");
            timed += t;
            check_ranks_agree_on_method(env, k);
            TDIST_CHECK(run_case(env, k) == 0, describe(k), ": the second call of a class timed it again");
          }
        }
      }
    }
    // Each (kind, in place, offset) per count is a class of its own unless an offset keeps the
    // alignment class; at least the first count's classes must have been timed when timing is on.
    if (expect_timing(env, op)) TDIST_CHECK(timed >= 4, "only ", timed, " classes were timed");
    if (!expect_timing(env, op)) TDIST_CHECK(timed == 0, timed, " classes were timed with timing off");
  });
}

// Many classes back to back on the stream, no host wait between cases but the timing's own: each
// case counts into its own counters, one agreement at the end; every size twice (timed, then looked up).
void run_back_to_back(Env& env, tdist::test::Suite& suite, Op op) {
  suite.run(detail::concat(op_name(op), " bf16: 2 x 48 sizes back to back, mixed kinds"), [&] {
    std::vector<Case> cases;
    size_t c = 1;
    for (int i = 0; i < 48; ++i) {
      c = c + c / 3 + 1;  // about 1.33 x: every bucket about once
      if (c * 2 * env.n() > kMaxBytes / 2) break;
      const Case k{op, DType::kBFloat16, c, i % 3 == 1, i % 2 == 0, static_cast<size_t>(i % 4 == 3 ? 3 : 0)};
      cases.push_back(k);
      cases.push_back(k);
    }
    unsigned long long* counters = nullptr;
    TDIST_CUDA_CHECK(cudaMalloc(&counters, 2 * cases.size() * sizeof(unsigned long long)));
    reset_counters(env, counters, cases.size());
    for (size_t i = 0; i < cases.size(); ++i)
      dispatch(cases[i].dtype, [&](auto t) { enqueue_case<decltype(t)>(env, cases[i], counters + 2 * i); });
    std::vector<unsigned long long> host(2 * cases.size());
    TDIST_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), counters, host.size() * sizeof(host[0]), cudaMemcpyDeviceToHost, env.stream));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    TDIST_CUDA_CHECK(cudaFree(counters));
    unsigned long long bad = 0;
    std::string first;
    for (size_t i = 0; i < cases.size(); ++i) {
      if (host[2 * i] == 0) continue;
      if (bad == 0) first = detail::concat(describe(cases[i]), ": ", host[2 * i], " wrong, first at ", host[2 * i + 1]);
      bad += host[2 * i];
    }
    tdist::test::fail_unless_every_rank_clean(env.world, "tune back to back", bad, "",
                                              detail::concat(" (", first, ")"));
    for (const Case& k : cases) check_ranks_agree_on_method(env, k);
  });
}

// A class first met under graph capture: nothing is timed (the table decides), the graph replays
// right; the first eager call then times it, and the graph still replays right.
void run_capture_of_new_class(Env& env, tdist::test::Suite& suite, bool symmetric) {
  suite.run(
      detail::concat("capture of a class never seen: all_reduce f16 in place, ", symmetric ? "symmetric" : "ordinary"),
      [&] {
        const Case k{Op::kAllReduce, DType::kFloat16, symmetric ? size_t{777781} : size_t{777777}, symmetric, true, 1};
        const Layout L = layout(env, k);
        u64* counter;
        TDIST_CUDA_CHECK(cudaMalloc(&counter, sizeof(u64)));
        tdist::test::fill_device(counter, 0, sizeof(u64));
        const u64 seed = env.seed_base + 104729 * ++env.cases;
        cudaStream_t s = env.stream;
        auto round = [&] {
          fill_kernel<__half><<<512, 256, 0, s>>>(reinterpret_cast<__half*>(L.fill), k.c, seed, counter, env.me(), 0);
          call_op(env, k, L, 0, s);
          check_kernel<__half><<<512, 256, 0, s>>>(reinterpret_cast<const __half*>(L.out), k.c, Op::kAllReduce, k.c,
                                                   env.n(), env.me(), seed, counter, tolerance(k.dtype), env.counters,
                                                   env.counters + 1);
          bump_kernel<<<1, 1, 0, s>>>(counter);
        };
        reset_counters(env, env.counters, 1);
        TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
        const size_t before = env.coll.tuned_classes();
        cudaGraph_t g;
        cudaGraphExec_t exec;
        TDIST_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        round();
        TDIST_CUDA_CHECK(cudaStreamEndCapture(s, &g));
        TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        TDIST_CUDA_CHECK(cudaGraphDestroy(g));
        TDIST_CHECK(env.coll.tuned_classes() == before, "a class was timed under capture");
        tdist::test::sync_all(env.world, "tune graph ready");
        constexpr int kReplays = 50, kEager = 3;
        for (int r = 0; r < kReplays; ++r) TDIST_CUDA_CHECK(cudaGraphLaunch(exec, s));
        for (int r = 0; r < kEager; ++r) round();  // the first times the class
        const size_t after_eager = env.coll.tuned_classes();
        for (int r = 0; r < kReplays; ++r) TDIST_CUDA_CHECK(cudaGraphLaunch(exec, s));
        const u64 done = finish_graph(env, s, exec, counter, describe(k));
        TDIST_CHECK(done == 2 * kReplays + kEager, "ran ", done, " rounds");
        if (expect_timing(env, Op::kAllReduce))
          TDIST_CHECK(after_eager == before + 1, "the first eager call timed ", after_eager - before,
                      " classes, expected 1");
        check_ranks_agree_on_method(env, k);
      });
}

// tune_*() before capture: the class is timed without running the op (the buffers keep their
// bytes), the graph then runs the winner, and its replays are right.
void run_tune_before_capture(Env& env, tdist::test::Suite& suite, Op op) {
  suite.run(detail::concat("tune_", op_name(op), " before capture: data untouched, graph replays right"), [&] {
    const Case k{op, DType::kFloat16, 55557, true, true, 0};  // f16, symmetric, in place: a class never seen
    const Layout L = layout(env, k);
    const size_t n = env.n(), sz = 2;
    const size_t in_count = op == Op::kReduceScatter ? n * k.c : k.c;
    const size_t out_count = op == Op::kAllGather ? n * k.c : k.c;
    const size_t region = (op == Op::kAllReduce ? k.c : n * k.c) * sz;  // the in-place buffer
    char* buffer =
        op == Op::kReduceScatter ? const_cast<char*>(static_cast<const char*>(L.in)) : static_cast<char*>(L.out);
    cudaStream_t s = env.stream;
    const u64 seed = env.seed_base + 1299709 * ++env.cases;
    TDIST_CUDA_CHECK(cudaMemsetAsync(buffer, 0x5A, region, s));
    fill_kernel<__half><<<512, 256, 0, s>>>(reinterpret_cast<__half*>(L.fill), in_count, seed, nullptr, env.me(), 0);
    std::vector<char> before(region), after(region);
    TDIST_CUDA_CHECK(cudaMemcpyAsync(before.data(), buffer, region, cudaMemcpyDeviceToHost, s));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
    const size_t classes = env.coll.tuned_classes();
    int m = 0;
    if (op == Op::kAllReduce) m = static_cast<int>(env.coll.tune_all_reduce(L.in, L.out, k.c, k.dtype, s));
    if (op == Op::kAllGather) m = static_cast<int>(env.coll.tune_all_gather(L.in, L.out, k.c, k.dtype, s));
    if (op == Op::kReduceScatter) m = static_cast<int>(env.coll.tune_reduce_scatter(L.in, L.out, k.c, k.dtype, s));
    TDIST_CUDA_CHECK(cudaMemcpyAsync(after.data(), buffer, region, cudaMemcpyDeviceToHost, s));
    TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
    TDIST_CHECK(before == after, describe(k), ": tuning changed the caller's buffer");
    if (expect_timing(env, op))
      TDIST_CHECK(env.coll.tuned_classes() == classes + 1, describe(k), ": tune timed ",
                  env.coll.tuned_classes() - classes, " classes, expected 1");
    TDIST_CHECK(query_method(env, k, L) == m, describe(k), ": tune returned ", m, ", the query ",
                query_method(env, k, L));
    check_ranks_agree_on_method(env, k);
    // The graph: fill (fresh per replay), the op, the check, bump.
    u64* counter;
    TDIST_CUDA_CHECK(cudaMalloc(&counter, sizeof(u64)));
    tdist::test::fill_device(counter, 0, sizeof(u64));
    reset_counters(env, env.counters, 1);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaGraph_t g;
    cudaGraphExec_t exec;
    TDIST_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    if (L.poison) TDIST_CUDA_CHECK(cudaMemsetAsync(L.out, 0xFF, out_count * sz, s));
    fill_kernel<__half><<<512, 256, 0, s>>>(reinterpret_cast<__half*>(L.fill), in_count, seed, counter, env.me(), 0);
    call_op(env, k, L, 0, s);
    check_kernel<__half><<<512, 256, 0, s>>>(reinterpret_cast<const __half*>(L.out), out_count, op, k.c, env.n(),
                                             env.me(), seed, counter, op == Op::kAllGather ? 0.0 : tolerance(k.dtype),
                                             env.counters, env.counters + 1);
    bump_kernel<<<1, 1, 0, s>>>(counter);
    TDIST_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    TDIST_CUDA_CHECK(cudaGraphDestroy(g));
    tdist::test::sync_all(env.world, "tune before capture");
    constexpr int kReplays = 40;
    for (int r = 0; r < kReplays; ++r) TDIST_CUDA_CHECK(cudaGraphLaunch(exec, s));
    const u64 done = finish_graph(env, s, exec, counter, describe(k));
    TDIST_CHECK(done == kReplays, "ran ", done, " rounds");
  });
}

}  // namespace

int main() {
  World world;
  tdist::test::Suite suite(world);
  // Room for the two regions, the context, its scratch (two regions' worth) and a second context.
  SymmetricHeap heap(world, 2 * kRegion + 2 * kMaxBytes + 2 * kRegion + (128ull << 20));
  Collectives coll(world, heap, kMaxBytes);
  Env env{world, heap, coll, nullptr, nullptr, nullptr, 0, 0, nullptr};
  TDIST_CUDA_CHECK(cudaMalloc(&env.d_buf, 2 * kRegion));
  env.s_buf = heap.allocate_array<char>(2 * kRegion);
  TDIST_CUDA_CHECK(cudaMalloc(&env.counters, 2 * sizeof(unsigned long long)));
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
  env.seed_base = tdist::test::all_gather_u64(world, "seed", tdist::test::fresh_seed(0))[0];
  if (world.rank() == 0)
    std::printf("collective tuning %s, %d ranks\n", coll.tuning() ? "on" : "off (TDIST_COLLECTIVE_TUNE=0)",
                world.world_size());

  for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter})
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) run_fresh_classes(env, suite, op, dtype);
  for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter}) run_back_to_back(env, suite, op);
  run_capture_of_new_class(env, suite, false);
  run_capture_of_new_class(env, suite, true);
  for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter}) run_tune_before_capture(env, suite, op);

  suite.run("explicit methods time nothing", [&] {
    const size_t before = coll.tuned_classes();
    run_case(env, {Op::kAllReduce, DType::kFloat16, 99991, false, true, 0}, static_cast<int>(AllReduceMethod::kNccl));
    run_case(env, {Op::kAllGather, DType::kFloat16, 99991, true, false, 0}, static_cast<int>(AllGatherMethod::kSm));
    run_case(env, {Op::kReduceScatter, DType::kFloat16, 99991, false, false, 0},
             static_cast<int>(ReduceScatterMethod::kFused));
    TDIST_CHECK(coll.tuned_classes() == before, "an explicit method timed a class");
  });

  suite.run("a heap too full for scratch: the table decides, data exact", [&] {
    // Fill the heap so that symmetric scratch for 8 MB cannot be had (first fit may take another
    // block than the largest: repeat); every rank holds the same blocks.
    constexpr size_t kKeep = 1ull << 20;
    std::vector<void*> fillers;
    for (int i = 0; i < 16; ++i) {
      const auto free_all = tdist::test::all_gather_u64(world, "tune heap free", heap.largest_free_block());
      const size_t free_bytes = *std::min_element(free_all.begin(), free_all.end());
      if (free_bytes <= kKeep + 4096) break;
      fillers.push_back(heap.allocate(free_bytes - kKeep));
    }
    TDIST_CHECK(heap.largest_free_block() <= kKeep + 4096, "could not fill the heap");
    const size_t before = coll.tuned_classes();
    const Case k{Op::kAllReduce, DType::kBFloat16, (4ull << 20) + 3, true, true, 0};  // 8 MB, in place
    TDIST_CHECK(run_case(env, k) == 0, "timed without room for scratch");
    run_case(env, k);
    TDIST_CHECK(coll.tuned_classes() == before, "a class was timed without scratch");
    check_ranks_agree_on_method(env, k);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    for (void* f : fillers) heap.free(f);
  });

  suite.run("TDIST_COLLECTIVE_TUNE=0: a context that times nothing", [&] {
    const char* was = std::getenv("TDIST_COLLECTIVE_TUNE");
    const std::string saved = was ? was : "";
    setenv("TDIST_COLLECTIVE_TUNE", "0", 1);
    {
      Collectives off(world, heap, 1 << 20);
      TDIST_CHECK(!off.tuning(), "TDIST_COLLECTIVE_TUNE=0 left timing on");
      const size_t c = 100003;  // 200 KB of bf16, in place, ordinary
      char* p = env.d_buf + 2;
      reset_counters(env, env.counters, 1);
      const u64 seed = env.seed_base + 31 * ++env.cases;
      fill_kernel<__nv_bfloat16>
          <<<512, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(p), c, seed, nullptr, env.me(), 0);
      off.all_reduce(p, p, c, DType::kBFloat16, env.stream);
      check_kernel<__nv_bfloat16><<<512, 256, 0, env.stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(p), c, Op::kAllReduce, c, env.n(), env.me(), seed, nullptr,
          tolerance(DType::kBFloat16), env.counters, env.counters + 1);
      unsigned long long host[2];
      TDIST_CUDA_CHECK(cudaMemcpyAsync(host, env.counters, sizeof(host), cudaMemcpyDeviceToHost, env.stream));
      TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      agree(env, host[0], host[1], "all_reduce with timing off");
      TDIST_CHECK(off.tuned_classes() == 0, "a context with timing off timed ", off.tuned_classes(), " classes");
    }
    if (was)
      setenv("TDIST_COLLECTIVE_TUNE", saved.c_str(), 1);
    else
      unsetenv("TDIST_COLLECTIVE_TUNE");
  });

  TDIST_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  heap.free(env.s_buf);
  TDIST_CUDA_CHECK(cudaFree(env.d_buf));
  TDIST_CUDA_CHECK(cudaFree(env.counters));
  return suite.finish();
}
