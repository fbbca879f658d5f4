// Decode attention against a float64 host reference of softmax attention, on fresh random inputs
// (every rank draws the same whole sequences from a shared seed and can rebuild any rank's part):
//
//   * single GPU: bf16 / fp16, head dim 64, 128, 256, GQA 1, 4, 6, 8, 16, 17 and 32 (heads in chunks), page size
//     1, 16, 64, 256 and the contiguous cache, lengths 0, 1, not a multiple of the page, mixed in one
//     batch, a long sequence cut in many splits, softcap; pages in random order, the unused rows of
//     the cache and the unused block-table entries poisoned (NaN rows, entries far outside), outputs
//     poisoned (NaN) first; max |err| of out and lse within the dtype's rounding;
//   * sequence-parallel over every rank: each sequence's tokens dealt to ranks at random, some
//     sequences wholly on one rank (the others hold none), some empty; every rank's out checked and
//     bit-identical across ranks;
//   * CUDA graphs (single GPU and distributed) captured once, replayed with new lengths (device
//     memory) and new contents, each replay checked; and 1000 replays of a decode loop whose lengths
//     a kernel writes late in each step (the split kernel has started by then), each replay equal
//     bit for bit to an eager call, every 100th checked against float64;
//   * errors: host checks name the argument; a block-table entry outside the cache and a length
//     beyond the capacity are reported by check_errors() naming block_table / seq_lens.
//
//   build-gpu/tools/tdistrun -n 2 -- build-gpu/tests/gpu_test_flash_decode
// Prints "rank R: N passed, M failed" last.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "gpu/test_values.cuh"
#include "tdist/common/device_buffer.hpp"
#include "tdist/ops/flash_decode.hpp"

using namespace tdist;

namespace {

uint64_t mix(uint64_t x) {
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return x;
}

// A multiple of 1/64 in [-1, 1]: exact in bf16 and fp16.
float value(uint64_t seed, uint64_t i) {
  return static_cast<float>(static_cast<int>(mix((i + 1) * 0x9E3779B97F4A7C15ull ^ seed) % 129) - 64) / 64.0f;
}

using test::expect_error;
using test::to_t;
template <typename T>
double to_d(T v);
template <>
double to_d<__half>(__half v) {
  return __half2float(v);
}
template <>
double to_d<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
T nan_t() {
  T v;
  std::memset(&v, 0xFF, sizeof(v));
  return v;
}

struct Geometry {
  int64_t batch, q_heads, kv_heads, head_dim;
  int64_t page_size;  // 0: contiguous cache
  int64_t capacity;   // tokens per sequence
  float scale_mul;    // softmax_scale = scale_mul / sqrt(head_dim)
  float softcap;
  bool combined = false;  // K and V in one buffer, a page of each in turn (FlashInfer's [pages][2][...])
};

std::string describe(const Geometry& g, DType dtype) {
  return detail::concat(to_string(dtype), " batch ", g.batch, " heads ", g.q_heads, "/", g.kv_heads, " d ", g.head_dim,
                        g.page_size ? detail::concat(" page ", g.page_size) : std::string(" contiguous"), " capacity ",
                        g.capacity, g.softcap > 0 ? " softcap" : "", g.combined ? " combined K/V pages" : "");
}

// Which rank holds token t of sequence b: sequences b % 4 == 1 wholly on one rank, others dealt at random.
int owner(uint64_t seed, int64_t b, int64_t t, int n) {
  if (n == 1) return 0;
  if (b % 4 == 1) return static_cast<int>((b / 4 + seed) % n);
  return static_cast<int>(
      mix(seed ^ (static_cast<uint64_t>(b) << 40) ^ static_cast<uint64_t>(t) * 0x2545F4914F6CDD1Dull) % n);
}

template <typename T>
struct Case {
  Geometry g;
  int64_t max_pages = 0, num_pages = 0;
  std::vector<int32_t> lens_global, lens_local, table;
  std::vector<T> q, k, v;
  std::vector<double> ref_out, ref_lse;
  DeviceBuffer d_q, d_k, d_v, d_table, d_lens, d_out, d_lse;

