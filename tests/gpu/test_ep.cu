// tdist::EpBuffer's low-latency dispatch and combine across ranks, against a float64 host reference.
// Every rank draws its tokens, top-k ids and weights from (seed, rank) and can redraw every other
// rank's, so it knows exactly which rows each of its local experts must receive and what each of
// its tokens must get back.
//
//   * dispatch bf16, FP8 and FP8 with UE8M0 scales: per-expert counts exact, every expected
//     (source rank, token, slot) row present once (order-independent: rows are matched by their
//     route), bf16 rows bit for bit, FP8 rows within e4m3's bound (|err| <= |x| / 16 + scale / 512),
//     UE8M0 scales powers of two; outputs poisoned before each dispatch (the send stores this
//     rank's own rows in place, so not between send and hook);
//   * combine: the expert side answers each row with bf16(x * f(expert)) (rows past the counts are
//     NaN, so reading one shows), out[t] within bf16 rounding of sum_j w[t][j] * y(t, j);
//   * routings: uniform, skewed, all to one expert, all to one rank, masked slots (-1); tokens:
//     full, zero on the last rank, one token, odd counts; the DeepSeek-V3 shape (hidden 7168,
//     256 experts, top-8, 128 tokens) and odd ones (hidden 384 and 200, 5 and 3 of 6W and 3W experts);
//   * the receive hooks, two dispatches in flight, many calls back to back, a CUDA graph replayed
//     with fresh routing and tokens each time;
//   * errors: host checks naming the argument; out-of-range and repeated expert ids skipped by both
//     sides and reported by check_errors();
//   * high-throughput mode: counts against the host mirror of the layout step (ep_count_tokens),
//     compact rows (each token once per rank, in its source's block, routing and weights), the
//     padded expert-major rows and their sources, the weighted combine and the compact (backward)
//     combine, sync_counts on and off, graph replays, calls back to back, SM count set low and
//     above the GPU's.
//
//   build-gpu/tools/tdistrun -n 2 -- build-gpu/tests/gpu_test_ep
// Prints "rank R: N passed, M failed" last.
#include <cuda_bf16.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "tdist/common/device_buffer.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/ep.hpp"

using namespace tdist;

namespace {

using bf16 = __nv_bfloat16;

enum class Routing { kUniform, kSkewed, kOneExpert, kOneRank, kMasked };
enum class Tokens { kFull, kZeroOnLast, kOne, kOdd };

const char* name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kOneExpert: return "one-expert";
    case Routing::kOneRank: return "one-rank";
    default: return "masked";
  }
}
const char* name(Tokens t) {
  switch (t) {
    case Tokens::kFull: return "full";
    case Tokens::kZeroOnLast: return "zero-on-last";
    case Tokens::kOne: return "one";
    default: return "odd";
  }
}

using test::expect_error;

// One rank's operands, redrawable by every rank from (seed, rank).
struct RankInput {
  int64_t tokens = 0;
  std::vector<bf16> x;         // [tokens][H]
  std::vector<int64_t> idx;    // [tokens][K]
  std::vector<float> weights;  // [tokens][K]
};

RankInput make_input(const EpConfig& c, int W, uint64_t seed, int rank, Routing routing, Tokens tokens,
                     bool inject_errors = false) {
  std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(rank + 1) * 0xD1B54A32D192ED03ull));
  RankInput in;
  const int64_t M = c.max_tokens, H = c.hidden;
  const int K = c.topk, E = c.num_experts, L = E / W;
  switch (tokens) {
    case Tokens::kFull: in.tokens = M; break;
    case Tokens::kZeroOnLast: in.tokens = rank == W - 1 ? 0 : M; break;
    case Tokens::kOne: in.tokens = 1; break;
    default: in.tokens = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(M)); break;
  }
  in.x.resize(static_cast<size_t>(in.tokens * H));
  for (int64_t t = 0; t < in.tokens; ++t) {
    // Multiples of 1/64 in [-1, 1] times a per-token power of two: exact in bf16, varied FP8 scales.
    const float mag = std::ldexp(1.0f, static_cast<int>(t % 7) - 3);
    for (int64_t h = 0; h < H; ++h)
      in.x[static_cast<size_t>(t * H + h)] =
          __float2bfloat16_rn(mag * static_cast<float>(static_cast<int>(rng() % 129) - 64) / 64.0f);
  }
  in.idx.assign(static_cast<size_t>(in.tokens * K), -1);
  in.weights.resize(static_cast<size_t>(in.tokens * K));
  for (auto& w : in.weights) w = static_cast<float>(rng() % 1000) / 1000.0f;
  for (int64_t t = 0; t < in.tokens; ++t) {
    int64_t* row = in.idx.data() + t * K;
    std::set<int64_t> used;
    auto draw_distinct = [&](auto draw) {
      for (int j = 0; j < K; ++j) {
        int64_t g;
        do g = draw();
        while (used.count(g));
        used.insert(g);
        row[j] = g;
      }
    };
    switch (routing) {
      case Routing::kUniform:
      case Routing::kMasked:
        draw_distinct([&] { return static_cast<int64_t>(rng() % static_cast<uint64_t>(E)); });
        if (routing == Routing::kMasked)
          for (int j = 0; j < K; ++j)
            if (rng() % 10 < 3) row[j] = -1;
        break;
      case Routing::kSkewed:  // most picks among the lowest experts (rank 0's)
        draw_distinct([&] {
          const double u = static_cast<double>(rng() % 1000000) / 1e6;
          return std::min<int64_t>(E - 1, static_cast<int64_t>(E * u * u * u));
        });
        break;
      case Routing::kOneExpert: row[0] = E - 1; break;  // every other slot masked
      case Routing::kOneRank:
        draw_distinct([&] { return static_cast<int64_t>(rng() % static_cast<uint64_t>(L)); });
        break;
    }
  }
  if (inject_errors && in.tokens >= 2 && K >= 2) {
    in.idx[1] = E + 5;                  // token 0, slot 1: out of range
    in.idx[static_cast<size_t>(K)] = -7;  // token 1, slot 0: out of range
    in.idx[static_cast<size_t>(K + 1)] = in.idx[static_cast<size_t>(K + 1)] < 0 ? 0 : in.idx[static_cast<size_t>(K + 1)];
    if (K >= 3) in.idx[static_cast<size_t>(K + 2)] = in.idx[static_cast<size_t>(K + 1)];  // token 1: a repeat
  }
  return in;
}

