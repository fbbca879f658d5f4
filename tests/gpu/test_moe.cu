// The MoE tensor-parallel ops across ranks (ops/moe.hpp) against float64 host references:
//
//   * the GPU routing equal to moe_routing_reference (offsets, counts, rows, pairs, both tile lists;
//     route_into's compact order too),
//     also alone at up to 40000 tokens, 1024 experts, world sizes 1 .. 8 and several ranks;
//   * MoeAgGroupGemm: d[row] = X[token of row] B1_e^T for every real row, padding rows exactly 0;
//   * MoeGroupGemmRs: y[t] = sum over ranks r and k of w[t][k] h_r[(t, k)] B2_{r,e}^T, this rank's
//     tokens (run) or all (run_all_reduce); padding rows of h hold garbage that must not leak;
//   * every method (auto, fused (the first projection; the second then runs chunked), chunked,
//     baseline), bf16 and fp16, random and skewed routing, experts with
//     zero tokens, all tokens on one expert, fewer tokens than ranks, M not a multiple of world x 128,
//     hidden and intermediate sizes odd multiples of 8; outputs poisoned (NaN) first; error
//     max |err| < 1e-2 max |ref|;
//   * four calls back to back with fresh routing and inputs (the first projection fused and chunked
//     in turn), checked after one synchronisation;
//   * a CUDA graph of both ops captured after warm-up and replayed with fresh ids, weights and
//     inputs, the first projection chunked, then fused;
//   * argument errors naming the argument.
// Every rank draws the same ids and weights (a shared seed) and can redraw every rank's shards.
//
//   build/tools/tdistrun -n 2 -- build/tests/gpu_test_moe [--small]
//   * FP8 (e4m3 tokens and weights with block scales): the AllGather op's every method against
//     float64 of the dequantised operands; its argument errors.
// --small (what compute-sanitizer runs): three shapes in bf16, every method, one FP8 shape, the
// routing alone at one size, the bad-id route; nothing else.
// Prints "rank R: N passed, M failed" last.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/harness.cuh"
#include "gpu/test_values.cuh"
#include "tdist/common/device_buffer.hpp"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/moe.hpp"

using namespace tdist;
using tdist::kernels::gemm::RowChunks;

namespace {

enum class Routing { kRandom, kSkewed, kOneExpert, kHalfEmpty };
const char* name_of(Routing r) {
  switch (r) {
    case Routing::kRandom: return "random";
    case Routing::kSkewed: return "skewed";
    case Routing::kOneExpert: return "one-expert";
    case Routing::kHalfEmpty: return "half-empty";
  }
  return "?";
}

struct Shape {
  int64_t m, hidden, inter;  // inter: this rank's intermediate features (N of the first GEMM, K of the second)
  int experts, topk;
  Routing routing;
};

using test::input_value;
using test::to_f;
using test::to_t;

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, __half> ? DType::kFloat16 : DType::kBFloat16;
}