  explicit Case(const Geometry& geometry) : g(geometry) {
    const int64_t d = g.head_dim;
    if (g.page_size > 0) {
      max_pages = (g.capacity + g.page_size - 1) / g.page_size;
      num_pages = g.batch * max_pages + 3;  // spare pages, poisoned
    } else {
      num_pages = g.batch;
    }
    const int64_t rows = g.page_size > 0 ? num_pages * g.page_size : g.batch * g.capacity;
    q.resize(g.batch * g.q_heads * d);
    k.resize(rows * g.kv_heads * d);
    v.resize(k.size());
    table.resize(std::max<int64_t>(g.batch * max_pages, 1));
    d_q = DeviceBuffer(q.size() * sizeof(T));
    d_k = DeviceBuffer((g.combined ? 2 : 1) * k.size() * sizeof(T));
    d_v = DeviceBuffer(g.combined ? sizeof(T) : v.size() * sizeof(T));  // combined: V lies in d_k
    d_table = DeviceBuffer(table.size() * sizeof(int32_t));
    d_lens = DeviceBuffer(g.batch * sizeof(int32_t));
    d_out = DeviceBuffer(q.size() * sizeof(T));
    d_lse = DeviceBuffer(g.batch * g.q_heads * sizeof(float));
  }

  // Draws the whole sequences of `lens` from `seed`, keeps this rank's tokens in its cache (pages in
  // random order), computes the reference over the whole sequences and uploads.
  void fill(uint64_t seed, const std::vector<int32_t>& lens, int n, int me) {
    const int64_t d = g.head_dim, H = g.q_heads, KH = g.kv_heads, group = H / KH;
    lens_global = lens;
    lens_local.assign(g.batch, 0);
    std::fill(k.begin(), k.end(), nan_t<T>());
    std::fill(v.begin(), v.end(), nan_t<T>());
    for (size_t i = 0; i < q.size(); ++i) q[i] = to_t<T>(value(seed ^ 0x51, i));
    std::vector<int32_t> pages(num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::mt19937_64 rng(seed ^ static_cast<uint64_t>(me));
    std::shuffle(pages.begin(), pages.end(), rng);
    // Unused entries point far outside the cache: reading one would be reported.
    std::fill(table.begin(), table.end(), 0x7ffffff0);
    const double scale = g.scale_mul / std::sqrt(static_cast<double>(d));
    ref_out.assign(q.size(), 0.0);
    ref_lse.assign(g.batch * H, -INFINITY);
    std::vector<double> kt, vt;
    for (int64_t b = 0; b < g.batch; ++b) {
      const int64_t L = lens[b];
      kt.assign(L * KH * d, 0.0);
      vt.assign(L * KH * d, 0.0);
      for (int64_t t = 0; t < L; ++t) {
        const bool mine = owner(seed, b, t, n) == me;
        const int64_t local_t = lens_local[b];
        if (mine) ++lens_local[b];
        int64_t row = 0;
        if (mine) {
          if (g.page_size > 0) {
            const int64_t slot = local_t / g.page_size;
            if (local_t % g.page_size == 0) table[b * max_pages + slot] = pages[b * max_pages + slot];
            row = static_cast<int64_t>(table[b * max_pages + slot]) * g.page_size + local_t % g.page_size;
          } else {
            row = b * g.capacity + local_t;
          }
        }
        for (int64_t kh = 0; kh < KH; ++kh) {
          for (int64_t j = 0; j < d; ++j) {
            const uint64_t idx = ((static_cast<uint64_t>(b) * g.capacity + t) * KH + kh) * d + j;
            const T kv = to_t<T>(value(seed ^ 0xA1, idx)), vv = to_t<T>(value(seed ^ 0xB2, idx));
            kt[(t * KH + kh) * d + j] = to_d(kv);
            vt[(t * KH + kh) * d + j] = to_d(vv);
            if (mine) {
              k[(row * KH + kh) * d + j] = kv;
              v[(row * KH + kh) * d + j] = vv;
            }
          }
        }
      }
      std::vector<double> s(L);
      for (int64_t h = 0; h < H; ++h) {
        if (L == 0) continue;  // out 0, lse -inf
        const int64_t kh = h / group;
        double m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) {
          double dot = 0;
          for (int64_t j = 0; j < d; ++j) dot += to_d(q[(b * H + h) * d + j]) * kt[(t * KH + kh) * d + j];
          dot *= scale;
          if (g.softcap > 0) dot = g.softcap * std::tanh(dot / g.softcap);
          s[t] = dot;
          m = std::max(m, dot);
        }
        double sum = 0;
        std::vector<double> o(d, 0.0);
        for (int64_t t = 0; t < L; ++t) {
          const double p = std::exp(s[t] - m);
          sum += p;
          for (int64_t j = 0; j < d; ++j) o[j] += p * vt[(t * KH + kh) * d + j];
        }
        for (int64_t j = 0; j < d; ++j) ref_out[(b * H + h) * d + j] = o[j] / sum;
        ref_lse[b * H + h] = m + std::log(sum);
      }
    }
    upload();
  }

