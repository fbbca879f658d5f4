// MoE routing without a GPU: the host reference of the routing (ops/moe.hpp, the rules of
// kernels/moe/routing.cuh) against a brute-force construction on random, skewed and degenerate
// routings for world sizes 1 to 8; the capacity bound; argument errors naming the argument; and the
// routing kernels compiled for sm_90a through NVRTC without spills.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "cpu/errors.hpp"
#include "cpu/jit_programs.hpp"
#include "tdist/kernels/moe/routing.cuh"
#include "tdist/ops/moe.hpp"

namespace {

using tdist::MoeRoutingHost;
using tdist::test::expect_arg_error;

constexpr int kTile = 128;

// Owner of token t under the row split: rank r owns [begin(r), +rows(r)), the first m % world one more.
int owner_of(int64_t t, int64_t m, int world) {
  for (int r = 0; r < world; ++r) {
    const int64_t begin = r * (m / world) + std::min<int64_t>(r, m % world);
    const int64_t rows = m / world + (r < m % world ? 1 : 0);
    if (t >= begin && t < begin + rows) return r;
  }
  return -1;
}

// Brute force: each expert's pairs sorted by (tokens from this rank onwards, wrapping; k), padded to
// whole tiles; tiles keyed by their sources' latest rank (gather) and first-needed rank (scatter);
// the compact order: the same pairs in the same order, unpadded.
MoeRoutingHost brute_force(const std::vector<int>& ids, int64_t m, int topk, int experts, int world, int rank) {
  MoeRoutingHost r;
  const int64_t first = rank * (m / world) + std::min<int64_t>(rank, m % world);
  r.offsets.push_back(0);
  r.compact_offsets.push_back(0);
  r.row_of_pair.assign(m * topk, -1);
  r.compact_of_pair.assign(m * topk, -1);
  for (int e = 0; e < experts; ++e) {
    std::vector<std::tuple<int64_t, int, int64_t>> pairs;  // (rotated token, k, token)
    for (int64_t t = 0; t < m; ++t)
      for (int k = 0; k < topk; ++k)
        if (ids[t * topk + k] == e) pairs.emplace_back((t - first + m) % m, k, t);
    std::sort(pairs.begin(), pairs.end());
    r.counts.push_back(static_cast<int>(pairs.size()));
    for (const auto& [rotated, k, t] : pairs) {
      const int row = static_cast<int>(r.token_of_row.size());
      r.row_of_pair[t * topk + k] = row;
      r.token_of_row.push_back(static_cast<int>(t));
      r.compact_of_pair[t * topk + k] = static_cast<int>(r.row_of_compact.size());
      r.row_of_compact.push_back(row);
      r.token_of_compact.push_back(static_cast<int>(t));
      r.pair_of_compact.push_back(static_cast<int>(t * topk + k));
    }
    while (r.token_of_row.size() % kTile != 0) r.token_of_row.push_back(-1);
    r.offsets.push_back(static_cast<int>(r.token_of_row.size()));
    r.compact_offsets.push_back(static_cast<int>(r.row_of_compact.size()));
  }
  std::vector<int> scatter_position(world);  // ReduceScatter visits ranks rank+1, ..., rank+world-1, rank
  for (int s = 0; s < world; ++s) scatter_position[(rank + s + 1) % world] = s;
  r.ag_order.assign(world, {});
  r.rs_order.assign(world, {});
  for (size_t tile = 0; tile * kTile < r.token_of_row.size(); ++tile) {
    int latest = 0, needed = world;  // latest: in arrival order from this rank
    for (int i = 0; i < kTile; ++i) {
      const int t = r.token_of_row[tile * kTile + i];
      if (t < 0) continue;
      const int o = owner_of(t, m, world);
      latest = std::max(latest, (o - rank + world) % world);
      needed = std::min(needed, scatter_position[o]);
    }
    r.ag_order[latest].push_back(static_cast<uint32_t>(tile));
    r.rs_order[needed].push_back(static_cast<uint32_t>(tile));
  }
  return r;
}

void expect_same(const MoeRoutingHost& a, const MoeRoutingHost& b) {
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_EQ(a.counts, b.counts);
  EXPECT_EQ(a.token_of_row, b.token_of_row);
  EXPECT_EQ(a.row_of_pair, b.row_of_pair);
  EXPECT_EQ(a.compact_offsets, b.compact_offsets);
  EXPECT_EQ(a.row_of_compact, b.row_of_compact);
  EXPECT_EQ(a.token_of_compact, b.token_of_compact);
  EXPECT_EQ(a.pair_of_compact, b.pair_of_compact);
  EXPECT_EQ(a.compact_of_pair, b.compact_of_pair);
  EXPECT_EQ(a.ag_order, b.ag_order);
  EXPECT_EQ(a.rs_order, b.rs_order);
}

enum class Routing { kRandom, kSkewed, kOneExpert, kHalfEmpty };

std::vector<int> make_ids(Routing kind, int64_t m, int topk, int experts, std::mt19937_64& rng) {
  std::vector<int> ids(m * topk);
  for (int64_t t = 0; t < m; ++t) {
    std::vector<int> pool(experts);
    for (int e = 0; e < experts; ++e) pool[e] = e;
    if (kind == Routing::kSkewed && experts > 2)  // experts 0 and 1 far more often: first most of the time
      std::shuffle(pool.begin() + 2, pool.end(), rng);
    else
      std::shuffle(pool.begin(), pool.end(), rng);
    if (kind == Routing::kSkewed && rng() % 8 == 0) std::shuffle(pool.begin(), pool.end(), rng);
    if (kind == Routing::kHalfEmpty) {  // only the even experts get tokens (needs topk <= experts / 2)
      std::vector<int> even;
      for (int e = 0; e < experts; e += 2) even.push_back(e);
      std::shuffle(even.begin(), even.end(), rng);
      pool = even;
    }
    for (int k = 0; k < topk; ++k)
      ids[t * topk + k] = kind == Routing::kOneExpert ? (k == 0 ? 3 : k - 1 + (k >= 4)) : pool[k];
  }
  return ids;
}

// moe_expected_rows against the mean padded rows (offsets[E]) of drawn uniform routings, from tens of
// tokens per expert to thousands, and against the capacity it must not pass.
TEST(MoeRouting, ExpectedRowsMatchUniformRoutings) {
  std::mt19937_64 rng(20261203);
  struct Case {
    int64_t m;
    int topk, experts;
  };
  for (const Case c : {Case{1717, 3, 39}, Case{222, 4, 5}, Case{156, 1, 129}, Case{268, 8, 88}, Case{4096, 2, 8},
                       Case{6933, 6, 169}, Case{2112, 4, 64}, Case{50, 2, 256}}) {
    SCOPED_TRACE(testing::Message() << "m " << c.m << " topk " << c.topk << " experts " << c.experts);
    double mean = 0;
    constexpr int kDraws = 60;
    for (int d = 0; d < kDraws; ++d) {
      const std::vector<int> ids = make_ids(Routing::kRandom, c.m, c.topk, c.experts, rng);
      std::vector<int64_t> counts(c.experts, 0);
      for (int id : ids) ++counts[id];
      for (int64_t n : counts) mean += static_cast<double>((n + 127) / 128 * 128) / kDraws;
    }
    const int64_t expected = tdist::moe_expected_rows(c.m, c.topk, c.experts);
    EXPECT_NEAR(static_cast<double>(expected), mean, 0.02 * mean + 128);
    EXPECT_LE(expected, tdist::moe_capacity(c.m, c.topk, c.experts));
  }
  EXPECT_EQ(tdist::moe_expected_rows(0, 2, 8), 0);
}

TEST(MoeRouting, ReferenceMatchesBruteForce) {
  std::mt19937_64 rng(20261201);
  struct Case {
    int64_t m;
    int topk, experts;
  };
  const std::vector<Case> cases = {{1, 1, 1},      {3, 2, 8},    {257, 2, 8}, {1000, 6, 64},
                                   {1031, 8, 128}, {4097, 2, 8}, {130, 1, 3}, {64, 4, 16}};
  int checked = 0;
  for (const Case& c : cases)
    for (int world : {1, 2, 3, 4, 8})
      for (Routing kind : {Routing::kRandom, Routing::kSkewed, Routing::kOneExpert, Routing::kHalfEmpty}) {
        if (kind == Routing::kHalfEmpty && 2 * c.topk > c.experts) continue;
        if (kind == Routing::kOneExpert && (c.experts < 5 || c.topk > c.experts - 1)) continue;
        const std::vector<int> ids = make_ids(kind, c.m, c.topk, c.experts, rng);
        for (int rank = 0; rank < world; rank += std::max(1, world / 3)) {
          SCOPED_TRACE(testing::Message() << "m=" << c.m << " topk=" << c.topk << " experts=" << c.experts << " world="
                                          << world << " rank=" << rank << " kind=" << static_cast<int>(kind));
          const MoeRoutingHost ref = tdist::moe_routing_reference(ids, c.m, c.topk, c.experts, world, rank);
          expect_same(ref, brute_force(ids, c.m, c.topk, c.experts, world, rank));
          // The build kernel's keys of every tile, from each expert's pairs per source, against the lists.
          const tdist::kernels::moe::RotatedPairs pairs{
              {static_cast<uint64_t>(c.m), world}, static_cast<uint32_t>(c.topk), rank};
          std::vector<std::vector<uint32_t>> cum(c.experts, std::vector<uint32_t>(world + 1, 0));
          for (int64_t q = 0; q < c.m * c.topk; ++q) {
            const uint64_t t = pairs.token(q);
            ++cum[ids[t * c.topk + pairs.slot(q)]][pairs.rel(t) + 1];
          }
          for (auto& e : cum) std::partial_sum(e.begin(), e.end(), e.begin());
          std::vector<int> ag_key(ref.token_of_row.size() / kTile, -1), rs_key(ag_key.size(), -1);
          for (int key = 0; key < world; ++key) {
            for (uint32_t tile : ref.ag_order[key]) ag_key[tile] = key;
            for (uint32_t tile : ref.rs_order[key]) rs_key[tile] = key;
          }
          for (int e = 0; e < c.experts; ++e)
            for (uint32_t i = 0; i * kTile < static_cast<uint32_t>(ref.counts[e]); ++i) {
              const auto keys =
                  tdist::kernels::moe::tile_keys([&](int j) { return cum[e][j]; }, ref.counts[e], i, world);
              const uint32_t tile = ref.offsets[e] / kTile + i;
              EXPECT_EQ(keys.ag, ag_key[tile]) << "expert " << e << " tile " << tile;
              EXPECT_EQ(keys.rs, rs_key[tile]) << "expert " << e << " tile " << tile;
            }
          // The fused method's waits (MoeGatherWaitHooks): a tile of ag list `key` waits for the
          // relative sources from its first row's to `key`; every real row's source is among them.
          const tdist::kernels::gemm::RowChunks split{static_cast<uint64_t>(c.m), world};
          const auto rel_of = [&](int t) { return (split.chunk_of(static_cast<uint64_t>(t)) - rank + world) % world; };
          for (int key = 0; key < world; ++key)
            for (uint32_t tile : ref.ag_order[key]) {
              const int first_token = ref.token_of_row[tile * kTile];
              ASSERT_GE(first_token, 0) << "tile " << tile << " starts with a padding row";
              int last = -1;
              for (uint32_t row = tile * kTile; row < (tile + 1) * kTile; ++row) {
                const int t = ref.token_of_row[row];
                if (t < 0) continue;
                EXPECT_GE(rel_of(t), rel_of(first_token)) << "row " << row;
                last = std::max(last, rel_of(t));
              }
              EXPECT_EQ(last, key) << "tile " << tile;
            }
          EXPECT_LE(ref.offsets.back(), tdist::moe_capacity(c.m, c.topk, c.experts));
          // Own-token tiles run first and need no wait; every tile is listed once per order.
          size_t ag = 0, rs = 0;
          for (const auto& l : ref.ag_order) ag += l.size();
          for (const auto& l : ref.rs_order) rs += l.size();
          EXPECT_EQ(ag, ref.token_of_row.size() / kTile);
          EXPECT_EQ(rs, ag);
          ++checked;
        }
      }
  EXPECT_GT(checked, 100);
}

TEST(MoeRouting, SegmentsCoverThePairsSourceBySource) {
  namespace km = tdist::kernels::moe;
  int checked = 0;
  for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{4097}, int64_t{40000}, int64_t{70001}})
    for (int topk : {1, 2, 8})
      for (int world : {1, 2, 3, 8})
        for (int rank = 0; rank < world; rank += std::max(1, world / 2)) {
          SCOPED_TRACE(testing::Message() << "m=" << m << " topk=" << topk << " world=" << world << " rank=" << rank);
          const uint64_t pairs = static_cast<uint64_t>(m) * topk;
          const km::RotatedPairs rot{{static_cast<uint64_t>(m), world}, static_cast<uint32_t>(topk), rank};
          // The model's sizes for 8 and 1024 experts (their bounds), and the smallest size.
          for (uint32_t experts : {8u, 1024u, 0u}) {
            const uint32_t segment = experts > 0 ? km::route_segment_size(pairs, experts) : km::kRouteThreads;
            const km::RouteSegments seg{rot, segment};
            if (experts > 0) EXPECT_LE(seg.count(), km::route_max_segments(pairs, experts, world));
            EXPECT_EQ(segment % km::kRouteThreads, 0u);
            uint64_t next = 0;
            for (uint32_t s = 0; s < seg.count(); ++s) {
              km::u64 begin = 0, end = 0;
              seg.range(s, &begin, &end);
              ASSERT_EQ(begin, next) << "segment " << s;
              ASSERT_GT(end, begin) << "segment " << s;
              ASSERT_LE(end - begin, segment);
              // One source per segment.
              EXPECT_EQ(rot.rel(rot.token(begin)), rot.rel(rot.token(end - 1))) << "segment " << s;
              next = end;
            }
            EXPECT_EQ(next, pairs);
            km::u64 begin = 1, end = 1;
            seg.range(seg.count(), &begin, &end);
            EXPECT_EQ(begin, end);
            ++checked;
          }
        }
  EXPECT_GT(checked, 100);
}