// The same ids and weights on every rank (from the shared seed). Weights: positive, summing to 1.
void draw_routing(const Shape& s, uint64_t seed, std::vector<int>& ids, std::vector<float>& weights) {
  std::mt19937_64 rng(seed);
  ids.assign(s.m * s.topk, 0);
  weights.assign(s.m * s.topk, 0.0f);
  for (int64_t t = 0; t < s.m; ++t) {
    std::vector<int> pool(s.experts);
    for (int e = 0; e < s.experts; ++e) pool[e] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    if (s.routing == Routing::kSkewed && rng() % 4 != 0) {  // experts 0 and 1 take most tokens
      std::iter_swap(pool.begin(), std::find(pool.begin(), pool.end(), 0));
      if (s.topk > 1 && s.experts > 1) std::iter_swap(pool.begin() + 1, std::find(pool.begin(), pool.end(), 1));
    }
    if (s.routing == Routing::kOneExpert) {  // expert experts - 1 first for every token
      std::iter_swap(pool.begin(), std::find(pool.begin(), pool.end(), s.experts - 1));
    }
    if (s.routing == Routing::kHalfEmpty) {  // odd experts get nothing
      std::vector<int> even;
      for (int e : pool)
        if (e % 2 == 0) even.push_back(e);
      pool = even;
    }
    float sum = 0;
    for (int k = 0; k < s.topk; ++k) {
      ids[t * s.topk + k] = pool[k];
      weights[t * s.topk + k] = 0.25f + static_cast<float>(rng() % 1024) / 1024.0f;
      sum += weights[t * s.topk + k];
    }
    for (int k = 0; k < s.topk; ++k) weights[t * s.topk + k] /= sum;
  }
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer b(std::max<size_t>(v.size(), 1) * sizeof(T));
  if (!v.empty()) test::copy_to_device(b.get(), v.data(), v.size() * sizeof(T));
  return b;
}
template <typename T>
std::vector<T> download(const void* p, size_t count) {
  std::vector<T> v(count);
  if (count) TDIST_CUDA_CHECK(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// A GPU routing against the host reference: every array, both tile lists and the pair order.
void check_same_routing(const MoeRouting& r, const MoeRoutingHost& ref, const std::string& what) {
  const int e = r.experts;
  if (download<int>(r.offsets, e + 1) != ref.offsets) TDIST_FAIL(what, ": offsets differ from the reference");
  if (download<int>(r.counts, e) != ref.counts) TDIST_FAIL(what, ": counts differ from the reference");
  if (download<int>(r.token_of_row, ref.offsets[e]) != ref.token_of_row) TDIST_FAIL(what, ": token_of_row differs");
  if (download<int>(r.row_of_pair, r.m * r.topk) != ref.row_of_pair) TDIST_FAIL(what, ": row_of_pair differs");
  const auto ag_count = download<uint32_t>(r.ag_count, r.world_size);
  const auto rs_count = download<uint32_t>(r.rs_count, r.world_size);
  for (int j = 0; j < r.world_size; ++j) {
    if (ag_count[j] > r.max_tiles || download<uint32_t>(r.ag_order + j * r.max_tiles, ag_count[j]) != ref.ag_order[j])
      TDIST_FAIL(what, ": ag list ", j, " differs (", ag_count[j], " tiles vs ", ref.ag_order[j].size(), ")");
    if (rs_count[j] > r.max_tiles || download<uint32_t>(r.rs_order + j * r.max_tiles, rs_count[j]) != ref.rs_order[j])
      TDIST_FAIL(what, ": rs list ", j, " differs (", rs_count[j], " tiles vs ", ref.rs_order[j].size(), ")");
  }
  if (download<uint32_t>(r.pair_order, ref.pair_order.size()) != ref.pair_order)
    TDIST_FAIL(what, ": pair order differs from the reference");
}

// MoeRouter::route_into on poisoned caller buffers: the same arrays as the reference, the compact
// order, and -1 in every row of token_of_row past offsets[E].
void check_route_into(MoeRouter& router, const int* d_ids, int64_t m, int topk, int experts, const MoeRoutingHost& ref,
                      cudaStream_t stream, const std::string& what) {
  const int64_t capacity = moe_capacity(m, topk, experts), pairs = m * topk;
  auto poisoned = [&](int64_t n) {
    DeviceBuffer b(std::max<int64_t>(n, 1) * sizeof(int));
    TDIST_CUDA_CHECK(cudaMemsetAsync(b.get(), 0x7F, std::max<int64_t>(n, 1) * sizeof(int), stream));
    return b;
  };
  DeviceBuffer offsets = poisoned(experts + 1), counts = poisoned(experts), rows = poisoned(capacity),
               row_of_pair = poisoned(pairs), c_offsets = poisoned(experts + 1), row_of_c = poisoned(pairs),
               token_of_c = poisoned(pairs), pair_of_c = poisoned(pairs), c_of_pair = poisoned(pairs);
  router.route_into(d_ids, m,
                    {.offsets = offsets.get<int>(),
                     .counts = counts.get<int>(),
                     .token_of_row = rows.get<int>(),
                     .row_of_pair = row_of_pair.get<int>(),
                     .compact_offsets = c_offsets.get<int>(),
                     .row_of_compact = row_of_c.get<int>(),
                     .token_of_compact = token_of_c.get<int>(),
                     .pair_of_compact = pair_of_c.get<int>(),
                     .compact_of_pair = c_of_pair.get<int>()},
                    stream);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<int> all_rows = ref.token_of_row;
  all_rows.resize(capacity, -1);
  const std::pair<const DeviceBuffer*, const std::vector<int>*> arrays[] = {{&offsets, &ref.offsets},
                                                                            {&counts, &ref.counts},
                                                                            {&rows, &all_rows},
                                                                            {&row_of_pair, &ref.row_of_pair},
                                                                            {&c_offsets, &ref.compact_offsets},
                                                                            {&row_of_c, &ref.row_of_compact},
                                                                            {&token_of_c, &ref.token_of_compact},
                                                                            {&pair_of_c, &ref.pair_of_compact},
                                                                            {&c_of_pair, &ref.compact_of_pair}};
  const char* names[] = {"offsets",        "counts",           "token_of_row",    "row_of_pair",    "compact_offsets",
                         "row_of_compact", "token_of_compact", "pair_of_compact", "compact_of_pair"};
  for (size_t i = 0; i < std::size(arrays); ++i)
    if (download<int>(arrays[i].first->get(), arrays[i].second->size()) != *arrays[i].second)
      TDIST_FAIL(what, ": route_into's ", names[i], " differs from the reference");
}

void expect_close(double max_err, double max_ref, const std::string& what) {
  if (!(max_err <= 1e-2 * std::max(max_ref, 1e-3)))
    TDIST_FAIL(what, ": max |err| ", max_err, " vs max |ref| ", max_ref);
}

// One call's inputs and references on this rank.
template <typename T>
struct Case {
  Shape s;
  int world, rank;
  RowChunks split;
  uint64_t seed;  // shared
  std::vector<int> ids;
  std::vector<float> weights;
  MoeRoutingHost ref;
  int64_t capacity;
  DeviceBuffer d_ids, d_weights, d_x, d_b1, d_b2, d_h, d_up, d_y, d_y_all;

  // X[t][c] (tokens, shared); B1_r[e][j][c]; B2_r[e][c][j]; h_r[(t, k)][j]: drawn from (seed, r).
  float x(int64_t t, int64_t c) const { return input_value(seed ^ 0x11, 0, t * s.hidden + c); }
  float b1(int r, int e, int64_t j, int64_t c) const {
    return input_value(seed ^ 0x22, r, (e * s.inter + j) * s.hidden + c);
  }
  float b2(int r, int e, int64_t c, int64_t j) const {
    return input_value(seed ^ 0x33, r, (e * s.hidden + c) * s.inter + j);
  }
  float h(int r, int64_t pair, int64_t j) const { return input_value(seed ^ 0x44, r, pair * s.inter + j); }

  Case(World& w, const Shape& shape, uint64_t case_seed)
      : s(shape),
        world(w.world_size()),
        rank(w.rank()),
        split{static_cast<uint64_t>(shape.m), w.world_size()},
        seed(case_seed),
        capacity(moe_capacity(shape.m, shape.topk, shape.experts)) {
    draw_routing(s, seed, ids, weights);
    ref = moe_routing_reference(ids, s.m, s.topk, s.experts, world, rank);
    d_ids = upload(ids);
    d_weights = upload(weights);
    std::vector<T> xs(split.rows(rank) * s.hidden);
    for (uint64_t i = 0; i < split.rows(rank); ++i)
      for (int64_t c = 0; c < s.hidden; ++c) xs[i * s.hidden + c] = to_t<T>(x(split.begin(rank) + i, c));
    d_x = upload(xs);
    std::vector<T> b1s(static_cast<size_t>(s.experts) * s.inter * s.hidden), b2s(b1s.size());
    for (int e = 0; e < s.experts; ++e)
      for (int64_t j = 0; j < s.inter; ++j)
        for (int64_t c = 0; c < s.hidden; ++c) {
          b1s[(e * s.inter + j) * s.hidden + c] = to_t<T>(b1(rank, e, j, c));
          b2s[(e * s.hidden + c) * s.inter + j] = to_t<T>(b2(rank, e, c, j));
        }
    d_b1 = upload(b1s);
    d_b2 = upload(b2s);
    // h in this rank's expert order; padding rows (and rows past offsets[E]) hold garbage.
    std::vector<T> hs(std::max<int64_t>(capacity, 1) * s.inter, to_t<T>(3.0f));
    for (int64_t p = 0; p < s.m * s.topk; ++p)
      for (int64_t j = 0; j < s.inter; ++j) hs[ref.row_of_pair[p] * s.inter + j] = to_t<T>(h(rank, p, j));
    d_h = upload(hs);
    d_up = DeviceBuffer(std::max<int64_t>(capacity, 1) * s.inter * sizeof(T));
    d_y = DeviceBuffer(std::max<uint64_t>(split.rows(rank), 1) * s.hidden * sizeof(T));
    d_y_all = DeviceBuffer(std::max<int64_t>(s.m, 1) * s.hidden * sizeof(T));
  }

  void poison(cudaStream_t stream) const {
    TDIST_CUDA_CHECK(cudaMemsetAsync(d_up.get(), 0xFF, capacity * s.inter * sizeof(T), stream));  // NaN
    TDIST_CUDA_CHECK(cudaMemsetAsync(d_y.get(), 0xFF, split.rows(rank) * s.hidden * sizeof(T), stream));
    TDIST_CUDA_CHECK(cudaMemsetAsync(d_y_all.get(), 0xFF, s.m * s.hidden * sizeof(T), stream));
  }

  MoeAgGroupGemmArgs ag_args() const {
    return {
        .a_local = d_x.get(), .topk_ids = d_ids.get<int>(), .b = d_b1.get(), .d = d_up.get(), .m = s.m, .n = s.inter};
  }
  MoeGroupGemmRsArgs rs_args(const MoeRouting* routing, bool all) const {
    return {.h = d_h.get(),
            .b = d_b2.get(),
            .topk_weights = d_weights.get<float>(),
            .routing = routing,
            .d = all ? d_y_all.get() : d_y.get(),
            .m = s.m,
            .n = s.hidden,
            .k = s.inter};
  }

  // The device routing equals the host reference.
  void check_routing(const MoeRouting& r) const {
    const int e = s.experts;
    if (download<int>(r.offsets, e + 1) != ref.offsets) TDIST_FAIL("routing offsets differ from the reference");
    if (download<int>(r.counts, e) != ref.counts) TDIST_FAIL("routing counts differ from the reference");
    if (download<int>(r.token_of_row, ref.offsets[e]) != ref.token_of_row) TDIST_FAIL("routing token_of_row differs");
    if (download<int>(r.row_of_pair, s.m * s.topk) != ref.row_of_pair) TDIST_FAIL("routing row_of_pair differs");
    const auto ag_count = download<uint32_t>(r.ag_count, world), rs_count = download<uint32_t>(r.rs_count, world);
    for (int j = 0; j < world; ++j) {
      if (download<uint32_t>(r.ag_order + j * r.max_tiles, ag_count[j]) != ref.ag_order[j])
        TDIST_FAIL("routing ag list ", j, " differs (", ag_count[j], " tiles vs ", ref.ag_order[j].size(), ")");
      if (download<uint32_t>(r.rs_order + j * r.max_tiles, rs_count[j]) != ref.rs_order[j])
        TDIST_FAIL("routing rs list ", j, " differs (", rs_count[j], " tiles vs ", ref.rs_order[j].size(), ")");
    }
  }

  void check_up() const {
    const auto d = download<T>(d_up.get(), ref.offsets[s.experts] * s.inter);
    double max_err = 0, max_ref = 0;
    for (int e = 0; e < s.experts; ++e)
      for (int row = ref.offsets[e]; row < ref.offsets[e + 1]; ++row) {
        const int t = ref.token_of_row[row];
        for (int64_t j = 0; j < s.inter; ++j) {
          double want = 0;
          if (t >= 0)
            for (int64_t c = 0; c < s.hidden; ++c) want += static_cast<double>(x(t, c)) * b1(rank, e, j, c);
          const double got = to_f(d[row * s.inter + j]);
          if (t < 0 && got != 0.0) TDIST_FAIL("padding row ", row, " column ", j, " is ", got, ", expected 0");
          max_err = std::max(max_err, std::abs(got - want));  // NaN fails below
          if (std::isnan(got)) TDIST_FAIL("row ", row, " column ", j, " is NaN (not written)");
          max_ref = std::max(max_ref, std::abs(want));
        }
      }
    expect_close(max_err, max_ref, "AllGather + grouped GEMM");
  }

  // y for tokens [first, first + count) against what the device wrote there.
  void check_down(const void* out, uint64_t first, uint64_t count, const char* what) const {
    const auto y = download<T>(out, count * s.hidden);
    double max_err = 0, max_ref = 0;
    std::vector<double> acc(s.hidden);
    for (uint64_t i = 0; i < count; ++i) {
      const int64_t t = static_cast<int64_t>(first + i);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int r = 0; r < world; ++r)
        for (int k = 0; k < s.topk; ++k) {
          const int e = ids[t * s.topk + k];
          const double w = weights[t * s.topk + k];
          for (int64_t c = 0; c < s.hidden; ++c) {
            double dot = 0;
            for (int64_t j = 0; j < s.inter; ++j) dot += static_cast<double>(h(r, t * s.topk + k, j)) * b2(r, e, c, j);
            acc[c] += w * dot;
          }
        }
      for (int64_t c = 0; c < s.hidden; ++c) {
        const double got = to_f(y[i * s.hidden + c]);
        if (std::isnan(got)) TDIST_FAIL(what, ": token ", t, " column ", c, " is NaN (not written)");
        max_err = std::max(max_err, std::abs(got - acc[c]));
        max_ref = std::max(max_ref, std::abs(acc[c]));
      }
    }
    expect_close(max_err, max_ref, what);
  }
  void check_rs() const { check_down(d_y.get(), split.begin(rank), split.rows(rank), "grouped GEMM + ReduceScatter"); }
  void check_ar() const { check_down(d_y_all.get(), 0, s.m, "grouped GEMM + AllReduce"); }
};

using test::expect_error;

// ---- FP8 AllGather + grouped GEMM ----

// An e4m3 matrix with DeepSeek-V3's scales, quantised on the host as tdist.moe.quantize_fp8_* do:
// per block of `row_block` rows (1: per row) and 128 columns, scale = amax / 448 (1 for a zero
// block), q = e4m3(v / scale); value(r, c) = q * scale.
struct Fp8Matrix {
  int64_t rows = 0, cols = 0, row_block = 1, kb = 0;
  std::vector<__nv_fp8_e4m3> q;
  std::vector<float> scales;  // [ceil(rows / row_block)][kb]
  double value(int64_t r, int64_t c) const {
    return static_cast<double>(static_cast<float>(q[r * cols + c])) * scales[(r / row_block) * kb + c / 128];
  }
};

Fp8Matrix quantize_fp8(const std::vector<float>& v, int64_t rows, int64_t cols, int64_t row_block) {
  Fp8Matrix m{rows, cols, row_block, (cols + 127) / 128, std::vector<__nv_fp8_e4m3>(rows * cols), {}};
  const int64_t rb = (rows + row_block - 1) / row_block;
  m.scales.assign(rb * m.kb, 1.0f);
  for (int64_t b = 0; b < rb; ++b)
    for (int64_t kb = 0; kb < m.kb; ++kb) {
      float amax = 0;
      for (int64_t r = b * row_block; r < std::min(rows, (b + 1) * row_block); ++r)
        for (int64_t c = kb * 128; c < std::min(cols, (kb + 1) * 128); ++c)
          amax = std::max(amax, std::fabs(v[r * cols + c]));
      const float scale = amax > 0 ? amax / 448.0f : 1.0f;
      m.scales[b * m.kb + kb] = scale;
      for (int64_t r = b * row_block; r < std::min(rows, (b + 1) * row_block); ++r)
        for (int64_t c = kb * 128; c < std::min(cols, (kb + 1) * 128); ++c)
          m.q[r * cols + c] = __nv_fp8_e4m3(v[r * cols + c] / scale);
    }
  return m;
}

// Expert weights [E][rows][cols] of `values`, quantised per expert in 128 x 128 blocks: the e4m3
// weights and scales as the ops take them, and the experts' matrices for the reference.
struct Fp8Experts {
  std::vector<Fp8Matrix> experts;
  std::vector<__nv_fp8_e4m3> q;
  std::vector<float> scales;
};
Fp8Experts quantize_fp8_experts(const std::vector<float>& values, int experts, int64_t rows, int64_t cols) {
  Fp8Experts w;
  for (int e = 0; e < experts; ++e) {
    w.experts.push_back(quantize_fp8(
        std::vector<float>(values.begin() + e * rows * cols, values.begin() + (e + 1) * rows * cols), rows, cols, 128));
    w.q.insert(w.q.end(), w.experts.back().q.begin(), w.experts.back().q.end());
    w.scales.insert(w.scales.end(), w.experts.back().scales.begin(), w.experts.back().scales.end());
  }
  return w;
}

// One FP8 call of `up` (config.dtype kFloat8E4M3) with `method`: every real row of d against float64
// of the dequantised token row times the dequantised expert weights, padding rows exactly 0, d
// poisoned (NaN) first. Tokens and ids are shared; the weights are this rank's.
void run_fp8_up_case(World& world, MoeAgGroupGemm& up, const Shape& s, OverlapMethod method, uint64_t seed,
                     cudaStream_t stream) {
  const int rank = world.rank(), size = world.world_size();
  const RowChunks split{static_cast<uint64_t>(s.m), size};
  std::vector<int> ids;
  std::vector<float> unused;
  draw_routing(s, seed, ids, unused);
  std::vector<float> x(s.m * s.hidden), w(s.experts * s.inter * s.hidden);
  for (size_t i = 0; i < x.size(); ++i) x[i] = input_value(seed ^ 0x51, 0, i) * (1 + static_cast<float>(i % 7));
  for (size_t i = 0; i < w.size(); ++i) w[i] = input_value(seed ^ 0x52, rank, i) * 0.25f;
  const Fp8Matrix xq = quantize_fp8(x, s.m, s.hidden, 1);
  const Fp8Experts wq = quantize_fp8_experts(w, s.experts, s.inter, s.hidden);
  const int64_t begin = static_cast<int64_t>(split.begin(rank)), rows = static_cast<int64_t>(split.rows(rank));
  const std::vector<__nv_fp8_e4m3> x_local(xq.q.begin() + begin * s.hidden, xq.q.begin() + (begin + rows) * s.hidden);
  const std::vector<float> xs_local(xq.scales.begin() + begin * xq.kb, xq.scales.begin() + (begin + rows) * xq.kb);
  const int64_t capacity = moe_capacity(s.m, s.topk, s.experts);
  DeviceBuffer d_ids = upload(ids), d_x = upload(x_local), d_xs = upload(xs_local), d_w = upload(wq.q),
               d_ws = upload(wq.scales), d_out(std::max<int64_t>(capacity, 1) * s.inter * 2);
  test::fill_device(d_out.get(), 0xFF, std::max<int64_t>(capacity, 1) * s.inter * 2);  // NaN
  world.barrier("moe fp8 inputs");
  up.run({.a_local = d_x.get(),
          .topk_ids = d_ids.get<int>(),
          .b = d_w.get(),
          .d = d_out.get(),
          .m = s.m,
          .n = s.inter,
          .a_local_scales = d_xs.get<float>(),
          .b_scales = d_ws.get<float>()},
         stream, method);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  const MoeRoutingHost ref = moe_routing_reference(ids, s.m, s.topk, s.experts, size, rank);
  check_same_routing(up.routing(), ref, "FP8 routing");
  const auto out = download<__nv_bfloat16>(d_out.get(), ref.offsets[s.experts] * s.inter);
  double max_err = 0, max_ref = 0;
  for (int e = 0; e < s.experts; ++e)
    for (int64_t row = ref.offsets[e]; row < ref.offsets[e + 1]; ++row) {
      const int t = ref.token_of_row[row];
      for (int64_t j = 0; j < s.inter; ++j) {
        const double got = static_cast<double>(__bfloat162float(out[row * s.inter + j]));
        if (t < 0) {
          if (got != 0.0) TDIST_FAIL("FP8: padding row ", row, " column ", j, " holds ", got);
          continue;
        }
        double want = 0;
        for (int64_t c = 0; c < s.hidden; ++c) want += xq.value(t, c) * wq.experts[e].value(j, c);
        max_ref = std::max(max_ref, std::fabs(want));
        max_err = std::max(max_err, std::isfinite(got) ? std::fabs(got - want) : 1e30);
      }
    }
  expect_close(max_err, max_ref, "FP8 AllGather + grouped GEMM");
}

// One FP8 call of `down` (config.dtype kFloat8E4M3) with `method`, then run_all_reduce: every rank's
// h (expert order, e4m3 per row, padding rows of garbage) and w2 shard (128 x 128 blocks); the output
// of this rank's tokens (and of all of them) against float64 of sum over ranks and slots of
// weight x dequantised h row x dequantised w2^T, outputs poisoned (NaN) first.
void run_fp8_down_case(World& world, MoeGroupGemmRs& down, const Shape& s, OverlapMethod method, uint64_t seed,
                       cudaStream_t stream) {
  const int rank = world.rank(), size = world.world_size();
  const RowChunks split{static_cast<uint64_t>(s.m), size};
  std::vector<int> ids;
  std::vector<float> weights;
  draw_routing(s, seed, ids, weights);
  const int64_t capacity = moe_capacity(s.m, s.topk, s.experts);
  // Rank r's h and w2, quantised as that rank quantises them.
  auto h_of = [&](int r) {
    std::vector<float> h(capacity * s.inter);
    for (size_t i = 0; i < h.size(); ++i) h[i] = input_value(seed ^ 0x61, r, i) * (1 + static_cast<float>(i % 5));
    return quantize_fp8(h, capacity, s.inter, 1);
  };
  auto w2_of = [&](int r) {
    std::vector<float> w(s.experts * s.hidden * s.inter);
    for (size_t i = 0; i < w.size(); ++i) w[i] = input_value(seed ^ 0x62, r, i) * 0.25f;
    return quantize_fp8_experts(w, s.experts, s.hidden, s.inter);
  };
  const Fp8Matrix hq = h_of(rank);
  const Fp8Experts wq = w2_of(rank);
  MoeRouter router(s.m, s.topk, s.experts, size, rank);
  DeviceBuffer d_ids = upload(ids), d_weights = upload(weights), d_h = upload(hq.q), d_hs = upload(hq.scales),
               d_w = upload(wq.q), d_ws = upload(wq.scales);
  const int64_t rows = static_cast<int64_t>(split.rows(rank)), begin = static_cast<int64_t>(split.begin(rank));
  DeviceBuffer d_y(std::max<int64_t>(rows, 1) * s.hidden * 2), d_all(std::max<int64_t>(s.m, 1) * s.hidden * 2);
  test::fill_device(d_y.get(), 0xFF, std::max<int64_t>(rows, 1) * s.hidden * 2);  // NaN
  test::fill_device(d_all.get(), 0xFF, std::max<int64_t>(s.m, 1) * s.hidden * 2);
  const MoeRouting& r = router.route(d_ids.get<int>(), s.m, stream);
  world.barrier("moe fp8 down inputs");
  MoeGroupGemmRsArgs a{.h = d_h.get(),
                       .b = d_w.get(),
                       .topk_weights = d_weights.get<float>(),
                       .routing = &r,
                       .d = d_y.get(),
                       .m = s.m,
                       .n = s.hidden,
                       .k = s.inter,
                       .h_scales = d_hs.get<float>(),
                       .b_scales = d_ws.get<float>()};
  down.run(a, stream, method);
  a.d = d_all.get();
  down.run_all_reduce(a, stream);
  TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Reference: every rank's partial sums, each through its own routing's rows.
  std::vector<double> ref(s.m * s.hidden, 0.0);
  for (int src = 0; src < size; ++src) {
    const Fp8Matrix h = src == rank ? hq : h_of(src);
    const Fp8Experts w = src == rank ? wq : w2_of(src);
    const MoeRoutingHost rr = moe_routing_reference(ids, s.m, s.topk, s.experts, size, src);
    for (int64_t t = 0; t < s.m; ++t)
      for (int k = 0; k < s.topk; ++k) {
        const int e = ids[t * s.topk + k], row = rr.row_of_pair[t * s.topk + k];
        for (int64_t j = 0; j < s.hidden; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < s.inter; ++c) dot += h.value(row, c) * w.experts[e].value(j, c);
          ref[t * s.hidden + j] += static_cast<double>(weights[t * s.topk + k]) * dot;
        }
      }
  }
  auto compare = [&](const DeviceBuffer& out, int64_t first, int64_t count, const char* what) {
    const auto got = download<__nv_bfloat16>(out.get(), count * s.hidden);
    double max_err = 0, max_ref = 0;
    for (int64_t i = 0; i < count * s.hidden; ++i) {
      const double want = ref[first * s.hidden + i], g = static_cast<double>(__bfloat162float(got[i]));
      max_ref = std::max(max_ref, std::fabs(want));
      max_err = std::max(max_err, std::isfinite(g) ? std::fabs(g - want) : 1e30);
    }
    expect_close(max_err, max_ref, what);
  };
  compare(d_y, begin, rows, "FP8 grouped GEMM + ReduceScatter");
  compare(d_all, 0, s.m, "FP8 grouped GEMM + AllReduce");
}