  // Elements of one page (contiguous: one sequence) of K or V.
  int64_t page_elems() const { return (g.page_size > 0 ? g.page_size : g.capacity) * g.kv_heads * g.head_dim; }

  void upload() {
    test::copy_to_device(d_q.get(), q.data(), q.size() * sizeof(T));
    if (g.combined) {  // page p of K, then page p of V
      const size_t pe = static_cast<size_t>(page_elems());
      std::vector<T> kv(2 * k.size());
      for (size_t p = 0; p < k.size() / pe; ++p) {
        std::copy_n(k.begin() + p * pe, pe, kv.begin() + 2 * p * pe);
        std::copy_n(v.begin() + p * pe, pe, kv.begin() + (2 * p + 1) * pe);
      }
      test::copy_to_device(d_k.get(), kv.data(), kv.size() * sizeof(T));
    } else {
      test::copy_to_device(d_k.get(), k.data(), k.size() * sizeof(T));
      test::copy_to_device(d_v.get(), v.data(), v.size() * sizeof(T));
    }
    test::copy_to_device(d_table.get(), table.data(), table.size() * sizeof(int32_t));
    test::copy_to_device(d_lens.get(), lens_local.data(), g.batch * sizeof(int32_t));
  }

  void poison() {
    tdist::test::fill_device(d_out.get(), 0xFF, q.size() * sizeof(T));  // NaN in bf16 and fp16
    tdist::test::fill_device(d_lse.get(), 0xFF, g.batch * g.q_heads * sizeof(float));
  }

  FlashDecodeArgs args(DType dtype) const {
    FlashDecodeArgs a;
    a.dtype = dtype;
    a.batch = g.batch;
    a.q_heads = g.q_heads;
    a.kv_heads = g.kv_heads;
    a.head_dim = g.head_dim;
    a.q = d_q.get();
    a.k_cache = d_k.get();
    a.v_cache = g.combined ? static_cast<const void*>(d_k.get<T>() + page_elems()) : d_v.get();
    a.page_stride = g.combined ? 2 * page_elems() : 0;
    a.num_pages = num_pages;
    a.page_size = g.page_size > 0 ? g.page_size : g.capacity;
    a.block_table = g.page_size > 0 ? d_table.get<int32_t>() : nullptr;
    a.max_pages = g.page_size > 0 ? max_pages : 0;
    a.seq_lens = d_lens.get<int32_t>();
    a.out = d_out.get();
    a.lse = d_lse.get<float>();
    a.softmax_scale = static_cast<float>(g.scale_mul / std::sqrt(static_cast<double>(g.head_dim)));
    a.softcap = g.softcap;
    return a;
  }