// The segment size follows the cost model of routing.cuh (S* = sqrt(P / (8 ceil(E / 256))) segments),
// and the count buffer sized for P pairs holds the segments of any smaller routing.
TEST(MoeRouting, SegmentSizeFollowsTheModel) {
  namespace km = tdist::kernels::moe;
  EXPECT_EQ(km::route_isqrt(0), 0u);
  EXPECT_EQ(km::route_isqrt(4096), 64u);
  EXPECT_EQ(km::route_isqrt(4095), 63u);
  EXPECT_EQ(km::route_isqrt((uint64_t{1} << 40) + 5), uint64_t{1} << 20);
  // Measured optima on one H200 (docs/moe.md): 8192 pairs -> 256, 32768 -> 512, 131072 -> 1024,
  // 524288 -> 2048 with 128 experts; fewer, longer segments with 1024 experts.
  EXPECT_EQ(km::route_segment_size(8192, 128), 256u);
  EXPECT_EQ(km::route_segment_size(32768, 128), 512u);
  EXPECT_EQ(km::route_segment_size(131072, 128), 1024u);
  EXPECT_EQ(km::route_segment_size(524288, 128), 2048u);
  EXPECT_EQ(km::route_segment_size(262144, 1024), 3072u);
  EXPECT_EQ(km::route_segment_size(1, 8), km::kRouteThreads);
  for (uint32_t experts : {1u, 8u, 256u, 257u, 1024u})
    for (uint64_t max_pairs : {uint64_t{1}, uint64_t{300}, uint64_t{8192}, uint64_t{99999}, uint64_t{4000000}}) {
      const uint64_t bound = km::route_max_segments(max_pairs, experts, 1);
      for (uint64_t pairs = 1; pairs <= max_pairs; pairs += 1 + pairs / 7) {
        const uint32_t size = km::route_segment_size(pairs, experts);
        ASSERT_EQ(size % km::kRouteThreads, 0u);
        ASSERT_LE((pairs + size - 1) / size + 1, bound) << pairs << " of " << max_pairs << " pairs, " << experts;
      }
    }
}