// The expert of slot j of a token if it is sent: in [0, E) and not the expert of an earlier slot.
int sent_expert(const int64_t* row, int K, int j, int E) {
  auto valid = [&](int64_t g) { return g >= 0 && g < E; };
  if (!valid(row[j])) return -1;
  for (int k = 0; k < j; ++k)
    if (valid(row[k]) && row[k] == row[j]) return -1;
  return static_cast<int>(row[j]);
}

float expert_factor(int g) { return 1.0f + static_cast<float>(g % 4) / 4.0f; }

// Host value of an e4m3 byte.
double e4m3(unsigned char b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  if (exp == 15 && man == 7) return NAN;
  const double v = exp == 0 ? man * std::ldexp(1.0, -9) : (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -v : v;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer d(v.size() * sizeof(T));
  if (!v.empty()) test::copy_to_device(d.get(), v.data(), v.size() * sizeof(T));
  return d;
}

template <typename T>
std::vector<T> download(const void* p, size_t count) {
  std::vector<T> v(count);
  if (count) TDIST_CUDA_CHECK(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

struct Fixture {
  World& world;
  EpBuffer& ep;
  cudaStream_t stream;
  int W, me, L, K, E;
  int64_t M, H;
  // The last handle of each output slot, so that a dispatch's outputs can be poisoned before it (the
  // send already stores this rank's own rows there).
  mutable std::array<EpLlHandle, EpBuffer::kSlots> seen{};
  Fixture(World& w, EpBuffer& b, cudaStream_t s)
      : world(w), ep(b), stream(s), W(w.world_size()), me(w.rank()), L(b.num_local_experts()), K(b.config().topk),
        E(b.config().num_experts), M(b.config().max_tokens), H(b.config().hidden) {}

  void poison(const EpLlHandle& h) const {
    if (h.recv_count == nullptr) return;
    const size_t rows = static_cast<size_t>(L * W * M);
    TDIST_CUDA_CHECK(cudaMemsetAsync(h.recv_x, 0xFF, rows * 2 * static_cast<size_t>(H), stream));
    TDIST_CUDA_CHECK(cudaMemsetAsync(h.recv_count, 0xFF, static_cast<size_t>(L) * sizeof(int), stream));
    TDIST_CUDA_CHECK(cudaMemsetAsync(h.recv_route, 0xFF, rows * sizeof(int), stream));
  }

  std::vector<RankInput> inputs(uint64_t seed, Routing r, Tokens t, bool errors = false) const {
    std::vector<RankInput> all;
    for (int s = 0; s < W; ++s) all.push_back(make_input(ep.config(), W, seed, s, r, t, errors));
    return all;
  }

  // Checks the dispatch outputs of `h` against every rank's inputs; returns recv_count.
  std::vector<int> check_dispatch(const EpLlHandle& h, const std::vector<RankInput>& all, bool fp8, bool ue8m0) const {
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<int> counts = download<int>(h.recv_count, static_cast<size_t>(L));
    const int64_t rows_per_expert = W * M, G = (H + 127) / 128;
    for (int le = 0; le < L; ++le) {
      const int g = me * L + le;
      std::set<int64_t> expected;  // routes
      for (int s = 0; s < W; ++s)
        for (int64_t t = 0; t < all[s].tokens; ++t)
          for (int j = 0; j < K; ++j)
            if (sent_expert(all[s].idx.data() + t * K, K, j, E) == g) expected.insert((s * M + t) * K + j);
      if (counts[le] != static_cast<int>(expected.size()))
        TDIST_FAIL("expert ", g, ": ", counts[le], " rows received, expected ", expected.size());
      const size_t n = static_cast<size_t>(counts[le]);
      const int64_t base = le * rows_per_expert;
      const std::vector<int> routes = download<int>(h.recv_route + base, n);
      const size_t row_bytes = fp8 ? static_cast<size_t>(H) : 2 * static_cast<size_t>(H);
      const std::vector<unsigned char> rows =
          download<unsigned char>(static_cast<const char*>(h.recv_x) + base * row_bytes, n * row_bytes);
      std::vector<float> scales;
      if (fp8) scales = download<float>(h.recv_scales + base * G, n * static_cast<size_t>(G));
      std::set<int64_t> seen;
      for (size_t i = 0; i < n; ++i) {
        const int64_t route = routes[i];
        if (!expected.count(route) || !seen.insert(route).second)
          TDIST_FAIL("expert ", g, " row ", i, ": unexpected or repeated route ", route);
        const int s = static_cast<int>(route / (M * K));
        const int64_t t = route % (M * K) / K;
        const bf16* x = all[s].x.data() + t * H;
        if (!fp8) {
          if (std::memcmp(rows.data() + i * row_bytes, x, row_bytes) != 0)
            TDIST_FAIL("expert ", g, " row ", i, " (rank ", s, " token ", t, "): bf16 row differs");
          continue;
        }
        for (int64_t q = 0; q < G; ++q) {
          const float sc = scales[i * G + q];
          if (!(sc > 0.f) || !std::isfinite(sc)) TDIST_FAIL("expert ", g, " row ", i, ": bad scale ", sc);
          int e2;
          if (ue8m0 && std::frexp(sc, &e2) != 0.5f) TDIST_FAIL("expert ", g, " row ", i, ": scale ", sc, " not UE8M0");
        }
        for (int64_t c = 0; c < H; ++c) {
          const double want = __bfloat162float(x[c]), sc = scales[i * G + c / 128];
          const double got = e4m3(rows[i * row_bytes + c]) * sc;
          if (!(std::fabs(got - want) <= std::fabs(want) / 16 + sc / 512 + 1e-12))
            TDIST_FAIL("expert ", g, " row ", i, " channel ", c, ": FP8 ", got, " for ", want, " (scale ", sc, ")");
        }
      }
    }
    return counts;
  }

  // y for every received row: bf16(x * f(expert)), NaN past the counts.
  DeviceBuffer expert_outputs(const EpLlHandle& h, const std::vector<int>& counts,
                              const std::vector<RankInput>& all) const {
    const int64_t rows_per_expert = W * M;
    DeviceBuffer y(static_cast<size_t>(L * rows_per_expert * H) * sizeof(bf16));
    tdist::test::fill_device(y.get(), 0xFF, static_cast<size_t>(L * rows_per_expert * H) * sizeof(bf16));
    for (int le = 0; le < L; ++le) {
      const size_t n = static_cast<size_t>(counts[le]);
      const std::vector<int> routes = download<int>(h.recv_route + le * rows_per_expert, n);
      std::vector<bf16> rows(n * static_cast<size_t>(H));
      const float f = expert_factor(me * L + le);
      for (size_t i = 0; i < n; ++i) {
        const int s = static_cast<int>(routes[i] / (M * K));
        const int64_t t = routes[i] % (M * K) / K;
        for (int64_t c = 0; c < H; ++c)
          rows[i * H + c] = __float2bfloat16_rn(__bfloat162float(all[s].x[static_cast<size_t>(t * H + c)]) * f);
      }
      if (n)
        test::copy_to_device(y.get<bf16>() + le * rows_per_expert * H, rows.data(), rows.size() * sizeof(bf16));
    }
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
    return y;
  }

  // out[t] against sum over sent slots j of w[t][j] * y(t, j); `identity`: y = x (combine of recv_x).
  void check_combine(const void* out_dev, const RankInput& mine, bool identity) const {
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<bf16> out = download<bf16>(out_dev, static_cast<size_t>(mine.tokens * H));
    for (int64_t t = 0; t < mine.tokens; ++t) {
      for (int64_t c = 0; c < H; ++c) {
        double ref = 0, mag = 0;
        for (int j = 0; j < K; ++j) {
          const int g = sent_expert(mine.idx.data() + t * K, K, j, E);
          if (g < 0) continue;
          const float xv = __bfloat162float(mine.x[static_cast<size_t>(t * H + c)]);
          const double y = identity ? xv : __bfloat162float(__float2bfloat16_rn(xv * expert_factor(g)));
          const double term = static_cast<double>(mine.weights[static_cast<size_t>(t * K + j)]) * y;
          ref += term;
          mag += std::fabs(term);
        }
        const double got = __bfloat162float(out[static_cast<size_t>(t * H + c)]);
        if (!(std::fabs(got - ref) <= mag * 1.0 / 128 + 1e-6))
          TDIST_FAIL("token ", t, " channel ", c, ": combined ", got, ", reference ", ref);
      }
    }
  }
};

struct Operands {
  DeviceBuffer x, idx, weights, out;
  explicit Operands(const RankInput& in, int64_t H)
      : x(upload(in.x)), idx(upload(in.idx)), weights(upload(in.weights)),
        out(static_cast<size_t>(in.tokens * H) * sizeof(bf16)) {
    tdist::test::fill_device(out.get(), 0xFF, static_cast<size_t>(in.tokens * H) * sizeof(bf16));
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

// One dispatch and combine; hooks on odd cases (the hook path also poisons the outputs first).
void round_trip(const Fixture& f, uint64_t seed, Routing r, Tokens tk, bool fp8, bool ue8m0, bool hook) {
  const std::vector<RankInput> all = f.inputs(seed, r, tk);
  const RankInput& mine = all[static_cast<size_t>(f.me)];
  Operands ops(mine, f.H);
  EpLlDispatchArgs a;
  a.x = ops.x.get();
  a.topk_idx = ops.idx.get<int64_t>();
  a.num_tokens = mine.tokens;
  a.fp8 = fp8;
  a.ue8m0 = ue8m0;
  a.return_hook = hook;
  for (const EpLlHandle& old : f.seen) f.poison(old);  // whichever slot this call takes
  EpLlHandle h = f.ep.ll_dispatch(a, f.stream);
  f.seen[static_cast<size_t>(h.slot)] = h;
  if (hook) {
    if (!h.hook) TDIST_FAIL("no receive hook returned");
    h.hook(f.stream);
  }
  const std::vector<int> counts = f.check_dispatch(h, all, fp8, ue8m0);
  DeviceBuffer y = f.expert_outputs(h, counts, all);
  EpLlCombineArgs c;
  c.y = y.get();
  c.topk_idx = ops.idx.get<int64_t>();
  c.topk_weights = ops.weights.get<float>();
  c.out = ops.out.get();
  c.return_hook = hook;
  auto combine_hook = f.ep.ll_combine(c, h, f.stream);
  if (hook) combine_hook(f.stream);
  f.check_combine(ops.out.get(), mine, false);
  f.ep.check_errors(f.stream);
}


// ---------------------------------------------------------------------------------------------
// High-throughput mode.

struct HtOperands {
  DeviceBuffer x, idx, weights, out;
  HtOperands(const RankInput& in, int64_t H)
      : x(upload(in.x)), idx(upload(in.idx)), weights(upload(in.weights)),
        out(static_cast<size_t>(in.tokens * H) * sizeof(bf16)) {
    tdist::test::fill_device(out.get(), 0xFF, static_cast<size_t>(in.tokens * H) * sizeof(bf16));
    TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  }
  EpHtDispatchArgs args(const RankInput& in, bool sync_counts) const {
    return EpHtDispatchArgs{.x = x.get(), .topk_idx = idx.get<int64_t>(), .topk_weights = weights.get<float>(),
                            .num_tokens = in.tokens, .sync_counts = sync_counts};
  }
};

// Checks a high-throughput dispatch against every rank's inputs; returns the device counts (info).
std::vector<int> check_ht_dispatch(const EpBuffer& ep, const EpHtHandle& h, const std::vector<RankInput>& all, int me,
                                   cudaStream_t stream) {
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  const EpConfig& c = ep.config();
  const int W = static_cast<int>(all.size()), L = ep.num_local_experts(), K = c.topk, E = c.num_experts;
  const int64_t M = c.max_tokens, H = c.hidden;
  const std::vector<int> info = download<int>(h.info, static_cast<size_t>(3 + 2 * L));
  // Reference counts, from the host mirror of the layout step.
  std::vector<int> from(static_cast<size_t>(W)), expert_rows(static_cast<size_t>(L), 0);
  for (int s = 0; s < W; ++s) {
    const EpTokenCounts tc = ep_count_tokens(all[s].idx.data(), all[s].tokens, K, E, W);
    from[s] = tc.tokens_per_rank[me];
    for (int le = 0; le < L; ++le) expert_rows[le] += tc.rows_per_expert[me * L + le];
  }
  const std::vector<int> offsets = ep_expert_offsets(expert_rows, c.expert_alignment);
  int received = 0;
  for (int v : from) received += v;
  if (info[0] != received) TDIST_FAIL("received ", info[0], " tokens, expected ", received);
  if (info[1] != offsets[L]) TDIST_FAIL("expert-major rows ", info[1], ", expected ", offsets[L]);
  for (int le = 0; le < L; ++le)
    if (info[2 + le] != expert_rows[le] || info[2 + L + le] != offsets[le])
      TDIST_FAIL("local expert ", le, ": ", info[2 + le], " rows at ", info[2 + L + le], ", expected ",
                 expert_rows[le], " at ", offsets[le]);
  if (h.num_recv >= 0 && (h.num_recv != received || h.expert_counts != expert_rows))
    TDIST_FAIL("the host counts of sync_counts differ from the device's");
  const size_t R = static_cast<size_t>(received), X = static_cast<size_t>(offsets[L]);
  const std::vector<bf16> rows = download<bf16>(h.recv_x, R * H);
  const std::vector<int> src = download<int>(h.recv_src, R);
  const std::vector<int> ridx = download<int>(h.recv_topk_idx, R * K);
  const std::vector<float> rw = download<float>(h.recv_topk_weights, R * K);
  const std::vector<int> rpos = download<int>(h.recv_expert_row, R * K);
  const std::vector<bf16> ex = download<bf16>(h.expert_x, X * H);
  const std::vector<int> esrc = download<int>(h.expert_src, X);
  std::set<int64_t> seen;
  std::vector<int> pos_used(X, 0);
  std::vector<int> begin(static_cast<size_t>(W) + 1, 0);  // compact rows of source s: [begin[s], begin[s + 1])
  for (int s = 0; s < W; ++s) begin[s + 1] = begin[s] + from[s];
  for (size_t i = 0; i < R; ++i) {
    const int s = src[i] / static_cast<int>(M);
    const int64_t t = src[i] % M;
    if (s < 0 || s >= W || t >= all[s].tokens || !seen.insert(src[i]).second)
      TDIST_FAIL("compact row ", i, ": bad or repeated source ", src[i]);
    if (static_cast<int>(i) < begin[s] || static_cast<int>(i) >= begin[s + 1])
      TDIST_FAIL("compact row ", i, " from rank ", s, " outside its block [", begin[s], ", ", begin[s + 1], ")");
    if (std::memcmp(rows.data() + i * H, all[s].x.data() + t * H, H * sizeof(bf16)) != 0)
      TDIST_FAIL("compact row ", i, " (rank ", s, " token ", t, ") differs");
    bool any = false;
    for (int j = 0; j < K; ++j) {
      const int g = sent_expert(all[s].idx.data() + t * K, K, j, E);
      const bool here = g >= 0 && g / L == me;
      any |= here;
      const int want_idx = here ? g % L : -1;
      if (ridx[i * K + j] != want_idx) TDIST_FAIL("compact row ", i, " slot ", j, ": id ", ridx[i * K + j], " for ", want_idx);
      if (rw[i * K + j] != all[s].weights[static_cast<size_t>(t * K + j)])
        TDIST_FAIL("compact row ", i, " slot ", j, ": weight differs");
      const int pos = rpos[i * K + j];
      if (!here) {
        if (pos != -1) TDIST_FAIL("compact row ", i, " slot ", j, ": expert row ", pos, " for a remote slot");
        continue;
      }
      const int le = g % L;
      if (pos < offsets[le] || pos >= offsets[le] + expert_rows[le] || pos_used[pos]++)
        TDIST_FAIL("compact row ", i, " slot ", j, ": expert row ", pos, " outside expert ", le, "'s rows or repeated");
      if (esrc[pos] != static_cast<int>(i)) TDIST_FAIL("expert row ", pos, ": source ", esrc[pos], ", expected ", i);
      if (std::memcmp(ex.data() + static_cast<size_t>(pos) * H, rows.data() + i * H, H * sizeof(bf16)) != 0)
        TDIST_FAIL("expert row ", pos, " differs from compact row ", i);
    }
    if (!any) TDIST_FAIL("compact row ", i, " has no slot on this rank");
  }
  for (int le = 0; le < L; ++le)
    for (int q = offsets[le] + expert_rows[le]; q < offsets[le + 1]; ++q)
      if (esrc[q] != -1) TDIST_FAIL("padding row ", q, " of expert ", le, ": source ", esrc[q]);
  return info;
}

// y in the expert-major layout: bf16(x * f(expert)) for every row, NaN for the padding.
DeviceBuffer ht_expert_outputs(const EpBuffer& ep, const EpHtHandle& h, const std::vector<int>& info, int me) {
  const int L = ep.num_local_experts();
  const int64_t H = ep.config().hidden;
  const size_t X = static_cast<size_t>(info[1]);
  const std::vector<bf16> ex = download<bf16>(h.expert_x, X * H);
  std::vector<bf16> y(X * H, __ushort_as_bfloat16(0xFFFF));
  for (int le = 0; le < L; ++le) {
    const float f = expert_factor(me * L + le);
    for (int q = info[2 + L + le]; q < info[2 + L + le] + info[2 + le]; ++q)
      for (int64_t c = 0; c < H; ++c)
        y[q * H + c] = __float2bfloat16_rn(__bfloat162float(ex[q * H + c]) * f);
  }
  DeviceBuffer d(y.size() * sizeof(bf16));
  if (!y.empty()) test::copy_to_device(d.get(), y.data(), y.size() * sizeof(bf16));
  TDIST_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

// out[t] against the sum over sent slots of w * y(t, j) (weighted), or x[t] times the number of
// ranks the token went to (compact: dispatch's backward).
void check_ht_combine(const EpBuffer& ep, const void* out_dev, const RankInput& mine, int W, bool compact,
                      cudaStream_t stream) {
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  const EpConfig& c = ep.config();
  const int K = c.topk, E = c.num_experts, L = E / W;
  const int64_t H = c.hidden;
  const std::vector<bf16> out = download<bf16>(out_dev, static_cast<size_t>(mine.tokens * H));
  for (int64_t t = 0; t < mine.tokens; ++t) {
    const int64_t* row = mine.idx.data() + t * K;
    std::vector<bool> ranks(static_cast<size_t>(W), false);
    for (int j = 0; j < K; ++j) {
      const int g = sent_expert(row, K, j, E);
      if (g >= 0) ranks[g / L] = true;
    }
    int n = 0;
    for (bool b : ranks) n += b;
    for (int64_t ch = 0; ch < H; ++ch) {
      const float xv = __bfloat162float(mine.x[static_cast<size_t>(t * H + ch)]);
      double ref = 0, mag = 0;
      if (compact) {
        ref = static_cast<double>(xv) * n;
        mag = std::fabs(ref);
      } else {
        for (int j = 0; j < K; ++j) {
          const int g = sent_expert(row, K, j, E);
          if (g < 0) continue;
          const double term = static_cast<double>(mine.weights[static_cast<size_t>(t * K + j)]) *
                              __bfloat162float(__float2bfloat16_rn(xv * expert_factor(g)));
          ref += term;
          mag += std::fabs(term);
        }
      }
      const double got = __bfloat162float(out[static_cast<size_t>(t * H + ch)]);
      if (!(std::fabs(got - ref) <= mag / 128 + 1e-6))
        TDIST_FAIL("token ", t, " channel ", ch, ": combined ", got, ", reference ", ref);
    }
  }
}

void ht_round_trip(World& world, EpBuffer& ep, cudaStream_t stream, uint64_t seed, Routing r, Tokens tk,
                   bool sync_counts, bool compact) {
  const int W = world.world_size(), me = world.rank();
  std::vector<RankInput> all;
  for (int s = 0; s < W; ++s) all.push_back(make_input(ep.config(), W, seed, s, r, tk));
  HtOperands ops(all[me], ep.config().hidden);
  const EpHtHandle h = ep.ht_dispatch(ops.args(all[me], sync_counts), stream);
  const std::vector<int> info = check_ht_dispatch(ep, h, all, me, stream);
  if (compact) {
    ep.ht_combine({.y_compact = h.recv_x, .topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, h, stream);
  } else {
    DeviceBuffer y = ht_expert_outputs(ep, h, info, me);
    ep.ht_combine({.y = y.get(), .topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, h, stream);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));  // y lives until here
  }
  check_ht_combine(ep, ops.out.get(), all[me], W, compact, stream);
  ep.check_errors(stream);
}

void ht_suite(test::Suite& suite, World& world, SymmetricHeap& heap, cudaStream_t stream, uint64_t& seed) {
  const int W = world.world_size(), me = world.rank();
  const EpConfig configs[] = {
      {.max_tokens = 1024, .hidden = 7168, .num_experts = 256, .topk = 8, .mode = EpMode::kHighThroughput,
       .expert_alignment = 64},
      {.max_tokens = 300, .hidden = 200, .num_experts = 6 * W, .topk = 5, .num_sms = 3,
       .mode = EpMode::kHighThroughput, .expert_alignment = 7},
      {.max_tokens = 33, .hidden = 384, .num_experts = 3 * W, .topk = 3, .mode = EpMode::kHighThroughput,
       .expert_alignment = 1},
      // Every SM sending (the blocks that place local rows are then a quarter of the SMs beyond them),
      // many tokens per warp in each role and a layout step over many blocks.
      {.max_tokens = 2000, .hidden = 1032, .num_experts = 8 * W, .topk = 4, .num_sms = 1000,
       .mode = EpMode::kHighThroughput, .expert_alignment = 16},
  };
  const Routing routings[] = {Routing::kUniform, Routing::kSkewed, Routing::kOneExpert, Routing::kOneRank,
                              Routing::kMasked};
  const Tokens token_kinds[] = {Tokens::kFull, Tokens::kZeroOnLast, Tokens::kOne, Tokens::kOdd};
  int case_index = 0;
  for (const EpConfig& cfg : configs) {
    EpBuffer ep(world, heap, cfg);
    const std::string shape = detail::concat("M ", cfg.max_tokens, " H ", cfg.hidden, " E ", cfg.num_experts, " K ",
                                             cfg.topk, " align ", cfg.expert_alignment);
    for (Routing r : routings) {
      for (Tokens tk : token_kinds) {
        if (cfg.hidden == 7168 && tk != Tokens::kFull && r != Routing::kUniform) continue;
        ++case_index;
        const bool sync_counts = case_index % 2 == 0, compact = case_index % 3 == 0;
        const uint64_t s = ++seed;
        suite.run(detail::concat("ht ", shape, " ", name(r), " ", name(tk), sync_counts ? " sync-counts" : "",
                                 compact ? " compact-combine" : ""),
                  [&] { ht_round_trip(world, ep, stream, s, r, tk, sync_counts, compact); });
      }
    }

    // Dispatch + combine (dispatch's backward form, y = the compact rows) captured once, replayed with
    // fresh tokens and routing, and back to back without host synchronisation between replays' calls.
    suite.run(detail::concat("ht graph replays ", shape), [&] {
      const int64_t T = cfg.max_tokens;
      RankInput shape_in = make_input(cfg, W, seed, me, Routing::kUniform, Tokens::kFull);
      HtOperands ops(shape_in, cfg.hidden);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const EpHtHandle h = ep.ht_dispatch(ops.args(shape_in, false), stream);
      ep.ht_combine({.y_compact = h.recv_x, .topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, h, stream);
      TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 6; ++replay) {
        std::vector<RankInput> all;
        for (int s = 0; s < W; ++s)
          all.push_back(make_input(cfg, W, seed + 1000 + replay, s, replay % 2 ? Routing::kSkewed : Routing::kMasked,
                                   Tokens::kFull));
        test::copy_to_device(ops.x.get(), all[me].x.data(), all[me].x.size() * sizeof(bf16));
        test::copy_to_device(ops.idx.get(), all[me].idx.data(), all[me].idx.size() * 8);
        test::copy_to_device(ops.weights.get(), all[me].weights.data(), all[me].weights.size() * 4);
        tdist::test::fill_device(ops.out.get(), 0xFF, static_cast<size_t>(T * cfg.hidden) * sizeof(bf16));
        test::sync_all(world, "ep ht graph inputs");
        TDIST_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        check_ht_dispatch(ep, h, all, me, stream);
        check_ht_combine(ep, ops.out.get(), all[me], W, true, stream);
      }
      seed += 1000;
      TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
      TDIST_CUDA_CHECK(cudaGraphDestroy(graph));
    });

    suite.run(detail::concat("ht back to back ", shape), [&] {
      // Several dispatch + combine pairs queued without host synchronisation; the last is checked.
      std::vector<std::vector<RankInput>> ins;
      std::vector<HtOperands> ops;
      constexpr int kCalls = 5;
      ins.reserve(kCalls);
      ops.reserve(kCalls);
      for (int i = 0; i < kCalls; ++i) {
        std::vector<RankInput> all;
        for (int s = 0; s < W; ++s) all.push_back(make_input(cfg, W, seed + i, s, Routing::kMasked, Tokens::kOdd));
        ins.push_back(std::move(all));
        ops.emplace_back(ins.back()[me], cfg.hidden);
      }
      seed += kCalls;
      for (int i = 0; i < kCalls; ++i) {
        const EpHtHandle h = ep.ht_dispatch(ops[i].args(ins[i][me], false), stream);
        ep.ht_combine({.y_compact = h.recv_x, .topk_idx = ops[i].idx.get<int64_t>(), .out = ops[i].out.get()}, h,
                      stream);
      }
      for (int i = 0; i < kCalls; ++i) check_ht_combine(ep, ops[i].out.get(), ins[i][me], W, true, stream);
    });

    suite.run(detail::concat("ht device errors ", shape), [&] {
      std::vector<RankInput> all;
      for (int s = 0; s < W; ++s) all.push_back(make_input(cfg, W, ++seed, s, Routing::kUniform, Tokens::kFull, true));
      HtOperands ops(all[me], cfg.hidden);
      const EpHtHandle h = ep.ht_dispatch(ops.args(all[me], false), stream);
      check_ht_dispatch(ep, h, all, me, stream);
      ep.ht_combine({.y_compact = h.recv_x, .topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, h, stream);
      check_ht_combine(ep, ops.out.get(), all[me], W, true, stream);
      expect_error("topk_idx", [&] { ep.check_errors(stream); });
    });

    suite.run(detail::concat("ht argument errors ", shape), [&] {
      RankInput in = make_input(cfg, W, ++seed, me, Routing::kUniform, Tokens::kOne);
      HtOperands ops(in, cfg.hidden);
      const EpHtDispatchArgs a = ops.args(in, false);
      auto with = [&](auto change) {
        EpHtDispatchArgs b = a;
        change(b);
        return b;
      };
      expect_error("num_tokens", [&] { ep.check_ht_dispatch(with([&](auto& b) { b.num_tokens = cfg.max_tokens + 1; })); });
      expect_error("hidden", [&] { ep.check_ht_dispatch(with([&](auto& b) { b.hidden = cfg.hidden - 8; })); });
      expect_error("x_dtype", [&] { ep.check_ht_dispatch(with([&](auto& b) { b.x_dtype = DType::kFloat32; })); });
      expect_error("topk_weights", [&] { ep.check_ht_dispatch(with([&](auto& b) { b.topk_weights = nullptr; })); });
      expect_error("x", [&] { ep.check_ht_dispatch(with([&](auto& b) { b.x = ops.x.get<char>() + 8; })); });
      expect_error("config.mode", [&] { ep.check_dispatch(EpLlDispatchArgs{}); });
      const EpHtHandle h = ep.ht_dispatch(a, stream);
      expect_error("y", [&] { ep.check_ht_combine({.topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, h); });
      expect_error("y", [&] {
        ep.check_ht_combine({.y = h.expert_x, .y_compact = h.recv_x, .topk_idx = ops.idx.get<int64_t>(),
                             .out = ops.out.get()},
                            h);
      });
      EpHtHandle stale = h;
      stale.call -= 1;
      expect_error("handle", [&] {
        ep.check_ht_combine({.y_compact = h.recv_x, .topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, stale);
      });
      ep.ht_combine({.y_compact = h.recv_x, .topk_idx = ops.idx.get<int64_t>(), .out = ops.out.get()}, h, stream);
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    });
    test::sync_all(world, "ep ht config done");
  }
}

}  // namespace

int main() {
  World world;
  test::Suite suite(world);
  SymmetricHeap heap(world, size_t{3} << 30);
  const int W = world.world_size(), me = world.rank();
  uint64_t seed = test::all_gather_u64(world, "seed", test::fresh_seed(0))[0];
  if (me == 0) std::printf("ep test: %d ranks, seed %llx\n", W, static_cast<unsigned long long>(seed));
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const EpConfig configs[] = {
      {.max_tokens = 128, .hidden = 7168, .num_experts = 256, .topk = 8},  // DeepSeek-V3 decode
      {.max_tokens = 37, .hidden = 384, .num_experts = 6 * W, .topk = 5},
      {.max_tokens = 9, .hidden = 200, .num_experts = 3 * W, .topk = 3},  // bf16 only (200 % 128 != 0)
  };
  const Routing routings[] = {Routing::kUniform, Routing::kSkewed, Routing::kOneExpert, Routing::kOneRank,
                              Routing::kMasked};
  const Tokens token_kinds[] = {Tokens::kFull, Tokens::kZeroOnLast, Tokens::kOne, Tokens::kOdd};
  int case_index = 0;
  for (const EpConfig& cfg : configs) {
    EpBuffer ep(world, heap, cfg);
    Fixture f(world, ep, stream);
    const std::string shape = detail::concat("M ", cfg.max_tokens, " H ", cfg.hidden, " E ", cfg.num_experts, " K ",
                                             cfg.topk);
    const bool fp8_ok = cfg.hidden % 128 == 0;
    for (int mode = 0; mode < (fp8_ok ? 3 : 1); ++mode) {
      const bool fp8 = mode >= 1, ue8m0 = mode == 2;
      const char* mname = mode == 0 ? "bf16" : mode == 1 ? "fp8" : "fp8-ue8m0";
      for (Routing r : routings) {
        for (Tokens tk : token_kinds) {
          // The DeepSeek shape: every routing at full tokens, the token kinds on uniform routing.
          if (cfg.hidden == 7168 && tk != Tokens::kFull && r != Routing::kUniform) continue;
          const bool hook = ++case_index % 2 == 0;
          const uint64_t s = ++seed;
          suite.run(detail::concat("ll ", mname, " ", shape, " ", name(r), " ", name(tk), hook ? " hook" : ""),
                    [&] { round_trip(f, s, r, tk, fp8, ue8m0, hook); });
        }
      }
    }

    // Two dispatches in flight (hooks after both sends), then both combines, y = recv_x (bf16).
    suite.run(detail::concat("ll two in flight ", shape), [&] {
      const std::vector<RankInput> a_in = f.inputs(++seed, Routing::kUniform, Tokens::kOdd);
      const std::vector<RankInput> b_in = f.inputs(++seed, Routing::kMasked, Tokens::kFull);
      Operands a_ops(a_in[me], f.H), b_ops(b_in[me], f.H);
      EpLlDispatchArgs da{.x = a_ops.x.get(), .topk_idx = a_ops.idx.get<int64_t>(), .num_tokens = a_in[me].tokens,
                          .return_hook = true};
      EpLlDispatchArgs db{.x = b_ops.x.get(), .topk_idx = b_ops.idx.get<int64_t>(), .num_tokens = b_in[me].tokens,
                          .return_hook = true};
      EpLlHandle ha = ep.ll_dispatch(da, stream), hb = ep.ll_dispatch(db, stream);
      hb.hook(stream);
      ha.hook(stream);
      f.check_dispatch(ha, a_in, false, false);
      f.check_dispatch(hb, b_in, false, false);
      ep.ll_combine({.y = ha.recv_x, .topk_idx = a_ops.idx.get<int64_t>(), .topk_weights = a_ops.weights.get<float>(),
                     .out = a_ops.out.get()},
                    ha, stream);
      ep.ll_combine({.y = hb.recv_x, .topk_idx = b_ops.idx.get<int64_t>(), .topk_weights = b_ops.weights.get<float>(),
                     .out = b_ops.out.get()},
                    hb, stream);
      f.check_combine(a_ops.out.get(), a_in[me], true);
      f.check_combine(b_ops.out.get(), b_in[me], true);
    });

    // Many calls back to back without host synchronisation (epochs well past the two parities).
    suite.run(detail::concat("ll back to back ", shape), [&] {
      constexpr int kCalls = 12;
      std::vector<std::vector<RankInput>> ins;
      std::vector<Operands> ops;
      ins.reserve(kCalls);
      ops.reserve(kCalls);
      for (int i = 0; i < kCalls; ++i) {
        ins.push_back(f.inputs(++seed, i % 2 ? Routing::kSkewed : Routing::kMasked, Tokens::kOdd));
        ops.emplace_back(ins.back()[me], f.H);
      }
      for (int i = 0; i < kCalls; ++i) {
        const bool fp8 = fp8_ok && i % 3 == 1;
        // Hooks and one-kernel calls mixed in every combination (dispatch hook on i % 4 >= 2, combine
        // hook on odd i): the paths share epochs, counters and parities, and a one-kernel combine
        // reads this rank's own rows where a hooked dispatch put them.
        const bool dispatch_hook = i % 4 >= 2, combine_hook = i % 2 == 1;
        EpLlHandle h = ep.ll_dispatch({.x = ops[i].x.get(),
                                       .topk_idx = ops[i].idx.get<int64_t>(),
                                       .num_tokens = ins[i][me].tokens,
                                       .fp8 = fp8,
                                       .return_hook = dispatch_hook},
                                      stream);
        if (dispatch_hook) h.hook(stream);
        if (fp8) continue;  // FP8 rows are not bf16 expert outputs; the next call reuses the slot
        auto receive = ep.ll_combine({.y = h.recv_x,
                                      .topk_idx = ops[i].idx.get<int64_t>(),
                                      .topk_weights = ops[i].weights.get<float>(),
                                      .out = ops[i].out.get(),
                                      .return_hook = combine_hook},
                                     h, stream);
        if (combine_hook) receive(stream);
      }
      for (int i = 0; i < kCalls; ++i)
        if (!(fp8_ok && i % 3 == 1)) f.check_combine(ops[i].out.get(), ins[i][me], true);
    });

    // A CUDA graph of dispatch + combine (y = recv_x), replayed with fresh tokens and routing.
    suite.run(detail::concat("ll graph replays ", shape), [&] {
      const int64_t T = std::max<int64_t>(1, cfg.max_tokens - 1);
      DeviceBuffer x(static_cast<size_t>(T * cfg.hidden) * sizeof(bf16)), idx(static_cast<size_t>(T * cfg.topk) * 8),
          w(static_cast<size_t>(T * cfg.topk) * 4), out(static_cast<size_t>(T * cfg.hidden) * sizeof(bf16));
      auto fill = [&](const RankInput& in) {
        std::vector<bf16> xs(in.x.begin(), in.x.begin() + T * cfg.hidden);
        std::vector<int64_t> is(in.idx.begin(), in.idx.begin() + T * cfg.topk);
        std::vector<float> ws(in.weights.begin(), in.weights.begin() + T * cfg.topk);
        test::copy_to_device(x.get(), xs.data(), xs.size() * sizeof(bf16));
        test::copy_to_device(idx.get(), is.data(), is.size() * 8);
        test::copy_to_device(w.get(), ws.data(), ws.size() * 4);
        tdist::test::fill_device(out.get(), 0xFF, static_cast<size_t>(T * cfg.hidden) * sizeof(bf16));
        TDIST_CUDA_CHECK(cudaDeviceSynchronize());
      };
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      EpLlHandle h = ep.ll_dispatch({.x = x.get(), .topk_idx = idx.get<int64_t>(), .num_tokens = T}, stream);
      ep.ll_combine({.y = h.recv_x, .topk_idx = idx.get<int64_t>(), .topk_weights = w.get<float>(), .out = out.get()},
                    h, stream);
      TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 8; ++replay) {
        std::vector<RankInput> all = f.inputs(++seed, replay % 2 ? Routing::kSkewed : Routing::kMasked, Tokens::kFull);
        for (RankInput& in : all) in.tokens = T;  // the graph's token count; the extra rows are unused
        fill(all[me]);
        test::sync_all(world, "ep graph inputs");
        TDIST_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        f.check_dispatch(h, all, false, false);
        f.check_combine(out.get(), all[me], true);
        test::sync_all(world, "ep graph checked");
      }
      TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
      TDIST_CUDA_CHECK(cudaGraphDestroy(graph));
    });

    // Bad top-k ids: skipped by both sides (no wait hangs on them), reported afterwards.
    suite.run(detail::concat("ll device errors ", shape), [&] {
      const std::vector<RankInput> all = f.inputs(++seed, Routing::kUniform, Tokens::kFull, true);
      Operands ops(all[me], f.H);
      EpLlHandle h =
          ep.ll_dispatch({.x = ops.x.get(), .topk_idx = ops.idx.get<int64_t>(), .num_tokens = all[me].tokens}, stream);
      ep.ll_combine({.y = h.recv_x, .topk_idx = ops.idx.get<int64_t>(), .topk_weights = ops.weights.get<float>(),
                     .out = ops.out.get()},
                    h, stream);
      f.check_dispatch(h, all, false, false);
      f.check_combine(ops.out.get(), all[me], true);
      expect_error("topk_idx", [&] { ep.check_errors(stream); });
      ep.check_errors(stream);  // cleared
    });

    suite.run(detail::concat("ll argument errors ", shape), [&] {
      DeviceBuffer x(static_cast<size_t>(cfg.max_tokens * cfg.hidden) * 2 + 64), idx(static_cast<size_t>(cfg.max_tokens * cfg.topk) * 8);
      EpLlDispatchArgs a{.x = x.get(), .topk_idx = idx.get<int64_t>(), .num_tokens = 1};
      auto with = [&](auto change) {
        EpLlDispatchArgs b = a;
        change(b);
        return b;
      };
      expect_error("num_tokens", [&] { ep.check_dispatch(with([&](auto& b) { b.num_tokens = cfg.max_tokens + 1; })); });
      expect_error("num_tokens", [&] { ep.check_dispatch(with([&](auto& b) { b.num_tokens = -1; })); });
      expect_error("hidden", [&] { ep.check_dispatch(with([&](auto& b) { b.hidden = cfg.hidden + 8; })); });
      expect_error("topk", [&] { ep.check_dispatch(with([&](auto& b) { b.topk = cfg.topk + 1; })); });
      expect_error("x_dtype", [&] { ep.check_dispatch(with([&](auto& b) { b.x_dtype = DType::kFloat16; })); });
      expect_error("x", [&] { ep.check_dispatch(with([&](auto& b) { b.x = x.get<char>() + 2; })); });
      expect_error("x", [&] { ep.check_dispatch(with([&](auto& b) { b.x = nullptr; })); });
      expect_error("topk_idx", [&] { ep.check_dispatch(with([&](auto& b) { b.topk_idx = nullptr; })); });
      expect_error("ue8m0", [&] { ep.check_dispatch(with([&](auto& b) { b.ue8m0 = true; })); });
      if (!fp8_ok) expect_error("fp8", [&] { ep.check_dispatch(with([&](auto& b) { b.fp8 = true; })); });
      // The launching calls check first: nothing is sent, so the ranks stay in step.
      expect_error("num_tokens", [&] { ep.ll_dispatch(with([&](auto& b) { b.num_tokens = cfg.max_tokens + 1; }), stream); });
      EpLlHandle bogus;
      expect_error("handle", [&] {
        ep.ll_combine({.y = x.get(), .topk_idx = idx.get<int64_t>(), .topk_weights = x.get<float>(), .out = x.get()},
                      bogus, stream);
      });
    });
    test::sync_all(world, "ep config done");
  }
  ht_suite(suite, world, heap, stream, seed);
  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  return suite.finish();
}