  // Checks out and lse; returns a digest of out's bits (for the cross-rank comparison).
  uint64_t check(DType dtype) const {
    const int64_t d = g.head_dim;
    std::vector<T> out(q.size());
    std::vector<float> lse(g.batch * g.q_heads);
    TDIST_CUDA_CHECK(cudaMemcpy(out.data(), d_out.get(), out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    TDIST_CUDA_CHECK(cudaMemcpy(lse.data(), d_lse.get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    // out is a convex combination of values in [-1, 1]: the output's rounding plus fp32 sums.
    const double tol = dtype == DType::kBFloat16 ? 1e-2 : 2e-3;
    for (size_t i = 0; i < out.size(); ++i) {
      const double err = std::fabs(to_d(out[i]) - ref_out[i]);
      if (!(err <= tol))
        TDIST_FAIL("out: sequence ", i / (g.q_heads * d), " (length ", lens_global[i / (g.q_heads * d)], ") head ",
                   (i / d) % g.q_heads, " dim ", i % d, ": got ", to_d(out[i]), ", want ", ref_out[i]);
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      const double want = ref_lse[i], got = lse[i];
      const bool ok =
          std::isinf(want) ? (std::isinf(got) && got < 0) : std::fabs(got - want) <= 1e-3 + 1e-5 * std::fabs(want);
      if (!ok)
        TDIST_FAIL("lse: sequence ", i / g.q_heads, " (length ", lens_global[i / g.q_heads], ") head ", i % g.q_heads,
                   ": got ", got, ", want ", want);
    }
    uint64_t h = 0;
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(out.data());
    for (size_t i = 0; i < out.size() * sizeof(T); ++i) h = mix(h ^ bytes[i] ^ (i << 8));
    return h;
  }
};

// Mixed lengths up to the capacity: empty, 1, one short of / one past a page, random, the capacity.
std::vector<int32_t> mixed_lengths(uint64_t seed, const Geometry& g) {
  std::mt19937_64 rng(seed);
  const int64_t page = g.page_size > 0 ? g.page_size : 64;
  const int64_t picks[] = {g.capacity,
                           1,
                           0,
                           std::min(g.capacity, page + 1),
                           std::max<int64_t>(1, std::min(g.capacity, 3 * page - 1)),
                           static_cast<int64_t>(rng() % (g.capacity + 1))};
  std::vector<int32_t> lens(g.batch);
  for (int64_t b = 0; b < g.batch; ++b)
    lens[b] = static_cast<int32_t>(b < 6 ? picks[b] : static_cast<int64_t>(rng() % (g.capacity + 1)));
  return lens;
}

// Runs a check on every rank without leaving the collective sequence: a failure is kept and thrown
// after every rank has said how it went, so no rank waits in a collective the failing one skipped.
class CollectiveCheck {
 public:
  explicit CollectiveCheck(World& world) : world_(world) {}
  template <typename Fn>
  void run(Fn&& fn) {
    if (!failure_.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      failure_ = e.what();
    }
  }
  void finish(const char* tag) {
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
    const auto all = test::all_gather_u64(world_, tag, failure_.empty() ? 0 : 1);
    if (!failure_.empty()) TDIST_FAIL(failure_);
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r]) TDIST_FAIL("rank ", r, " failed this case");
  }

 private:
  World& world_;
  std::string failure_;
};

// A CUDA graph of what capture() launches on `stream`, instantiated; destroyed with the object.
class CapturedGraph {
 public:
  template <typename Fn>
  CapturedGraph(cudaStream_t stream, Fn&& capture) {
    TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    capture();
    TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch(cudaStream_t stream) const { TDIST_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// A decode step's length update, written late: it lets the kernel after it (the split kernel, which
// is launched with programmatic dependent launch) start at once, waits `delay_ns`, then copies the
// lengths of step *step from steps[step][batch] and advances *step. The split kernel's first wave
// thus reads the previous step's lengths before its grid wait (they steer only its L2 prefetch) and
// must use the new ones after it. One CTA.
__global__ void write_lengths_late(const int32_t* steps, int32_t* lens, unsigned long long* step, int batch,
                                   unsigned long long delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < delay_ns);
  const unsigned long long s = *step;
  for (int b = threadIdx.x; b < batch; b += blockDim.x) lens[b] = steps[s * batch + b];
  __syncthreads();
  if (threadIdx.x == 0) *step = s + 1;
}

// Counts the elements of a and b (n of 2 bytes) and of la and lb (m of 4 bytes) whose bits differ.
__global__ void count_bit_differences(const uint16_t* a, const uint16_t* b, size_t n, const uint32_t* la,
                                      const uint32_t* lb, size_t m, unsigned long long* wrong) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n + m; i += gridDim.x * blockDim.x) {
    const bool differ = i < n ? a[i] != b[i] : la[i - n] != lb[i - n];
    if (differ) atomicAdd(wrong, 1ull);
  }
}

// A decode loop captured once and replayed `steps` times with new lengths every step, written on the
// device by write_lengths_late (distributed: each rank's part of every sequence; else whole ones). Every replay's out
// and lse must equal, bit for bit, an eager call's on the same lengths right after it; every 100th replay and the last
// are also checked against float64, with the cache past each length poisoned.
template <typename T, typename Op>
void check_graph_replays(World& world, Op& op, bool distributed, const Geometry& g, DType dtype, uint64_t seed,
                         int steps, cudaStream_t stream) {
  const int n = distributed ? world.world_size() : 1, me = distributed ? world.rank() : 0;  // the cache's owners
  Case<T> c(g);
  const std::vector<int32_t> full(g.batch, static_cast<int32_t>(g.capacity));
  std::vector<std::vector<int32_t>> global(steps, std::vector<int32_t>(g.batch));
  std::vector<int32_t> local(static_cast<size_t>(steps) * g.batch);
  std::mt19937_64 rng(seed ^ 0x5eedull);  // the same on every rank
  for (int s = 0; s < steps; ++s) {
    for (int64_t b = 0; b < g.batch; ++b) {
      const int64_t len = (s + b) % 7 == 0 ? g.capacity : (s + b) % 11 == 0 ? 0 : rng() % (g.capacity + 1);
      global[s][b] = static_cast<int32_t>(len);
      int32_t mine = 0;
      for (int64_t t = 0; t < len; ++t) mine += owner(seed, b, t, n) == me;
      local[static_cast<size_t>(s) * g.batch + b] = mine;
    }
  }
  DeviceBuffer d_steps(local.size() * sizeof(int32_t)), d_step(sizeof(unsigned long long));
  test::copy_to_device(d_steps.get(), local.data(), local.size() * sizeof(int32_t));
  test::fill_device(d_step.get(), 0, sizeof(unsigned long long));
  DeviceBuffer out2(c.q.size() * sizeof(T)), lse2(g.batch * g.q_heads * sizeof(float));
  c.fill(seed, full, n, me);
  const FlashDecodeArgs a = c.args(dtype);  // max_seq_len 0: the capacity fixes the plan
  FlashDecodeArgs eager = a;
  eager.out = out2.get();
  eager.lse = lse2.get<float>();
  op.run(a, stream);  // sizes the workspace before the capture
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  test::sync_all(world, "flash_decode replays warm-up");

  const CapturedGraph graph(stream, [&] {
    write_lengths_late<<<1, 32, 0, stream>>>(d_steps.get<int32_t>(), c.d_lens.template get<int32_t>(),
                                             d_step.get<unsigned long long>(), static_cast<int>(g.batch), 20000);
    op.run(a, stream);
  });

  // Differences counted per step on the device: the host enqueues the steps between references
  // without waiting for them, as a serving loop does. Every differing step is reported at the end.
  DeviceBuffer wrong = DeviceBuffer::zeroed(static_cast<size_t>(steps) * sizeof(unsigned long long));
  CollectiveCheck checks(world);
  for (int s = 0; s < steps; ++s) {
    const bool reference = s % 100 == 0 || s == steps - 1;
    if (reference) {  // the cache past this step's lengths poisoned, the reference for them
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));  // the steps before still read the inputs
      c.fill(seed, global[s], n, me);
      c.poison();
      test::sync_all(world, "flash_decode replay reference");  // no peer still reads the old inputs
    }
    graph.launch(stream);
    op.run(eager, stream);
    count_bit_differences<<<64, 256, 0, stream>>>(c.d_out.template get<uint16_t>(), out2.get<uint16_t>(), c.q.size(),
                                                  c.d_lse.template get<uint32_t>(), lse2.get<uint32_t>(),
                                                  g.batch * g.q_heads, wrong.get<unsigned long long>() + s);
    TDIST_CUDA_CHECK(cudaGetLastError());
    if (reference) {
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
      checks.run([&] { c.check(dtype); });
      if (s != steps - 1) {
        c.fill(seed, full, n, me);  // every token valid again for the steps between references
        test::sync_all(world, "flash_decode replay restore");
      }
    }
  }
  std::vector<unsigned long long> per_step(steps);
  TDIST_CUDA_CHECK(
      cudaMemcpy(per_step.data(), wrong.get(), per_step.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::string bad;
  int bad_steps = 0;
  for (int s = 0; s < steps; ++s) {
    if (per_step[s] == 0) continue;
    if (++bad_steps <= 12) bad += detail::concat(bad.empty() ? "" : ", ", s, " (", per_step[s], ")");
  }
  checks.run([&] {
    if (bad_steps > 0)
      TDIST_FAIL("out and lse differ between the replay and the eager call at ", bad_steps, " of ", steps,
                 " steps; the first (elements): ", bad);
  });
  checks.run([&] { op.check_errors(); });
  checks.finish("flash_decode replays end");
}

}  // namespace

int main() {
  World world;
  test::Suite suite(world);
  SymmetricHeap heap(world, size_t{512} << 20);
  const int n = world.world_size(), me = world.rank();
  const uint64_t seed = test::all_gather_u64(world, "seed", test::fresh_seed(0))[0];
  if (me == 0) std::printf("flash_decode test: %d ranks, seed %llx\n", n, static_cast<unsigned long long>(seed));
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  FlashDecode single;
  uint64_t case_seed = seed;

  const Geometry shapes[] = {
      {7, 8, 8, 64, 16, 700, 1.0f, 0.f},           // MHA, d 64
      {6, 32, 8, 128, 16, 1100, 2.0f, 0.f},        // Llama-3-8B heads
      {6, 16, 2, 256, 64, 900, 1.5f, 0.f},         // GQA 8, d 256
      {6, 12, 2, 128, 1, 300, 1.0f, 0.f},          // GQA 6 (one CTA's 6 MMA rows), page 1
      {6, 16, 1, 64, 256, 1300, 3.0f, 0.f},        // GQA 16 (all 16 MMA rows), page 256
      {5, 32, 1, 128, 16, 650, 1.0f, 0.f},         // GQA 32 (two chunks of 16)
      {5, 34, 2, 64, 32, 400, 1.0f, 0.f},          // GQA 17 (prime: 17 chunks of 1)
      {4, 32, 2, 256, 32, 700, 2.0f, 20.f},        // GQA 16, d 256, softcap
      {6, 8, 4, 128, 0, 777, 1.0f, 0.f},           // contiguous
      {6, 8, 1, 256, 0, 500, 2.0f, 0.f},           // contiguous, GQA 8, d 256
      {6, 16, 4, 128, 16, 600, 8.0f, 30.f},        // softcap (large logits, capped)
      {6, 32, 8, 128, 16, 1100, 1.0f, 0.f, true},  // FlashInfer's combined K/V pages
      {5, 16, 2, 64, 1, 300, 1.0f, 0.f, true},     // combined, page 1
      {6, 8, 4, 128, 0, 777, 1.0f, 0.f, true},     // contiguous, K and V of a sequence side by side
  };

  // Single GPU: every rank runs these alone.
  for (int which = 0; which < 2; ++which) {
    for (const Geometry& g : shapes) {
      const DType dtype = which == 0 ? DType::kBFloat16 : DType::kFloat16;
      suite.run("flash_decode " + describe(g, dtype), [&] {
        auto body = [&](auto tag) {
          using T = decltype(tag);
          Case<T> c(g);
          const uint64_t s = ++case_seed;
          c.fill(s, mixed_lengths(s, g), 1, 0);
          c.poison();
          single.run(c.args(dtype), stream);
          TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
          single.check_errors();
          c.check(dtype);
        };
        if (dtype == DType::kBFloat16)
          body(__nv_bfloat16{});
        else
          body(__half{});
      });
    }
  }

  suite.run("flash_decode bf16 long sequence in many splits (32/8 heads, 40000 tokens, page 16)", [&] {
    const Geometry g{1, 32, 8, 128, 16, 40000, 1.0f, 0.f};
    Case<__nv_bfloat16> c(g);
    c.fill(++case_seed, {39999}, 1, 0);
    c.poison();
    single.run(c.args(DType::kBFloat16), stream);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    single.check_errors();
    c.check(DType::kBFloat16);
  });

  suite.run("flash_decode fp16 CUDA graph, 6 replays with new lengths and contents", [&] {
    const Geometry g{5, 16, 4, 128, 16, 900, 1.0f, 0.f};
    Case<__half> c(g);
    const uint64_t s0 = ++case_seed;
    c.fill(s0, mixed_lengths(s0, g), 1, 0);
    const FlashDecodeArgs a = c.args(DType::kFloat16);  // max_seq_len 0: the capacity fixes the splits
    single.run(a, stream);                              // sizes the workspace before the capture
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    const CapturedGraph graph(stream, [&] { single.run(a, stream); });
    for (int replay = 0; replay < 6; ++replay) {
      const uint64_t s = ++case_seed;
      std::mt19937_64 rng(s);
      std::vector<int32_t> lens(g.batch);
      for (auto& l : lens) l = static_cast<int32_t>(rng() % (g.capacity + 1));
      if (replay == 0) lens[0] = 0;
      if (replay == 1) lens[1] = static_cast<int32_t>(g.capacity);
      c.fill(s, lens, 1, 0);
      c.poison();
      graph.launch(stream);
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
      c.check(DType::kFloat16);
    }
    single.check_errors();
  });

  suite.run("flash_decode argument errors name the argument", [&] {
    const Geometry g{2, 8, 2, 64, 16, 100, 1.0f, 0.f};
    Case<__nv_bfloat16> c(g);
    c.fill(++case_seed, {50, 100}, 1, 0);
    FlashDecodeArgs a = c.args(DType::kBFloat16);
    expect_error("dtype", [&] {
      FlashDecodeArgs b = a;
      b.dtype = DType::kFloat32;
      single.run(b, stream);
    });
    expect_error("q_heads", [&] {
      FlashDecodeArgs b = a;
      b.kv_heads = 3;
      single.run(b, stream);
    });
    expect_error("head_dim", [&] {
      FlashDecodeArgs b = a;
      b.head_dim = 80;
      single.run(b, stream);
    });
    expect_error("max_seq_len", [&] {
      FlashDecodeArgs b = a;
      b.max_seq_len = 113;  // capacity 7 pages x 16
      single.run(b, stream);
    });
    // On the device: an entry outside the cache, then a length beyond the capacity.
    std::vector<int32_t> bad = c.table;
    bad[1] = static_cast<int32_t>(c.num_pages);
    test::copy_to_device(c.d_table.get(), bad.data(), bad.size() * sizeof(int32_t));
    single.run(a, stream);
    expect_error("block_table", [&] { single.check_errors(); });
    single.check_errors();  // cleared
    c.upload();
    const int32_t too_long[2] = {50, 113};
    test::copy_to_device(c.d_lens.get(), too_long, sizeof(too_long));
    single.run(a, stream);
    expect_error("seq_lens", [&] { single.check_errors(); });
    c.upload();
    c.poison();
    single.run(a, stream);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    single.check_errors();
    c.check(DType::kBFloat16);  // the op works again on good input
  });

  // Sequence parallel: one context per (q_heads, head_dim), created and destroyed in the same order
  // on every rank.
  for (int which = 0; which < 2; ++which) {
    for (const Geometry& g : shapes) {
      const DType dtype = which == 0 ? DType::kBFloat16 : DType::kFloat16;
      suite.run(detail::concat("distributed flash_decode over ", n, " ranks, ", describe(g, dtype)), [&] {
        DistributedFlashDecode dist(world, heap,
                                    {.max_batch = g.batch + 2, .q_heads = g.q_heads, .head_dim = g.head_dim});
        auto body = [&](auto tag) {
          using T = decltype(tag);
          Case<T> c(g);
          CollectiveCheck checks(world);
          // Three steps on the same context: both LL parities, and one reused.
          for (int step = 0; step < 3; ++step) {
            const uint64_t s = ++case_seed;
            c.fill(s, mixed_lengths(s, g), n, me);
            c.poison();
            dist.run(c.args(dtype), stream);
            TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
            uint64_t digest = 0;
            checks.run([&] {
              dist.check_errors();
              digest = c.check(dtype);
            });
            const auto all = test::all_gather_u64(world, "flash_decode digest", digest);
            checks.run([&] {
              for (int r = 0; r < n; ++r)
                if (all[r] != digest)
                  TDIST_FAIL("out differs between rank ", me, " and rank ", r, " (step ", step, ")");
            });
          }
          checks.finish("flash_decode distributed case");
        };
        if (dtype == DType::kBFloat16)
          body(__nv_bfloat16{});
        else
          body(__half{});
      });
    }
  }

  suite.run(
      detail::concat("distributed flash_decode bf16 over ", n, " ranks, long sequences (64/8 heads, 24000 tokens)"),
      [&] {
        const Geometry g{2, 64, 8, 128, 64, 24000, 1.0f, 0.f};
        DistributedFlashDecode dist(world, heap, {.max_batch = 2, .q_heads = 64, .head_dim = 128});
        Case<__nv_bfloat16> c(g);
        c.fill(++case_seed, {24000, 17001}, n, me);
        c.poison();
        dist.run(c.args(DType::kBFloat16), stream);
        TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
        CollectiveCheck checks(world);
        checks.run([&] {
          dist.check_errors();
          c.check(DType::kBFloat16);
        });
        checks.finish("flash_decode distributed long");
      });

  suite.run(detail::concat("distributed flash_decode bf16 over ", n, " ranks, CUDA graph, 8 replays with new lengths"),
            [&] {
              const Geometry g{4, 32, 8, 128, 16, 1000, 1.0f, 0.f};
              DistributedFlashDecode dist(world, heap, {.max_batch = 4, .q_heads = 32, .head_dim = 128});
              Case<__nv_bfloat16> c(g);
              const uint64_t s0 = ++case_seed;
              c.fill(s0, mixed_lengths(s0, g), n, me);
              const FlashDecodeArgs a = c.args(DType::kBFloat16);
              dist.run(a, stream);  // sizes the workspace before the capture
              TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
              test::sync_all(world, "flash_decode graph warm-up");
              const CapturedGraph graph(stream, [&] { dist.run(a, stream); });
              CollectiveCheck checks(world);
              for (int replay = 0; replay < 8; ++replay) {
                const uint64_t s = ++case_seed;  // the same on every rank
                std::mt19937_64 rng(s);
                std::vector<int32_t> lens(g.batch);
                for (auto& l : lens) l = static_cast<int32_t>(rng() % (g.capacity + 1));
                c.fill(s, lens, n, me);
                c.poison();
                test::sync_all(world, "flash_decode graph replay");  // no rank's kernel reads a peer's old inputs
                graph.launch(stream);
                TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
                checks.run([&] { c.check(DType::kBFloat16); });
              }
              checks.run([&] { dist.check_errors(); });
              checks.finish("flash_decode graph end");
            });

  // 1000 steps of a captured decode loop, lengths changing on the device between steps.
  {
    const Geometry g{3, 32, 8, 128, 16, 2000, 1.0f, 0.f};  // 16-32 splits: the combine by CTA
    suite.run("flash_decode bf16 CUDA graph, 1000 replays with lengths written late on the device", [&] {
      check_graph_replays<__nv_bfloat16>(world, single, /*distributed=*/false, g, DType::kBFloat16, ++case_seed, 1000,
                                         stream);
    });
    suite.run(detail::concat("distributed flash_decode bf16 over ", n,
                             " ranks, CUDA graph, 1000 replays with lengths written late on the device"),
              [&] {
                DistributedFlashDecode dist(world, heap, {.max_batch = 3, .q_heads = 32, .head_dim = 128});
                check_graph_replays<__nv_bfloat16>(world, dist, /*distributed=*/true, g, DType::kBFloat16, ++case_seed,
                                                   1000, stream);
              });
  }

  suite.run(detail::concat("distributed flash_decode fp16 over ", n, " ranks on a caller's symmetric buffer"), [&] {
    const Geometry g{5, 16, 2, 64, 64, 900, 1.0f, 0.f};
    const DistributedFlashDecodeConfig config{.max_batch = 5, .q_heads = 16, .head_dim = 64};
    const size_t bytes = DistributedFlashDecode::heap_bytes(config, n);
    void* buffer = heap.allocate(bytes);           // collective, zeroed
    device::SymmetricHeapView view = heap.view();  // the buffer as a heap of its own
    view.size = bytes;
    for (int r = 0; r < n; ++r) view.lsa_bases[r] = static_cast<char*>(heap.peer_ptr(buffer, r));
    CollectiveCheck checks(world);
    {
      DistributedFlashDecode dist(view, buffer, config);
      Case<__half> c(g);
      for (int step = 0; step < 3; ++step) {
        const uint64_t s = ++case_seed;
        c.fill(s, mixed_lengths(s, g), n, me);
        c.poison();
        dist.run(c.args(DType::kFloat16), stream);
        TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
        checks.run([&] {
          dist.check_errors();
          c.check(DType::kFloat16);
        });
      }
      checks.run([&] {
        device::SymmetricHeapView bad = view;
        bad.lsa_size = n + 1;
        expect_error("world", [&] { DistributedFlashDecode d(bad, buffer, config); });
        expect_error("buffer", [&] { DistributedFlashDecode d(view, static_cast<char*>(buffer) + 256, config); });
      });
    }
    heap.free(buffer);  // collective
    checks.finish("flash_decode caller buffer");
  });

  suite.run("distributed flash_decode errors name the argument", [&] {
    expect_error("config.head_dim",
                 [&] { DistributedFlashDecode bad(world, heap, {.max_batch = 1, .q_heads = 8, .head_dim = 96}); });
    DistributedFlashDecode dist(world, heap, {.max_batch = 2, .q_heads = 8, .head_dim = 64});
    const Geometry g{3, 8, 2, 64, 16, 100, 1.0f, 0.f};
    Case<__nv_bfloat16> c(g);
    c.fill(++case_seed, {1, 2, 3}, n, me);
    expect_error("batch", [&] { dist.run(c.args(DType::kBFloat16), stream); });  // 3 > max_batch 2
    FlashDecodeArgs a = c.args(DType::kBFloat16);
    a.batch = 2;
    a.q_heads = 16;
    expect_error("q_heads", [&] { dist.run(a, stream); });
    test::sync_all(world, "flash_decode distributed errors");
  });

  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  return suite.finish();
}