TEST(MoeRouting, ZeroTokens) {
  const MoeRoutingHost r = tdist::moe_routing_reference({}, 0, 2, 8, 2, 1);
  EXPECT_EQ(r.offsets, std::vector<int>(9, 0));
  EXPECT_TRUE(r.token_of_row.empty());
  EXPECT_EQ(r.ag_order.size(), 2u);
  EXPECT_TRUE(r.ag_order[0].empty() && r.ag_order[1].empty());
}

TEST(MoeRouting, CapacityIsTheWorstCase) {
  // Every expert one pair more than a multiple of the tile: the most padding a routing can need.
  const int experts = 8, topk = 1;
  const int64_t m = experts * (kTile + 1);
  std::vector<int> ids(m);
  for (int64_t t = 0; t < m; ++t) ids[t] = static_cast<int>(t % experts);
  const MoeRoutingHost r = tdist::moe_routing_reference(ids, m, topk, experts, 1, 0);
  EXPECT_EQ(r.offsets.back(), experts * 2 * kTile);
  EXPECT_EQ(tdist::moe_capacity(m, topk, experts), experts * 2 * kTile);
  EXPECT_EQ(tdist::moe_capacity(1, 1, 128), kTile);  // one pair: one tile, however many experts
  EXPECT_EQ(tdist::moe_max_tiles(4096, 2, 8), (8192 + 8 * 127) / kTile);
}