// The ops of one dtype for every shape of the test (contexts sized for the largest).
struct Ops {
  MoeAgGroupGemm up;
  MoeGroupGemmRs down;
  Ops(World& w, SymmetricHeap& heap, const MoeConfig& up_config, const MoeConfig& down_config)
      : up(w, heap, up_config), down(w, heap, down_config) {}
};

}  // namespace

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  World world;
  test::Suite suite(world);
  SymmetricHeap heap(world, size_t{2} << 30);
  const int w = world.world_size();
  const uint64_t seed = test::all_gather_u64(world, "seed", test::fresh_seed(0))[0];
  if (world.rank() == 0) std::printf("moe test: %d ranks, seed %llx\n", w, static_cast<unsigned long long>(seed));
  cudaStream_t stream;
  TDIST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // hidden, inter: odd multiples of 8; M: not multiples of world x 128, one below the world size.
  const Shape shapes[] = {
      {257, 264, 136, 8, 2, Routing::kRandom},
      {1000, 136, 88, 64, 6, Routing::kSkewed},
      {300, 264, 72, 8, 1, Routing::kOneExpert},
      {517, 200, 104, 16, 4, Routing::kHalfEmpty},
      {3, 72, 40, 128, 8, Routing::kRandom},
      {1031, 72, 56, 128, 8, Routing::kSkewed},
      {130, 56, 24, 4, 4, Routing::kOneExpert},
      // Rows past one pass of the gather's and the combine's unrolled loops (257 16-byte vectors); more
      // than 32 pairs per token (the combine's second batch of pairs).
      {300, 2056, 72, 16, 4, Routing::kRandom},
      {70, 136, 24, 40, 36, Routing::kRandom},
  };
  std::vector<Shape> op_shapes(std::begin(shapes), std::end(shapes));
  if (small) op_shapes = {shapes[0], shapes[4], shapes[6]};
  uint64_t case_seed = seed;

  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    if (small && dtype != DType::kBFloat16) continue;
    auto per_type = [&](auto tag) {
      using T = decltype(tag);
      for (const Shape& s : op_shapes) {
        const MoeConfig up_cfg{.max_m = s.m, .k = s.hidden, .experts = s.experts, .topk = s.topk, .dtype = dtype};
        const MoeConfig down_cfg{.max_m = s.m, .max_n = s.hidden, .experts = s.experts, .topk = s.topk, .dtype = dtype};
        Ops ops(world, heap, up_cfg, down_cfg);
        for (OverlapMethod method :
             {OverlapMethod::kAuto, OverlapMethod::kFused, OverlapMethod::kChunked, OverlapMethod::kBaseline}) {
          // The second projection has no fused method: it runs chunked beside the fused first.
          const OverlapMethod down_method = method == OverlapMethod::kFused ? OverlapMethod::kChunked : method;
          const std::string name =
              detail::concat("moe ", to_string(dtype), " ", to_string(method), " m ", s.m, " hidden ", s.hidden,
                             " inter ", s.inter, " experts ", s.experts, " top-", s.topk, " ", name_of(s.routing));
          suite.run(name, [&] {
            Case<T> c(world, s, ++case_seed);
            c.poison(stream);
            ops.up.run(c.ag_args(), stream, method);
            const MoeRouting& r = ops.up.routing();
            ops.down.run(c.rs_args(&r, false), stream, down_method);
            ops.down.run_all_reduce(c.rs_args(&r, true), stream);
            TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
            c.check_routing(r);
            c.check_up();
            c.check_rs();
            c.check_ar();
          });
          test::sync_all(world, "moe case");
        }
        if (dtype != DType::kBFloat16 || small) continue;
        // Back to back: four calls with fresh routing, one synchronisation.
        suite.run(detail::concat("moe back-to-back m ", s.m, " experts ", s.experts, " ", name_of(s.routing)), [&] {
          std::vector<std::unique_ptr<Case<T>>> cases;
          for (int i = 0; i < 4; ++i) {
            Shape si = s;
            si.routing = static_cast<Routing>((static_cast<int>(s.routing) + i) % 4);
            if (si.routing == Routing::kHalfEmpty && 2 * si.topk > si.experts) si.routing = Routing::kRandom;
            cases.push_back(std::make_unique<Case<T>>(world, si, ++case_seed));
            cases.back()->poison(stream);
          }
          for (auto& c : cases) {
            const bool fused = (&c - cases.data()) % 2 == 0;
            ops.up.run(c->ag_args(), stream, fused ? OverlapMethod::kFused : OverlapMethod::kChunked);
            ops.down.run(c->rs_args(&ops.up.routing(), false), stream, OverlapMethod::kChunked);
          }
          TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
          for (auto& c : cases) {
            c->check_up();
            c->check_rs();
          }
        });
        test::sync_all(world, "moe back-to-back");
      }
    };
    if (dtype == DType::kBFloat16)
      per_type(__nv_bfloat16{});
    else
      per_type(__half{});
  }

  // A CUDA graph of both ops, captured after a warm-up call, replayed with fresh routing and inputs
  // copied into the captured buffers.
  for (OverlapMethod up_method : {OverlapMethod::kChunked, OverlapMethod::kFused}) {
    if (!small)
      suite.run(detail::concat("moe CUDA graph replays, first projection ", to_string(up_method)), [&] {
        using T = __nv_bfloat16;
        const Shape s{1000, 136, 88, 16, 4, Routing::kRandom};
        Ops ops(world, heap, {.max_m = s.m, .k = s.hidden, .experts = s.experts, .topk = s.topk},
                {.max_m = s.m, .max_n = s.hidden, .experts = s.experts, .topk = s.topk});
        Case<T> c(world, s, ++case_seed);
        ops.up.run(c.ag_args(), stream, up_method);  // warm-up: kernels loaded
        ops.down.run(c.rs_args(&ops.up.routing(), false), stream, OverlapMethod::kChunked);
        TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
        world.barrier("moe graph warm-up");
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        TDIST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        ops.up.run(c.ag_args(), stream, up_method);
        ops.down.run(c.rs_args(&ops.up.routing(), false), stream, OverlapMethod::kChunked);
        TDIST_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        TDIST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int i = 0; i < 3; ++i) {
          Shape si = s;
          si.routing = i == 1 ? Routing::kSkewed : i == 2 ? Routing::kOneExpert : Routing::kRandom;
          Case<T> fresh(world, si, ++case_seed);
          const size_t pairs = s.m * s.topk;
          TDIST_CUDA_CHECK(cudaMemcpy(c.d_ids.get(), fresh.d_ids.get(), pairs * 4, cudaMemcpyDeviceToDevice));
          TDIST_CUDA_CHECK(cudaMemcpy(c.d_weights.get(), fresh.d_weights.get(), pairs * 4, cudaMemcpyDeviceToDevice));
          TDIST_CUDA_CHECK(cudaMemcpy(c.d_x.get(), fresh.d_x.get(), c.split.rows(c.rank) * s.hidden * sizeof(T),
                                      cudaMemcpyDeviceToDevice));
          TDIST_CUDA_CHECK(cudaMemcpy(c.d_b1.get(), fresh.d_b1.get(), s.experts * s.inter * s.hidden * sizeof(T),
                                      cudaMemcpyDeviceToDevice));
          TDIST_CUDA_CHECK(cudaMemcpy(c.d_b2.get(), fresh.d_b2.get(), s.experts * s.inter * s.hidden * sizeof(T),
                                      cudaMemcpyDeviceToDevice));
          TDIST_CUDA_CHECK(
              cudaMemcpy(c.d_h.get(), fresh.d_h.get(), fresh.capacity * s.inter * sizeof(T), cudaMemcpyDeviceToDevice));
          fresh.poison(stream);
          c.poison(stream);
          // The copies above went out on the legacy stream, which the graph's stream does not wait for.
          TDIST_CUDA_CHECK(cudaDeviceSynchronize());
          world.barrier("moe graph inputs");
          TDIST_CUDA_CHECK(cudaGraphLaunch(exec, stream));
          TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
          // The replay wrote c's outputs from fresh's inputs: check them as fresh's.
          TDIST_CUDA_CHECK(cudaMemcpy(fresh.d_up.get(), c.d_up.get(), fresh.capacity * s.inter * sizeof(T),
                                      cudaMemcpyDeviceToDevice));
          TDIST_CUDA_CHECK(cudaMemcpy(fresh.d_y.get(), c.d_y.get(), c.split.rows(c.rank) * s.hidden * sizeof(T),
                                      cudaMemcpyDeviceToDevice));
          fresh.check_routing(ops.up.routing());
          fresh.check_up();
          fresh.check_rs();
        }
        TDIST_CUDA_CHECK(cudaGraphExecDestroy(exec));
        TDIST_CUDA_CHECK(cudaGraphDestroy(graph));
      });
    test::sync_all(world, "moe graph");
  }

  // FP8 (e4m3 tokens and weights with block scales, bf16 out): every method of both ops, K
  // not a multiple of 128, N not of 128, fewer tokens than ranks; its argument errors.
  {
    // hidden: K of the first projection, N of the second; inter: its N and the second's K (both
    // multiples of 16 here, as FP8 needs of a K).
    const std::vector<Shape> fp8_shapes = {{301, 400, 144, 6, 2, Routing::kRandom},
                                           {1000, 256, 208, 16, 4, Routing::kSkewed},
                                           {1, 128, 48, 4, 2, Routing::kRandom}};
    for (const Shape& s0 : small ? std::vector<Shape>{fp8_shapes[0]} : fp8_shapes) {
      MoeAgGroupGemm up(
          world, heap,
          {.max_m = s0.m, .k = s0.hidden, .experts = s0.experts, .topk = s0.topk, .dtype = DType::kFloat8E4M3});
      // The second projection: K = the intermediate size, N = the hidden size.
      MoeGroupGemmRs down(
          world, heap,
          {.max_m = s0.m, .max_n = s0.hidden, .experts = s0.experts, .topk = s0.topk, .dtype = DType::kFloat8E4M3});
      for (OverlapMethod method :
           {OverlapMethod::kAuto, OverlapMethod::kFused, OverlapMethod::kChunked, OverlapMethod::kBaseline}) {
        const std::string shape = detail::concat(" m ", s0.m, " hidden ", s0.hidden, " inter ", s0.inter, " experts ",
                                                 s0.experts, " top-", s0.topk, " ", name_of(s0.routing));
        suite.run(detail::concat("moe e4m3 up ", to_string(method), shape),
                  [&] { run_fp8_up_case(world, up, s0, method, ++case_seed, stream); });
        test::sync_all(world, "moe fp8 case");
        if (method == OverlapMethod::kFused) continue;  // the second projection has no fused method
        suite.run(detail::concat("moe e4m3 down ", to_string(method), shape),
                  [&] { run_fp8_down_case(world, down, s0, method, ++case_seed, stream); });
        test::sync_all(world, "moe fp8 down case");
      }
    }
    MoeAgGroupGemm up(world, heap, {.max_m = 64, .k = 128, .experts = 4, .topk = 2, .dtype = DType::kFloat8E4M3});
    suite.run("moe e4m3 argument errors name the argument", [&] {
      const Shape s{64, 128, 40, 4, 2, Routing::kRandom};
      DeviceBuffer buf(size_t{1} << 20);
      MoeAgGroupGemmArgs a{.a_local = buf.get(),
                           .topk_ids = buf.get<int>(),
                           .b = buf.get(),
                           .d = buf.get(),
                           .m = s.m,
                           .n = s.inter,
                           .a_local_scales = buf.get<float>(),
                           .b_scales = buf.get<float>()};
      expect_error("method", [&] { up.run(a, stream, OverlapMethod::kSequential); });  // the dense ops' only
      a.b_scales = nullptr;
      expect_error("b_scales", [&] { up.run(a, stream); });
      a.b_scales = buf.get<float>();
      a.a_local_scales = reinterpret_cast<const float*>(static_cast<char*>(buf.get()) + 2);
      expect_error("a_local_scales", [&] { up.run(a, stream); });
      expect_error("config.k", [&] {
        MoeAgGroupGemm bad(world, heap, {.max_m = 16, .k = 72, .experts = 4, .topk = 1, .dtype = DType::kFloat8E4M3});
      });
      MoeGroupGemmRs down(world, heap,
                          {.max_m = 64, .max_n = 64, .experts = 4, .topk = 2, .dtype = DType::kFloat8E4M3});
      MoeRouting routing;  // the fields the check compares (the pointers are not read)
      routing.m = 64;
      routing.topk = 2;
      routing.experts = 4;
      routing.world_size = world.world_size();
      routing.rank = world.rank();
      MoeGroupGemmRsArgs d{.h = buf.get(),
                           .b = buf.get(),
                           .topk_weights = buf.get<float>(),
                           .routing = &routing,
                           .d = buf.get(),
                           .m = 64,
                           .n = 64,
                           .k = 128,
                           .h_scales = buf.get<float>(),
                           .b_scales = buf.get<float>()};
      d.h_scales = nullptr;
      expect_error("h_scales", [&] { down.run(d, stream); });
      d.h_scales = buf.get<float>();
      d.k = 72;  // a multiple of 8, not of 16
      expect_error("k", [&] { down.run(d, stream); });
      d.k = 128;
      d.b_scales = nullptr;
      expect_error("b_scales", [&] { down.run_all_reduce(d, stream); });
    });
    test::sync_all(world, "moe fp8 errors");
  }

  // The routing alone past the op cases' sizes (many segments: 200 at 40000 x 8 pairs; 1024 experts;
  // more tiles than the list's threads: 1024 at 65536 x 2 pairs over 8 experts), for world sizes and
  // ranks this run need not have (the router takes them as parameters), each router then reused for
  // fewer tokens and for none.
  suite.run("moe routing at scale", [&] {
    std::vector<Shape> cases = {{4096, 8, 8, 128, 8, Routing::kRandom},   {16384, 8, 8, 128, 8, Routing::kSkewed},
                                {40000, 8, 8, 128, 8, Routing::kRandom},  {4097, 8, 8, 8, 2, Routing::kOneExpert},
                                {3001, 8, 8, 64, 6, Routing::kHalfEmpty}, {2500, 8, 8, 1024, 3, Routing::kRandom},
                                {7, 8, 8, 1024, 8, Routing::kSkewed},     {65536, 8, 8, 8, 2, Routing::kRandom},
                                {50001, 8, 8, 16, 3, Routing::kSkewed}};
    if (small) cases = {cases[4]};
    DeviceBuffer d_ids(40000 * 8 * sizeof(int));
    for (const Shape& rc : cases)
      for (int w : {1, 2, 3, 8}) {
        std::vector<int> ranks = {0, w / 2, w - 1};  // first, middle and last
        ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
        for (int r : ranks) {
          MoeRouter router(rc.m, rc.topk, rc.experts, w, r);
          for (int64_t m : {rc.m, rc.m / 3 + 1, int64_t{0}}) {
            Shape s = rc;
            s.m = m;
            std::vector<int> ids;
            std::vector<float> weights;
            draw_routing(s, ++case_seed, ids, weights);
            if (m > 0) test::copy_to_device(d_ids.get(), ids.data(), ids.size() * sizeof(int));
            const MoeRouting& got = router.route(d_ids.get<int>(), m, stream);
            TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
            const MoeRoutingHost ref = moe_routing_reference(ids, m, rc.topk, rc.experts, w, r);
            const std::string what = detail::concat("m ", m, " top-", rc.topk, " of ", rc.experts, " ",
                                                    name_of(rc.routing), " rank ", r, " of ", w);
            check_same_routing(got, ref, what);
            check_route_into(router, d_ids.get<int>(), m, rc.topk, rc.experts, ref, stream, what);
          }
        }
      }
  });
  test::sync_all(world, "moe routing at scale");

  // Ids outside [0, experts): routed to expert 0 (the reference of the mended ids), the first one
  // reported once by check_errors naming topk_ids[t][k], and the next good routing clean.
  suite.run("moe routing of bad expert ids", [&] {
    const Shape s{300, 8, 8, 16, 4, Routing::kRandom};
    MoeRouter router(s.m, s.topk, s.experts, w, world.rank());
    std::vector<int> ids;
    std::vector<float> weights;
    draw_routing(s, ++case_seed, ids, weights);
    DeviceBuffer d_ids(ids.size() * sizeof(int));
    std::vector<int> bad = ids, mended = ids;
    bad[5 * s.topk + 2] = s.experts;  // the first in token order: the one reported
    bad[200 * s.topk + 0] = -3;
    mended[5 * s.topk + 2] = mended[200 * s.topk + 0] = 0;
    test::copy_to_device(d_ids.get(), bad.data(), bad.size() * sizeof(int));
    const MoeRouting& got = router.route(d_ids.get<int>(), s.m, stream);
    TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    check_same_routing(got, moe_routing_reference(mended, s.m, s.topk, s.experts, w, world.rank()), "bad ids mended");
    try {
      router.check_errors();
      TDIST_FAIL("check_errors did not report the bad ids");
    } catch (const Error& e) {
      const std::string what = e.what();
      if (what.find("'topk_ids'") == std::string::npos || (what.find("topk_ids[5][2] = 16") == std::string::npos &&
                                                           what.find("topk_ids[200][0] = -3") == std::string::npos))
        TDIST_FAIL("the report does not name a bad pair: ", what);
    }
    router.check_errors();  // taken: no second report
    test::copy_to_device(d_ids.get(), ids.data(), ids.size() * sizeof(int));
    router.route(d_ids.get<int>(), s.m, stream);
    router.check_errors();
    check_same_routing(router.routing(), moe_routing_reference(ids, s.m, s.topk, s.experts, w, world.rank()),
                       "good ids after bad");
  });
  test::sync_all(world, "moe bad ids");

  if (!small)
    suite.run("moe argument errors", [&] {
      using T = __nv_bfloat16;
      const Shape s{257, 264, 136, 8, 2, Routing::kRandom};
      Ops ops(world, heap, {.max_m = s.m, .k = s.hidden, .experts = s.experts, .topk = s.topk},
              {.max_m = s.m, .max_n = s.hidden, .experts = s.experts, .topk = s.topk});
      Case<T> c(world, s, ++case_seed);
      auto a = c.ag_args();
      a.n = 140;
      expect_error("n", [&] { ops.up.run(a, stream); });
      a = c.ag_args();
      a.m = s.m + 1;
      expect_error("m", [&] { ops.up.run(a, stream); });
      a = c.ag_args();
      a.topk_ids = nullptr;
      expect_error("topk_ids", [&] { ops.up.run(a, stream); });
      a = c.ag_args();
      a.b = static_cast<const char*>(a.b) + 2;
      expect_error("b", [&] { ops.up.run(a, stream); });
      expect_error("method", [&] { ops.up.run(c.ag_args(), stream, OverlapMethod::kSequential); });
      ops.up.run(c.ag_args(), stream);
      auto d = c.rs_args(&ops.up.routing(), false);
      d.m = s.m - 1;  // a routing of other tokens
      expect_error("routing", [&] { ops.down.run(d, stream); });
      d = c.rs_args(nullptr, false);
      expect_error("routing", [&] { ops.down.run(d, stream); });
      d = c.rs_args(&ops.up.routing(), false);
      d.n = s.hidden + 8;  // past max_n
      expect_error("n", [&] { ops.down.run(d, stream); });
      d = c.rs_args(&ops.up.routing(), false);
      d.topk_weights = nullptr;
      expect_error("topk_weights", [&] { ops.down.run(d, stream); });
      // The second projection has no fused method.
      expect_error("method", [&] { ops.down.run(c.rs_args(&ops.up.routing(), false), stream, OverlapMethod::kFused); });
      expect_error("topk", [&] { MoeAgGroupGemm bad(world, heap, {.max_m = 16, .k = 64, .experts = 4, .topk = 5}); });
      expect_error("experts",
                   [&] { MoeAgGroupGemm bad(world, heap, {.max_m = 16, .k = 64, .experts = 0, .topk = 1}); });
      expect_error("dtype", [&] {
        MoeGroupGemmRs bad(world, heap, {.max_m = 16, .max_n = 64, .experts = 4, .topk = 1, .dtype = DType::kFloat32});
      });
      TDIST_CUDA_CHECK(cudaStreamSynchronize(stream));
    });
  test::sync_all(world, "moe errors");

  TDIST_CUDA_CHECK(cudaStreamDestroy(stream));
  return suite.finish();
}