TEST(MoeRouting, ArgumentErrors) {
  expect_arg_error([] { tdist::moe_routing_reference({0, 9}, 1, 2, 8, 2, 0); }, "topk_ids");
  expect_arg_error([] { tdist::moe_routing_reference({0, -1}, 1, 2, 8, 2, 0); }, "topk_ids");
  expect_arg_error([] { tdist::moe_routing_reference({0, 1, 2}, 1, 2, 8, 2, 0); }, "topk_ids");
  expect_arg_error([] { tdist::moe_routing_reference({0, 1, 2}, 1, 3, 2, 2, 0); }, "topk");
  expect_arg_error([] { tdist::moe_routing_reference({}, 0, 0, 2, 2, 0); }, "topk");
  expect_arg_error([] { tdist::moe_routing_reference({}, 0, 1, 0, 2, 0); }, "experts");
  expect_arg_error([] { tdist::moe_routing_reference({}, 0, 1, 2000, 2, 0); }, "experts");
  expect_arg_error([] { tdist::moe_routing_reference({}, 0, 1, 2, 9, 0); }, "world_size");
  expect_arg_error([] { tdist::moe_routing_reference({}, 0, 1, 2, 2, 2); }, "rank");
  expect_arg_error([] { tdist::moe_routing_reference({}, -1, 1, 2, 2, 0); }, "m");
  expect_arg_error([] { tdist::check_moe_routing_args(int64_t{1} << 30, 8, 8, 2, 0); }, "m");
  const tdist::MoeConfig good{.max_m = 4096, .k = 4096, .max_n = 4096, .experts = 8, .topk = 2};
  EXPECT_GT(tdist::moe_ag_group_gemm_heap_bytes(good, 2, 132), size_t{4096} * 4096 * 2);
  EXPECT_GT(tdist::moe_group_gemm_rs_heap_bytes(good, 2, 132), size_t{4096} * 4096 * 2);
  auto bad = good;
  bad.dtype = tdist::DType::kFloat32;
  expect_arg_error([&] { tdist::moe_ag_group_gemm_heap_bytes(bad, 2, 132); }, "dtype");
  bad = good;
  bad.k = 4100;
  expect_arg_error([&] { tdist::moe_ag_group_gemm_heap_bytes(bad, 2, 132); }, "config.k");
  bad = good;
  bad.max_n = 0;
  expect_arg_error([&] { tdist::moe_group_gemm_rs_heap_bytes(bad, 2, 132); }, "config.max_n");
  bad = good;
  bad.topk = 9;
  expect_arg_error([&] { tdist::moe_group_gemm_rs_heap_bytes(bad, 2, 132); }, "topk");
  // FP8: the AllGather op takes e4m3 tokens (1-byte rows and their scales), K a multiple of 16; the
  // second projection's transfers are of its bf16 output.
  auto fp8 = good;
  fp8.dtype = tdist::DType::kFloat8E4M3;
  EXPECT_GT(tdist::moe_ag_group_gemm_heap_bytes(fp8, 2, 132), size_t{4096} * (4096 + 32 * 4));
  EXPECT_LT(tdist::moe_ag_group_gemm_heap_bytes(fp8, 2, 132), tdist::moe_ag_group_gemm_heap_bytes(good, 2, 132));
  fp8.k = 4104;
  expect_arg_error([&] { tdist::moe_ag_group_gemm_heap_bytes(fp8, 2, 132); }, "config.k");
  fp8.k = 4096;
  EXPECT_EQ(tdist::moe_group_gemm_rs_heap_bytes(fp8, 2, 132), tdist::moe_group_gemm_rs_heap_bytes(good, 2, 132));
}

TEST(MoeRouting, GroupedScheduleVisitsACountedPrefixOfTheOrder) {
  // Three experts of 2, 0 and 3 tiles; the order lists tiles 4, 0, 2 first, then the others; a count
  // of 3 visits exactly those (every n-tile once), a count of 0 nothing.
  const std::vector<int> offsets = {0, 2 * kTile, 2 * kTile, 5 * kTile};
  const std::vector<uint32_t> order = {4, 0, 2, 1, 3};
  for (uint32_t count : {3u, 0u, 5u}) {
    const auto sched = tdist::kernels::gemm::GroupedScheduler::make(offsets.data(), 4, 3, 5 * kTile, 300, kTile, 128, 8,
                                                                    0, order.data(), &count)
                           .prepare();
    ASSERT_EQ(sched.num_tiles(), count * 3);
    std::vector<int> seen(5 * 3, 0);
    for (uint32_t i = 0; i < sched.num_tiles(); ++i) {
      const auto info = sched.tile_info(i, kTile, 128, 5 * kTile, 300);
      ++seen[info.coord.tile_m * 3 + info.coord.tile_n];
      EXPECT_EQ(info.group, info.coord.tile_m < 2 ? 0u : 2u);
    }
    for (uint32_t p = 0; p < 5; ++p)
      for (int j = 0; j < 3; ++j) EXPECT_EQ(seen[order[p] * 3 + j], p < count ? 1 : 0) << p << " " << j;
  }
}

TEST(MoeMethod, AutoOverlapsOnlyWhereAChunkCanHideATransfer) {
  EXPECT_EQ(tdist::choose_moe_method(16384, 1), tdist::OverlapMethod::kBaseline);
  EXPECT_EQ(tdist::choose_moe_method(511, 2), tdist::OverlapMethod::kBaseline);
  EXPECT_EQ(tdist::choose_moe_method(512, 2), tdist::OverlapMethod::kChunked);
  EXPECT_EQ(tdist::choose_moe_method(4096, 8), tdist::OverlapMethod::kChunked);
  EXPECT_EQ(tdist::choose_moe_method(1024, 8), tdist::OverlapMethod::kBaseline);
}

TEST(MoeKernels, CompileForSm90aWithoutSpills) { EXPECT_EQ(tdist::test::compile_family_for_sm90a("moe"), 1); }

}  // namespace
