// The GEMM's tile order and the AllGather-GEMM chunk-to-flag mapping (include/tdist/kernels/gemm/
// tile_scheduler.cuh), the m-grouped GEMM's tile walk (grouped_scheduler.cuh) and the ring's
// stage/phase sequence (pipeline.cuh), checked exhaustively on the CPU: the same code runs in the
// kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "tdist/kernels/gemm/grouped_pair_order.cuh"
#include "tdist/kernels/gemm/grouped_scheduler.cuh"
#include "tdist/kernels/gemm/pipeline.cuh"
#include "tdist/kernels/gemm/tile_scheduler.cuh"
#include "tdist/ops/grouped_gemm.hpp"

namespace kg = tdist::kernels::gemm;
using kg::u32;
using kg::u64;

namespace {

// The tiles a persistent grid of `grid` CTAs visits, CTA by CTA (as the kernel walks them).
std::vector<kg::TileCoord> walk(const kg::TileScheduler& s, u32 grid) {
  std::vector<kg::TileCoord> v;
  for (u32 b = 0; b < grid; ++b)
    for (u32 t = b; t < s.num_tiles(); t += grid) v.push_back(s.tile(t));
  return v;
}

}  // namespace

TEST(GemmSchedule, EveryTileExactlyOnce) {
  for (u32 tm : {1u, 2u, 3u, 7u, 8u, 13u, 64u})
    for (u32 tn : {1u, 2u, 5u, 16u, 33u})
      for (u32 group : {1u, 2u, 3u, 8u, 100u})
        for (u32 first = 0; first < tm; first += (tm > 8 ? 5 : 1))
          for (u32 grid : {1u, 3u, 132u}) {
            kg::TileScheduler s{tm, tn, group, first};
            std::set<std::pair<u32, u32>> seen;
            for (const auto& c : walk(s, grid)) {
              ASSERT_LT(c.tile_m, tm);
              ASSERT_LT(c.tile_n, tn);
              ASSERT_TRUE(seen.insert({c.tile_m, c.tile_n}).second)
                  << "tile (" << c.tile_m << ", " << c.tile_n << ") twice; tm " << tm << " tn " << tn << " group "
                  << group << " first " << first << " grid " << grid;
            }
            ASSERT_EQ(seen.size(), static_cast<size_t>(tm) * tn);
          }
}

TEST(GemmSchedule, RotatedStartAndWrap) {
  // Plain raster (group 1): the linear order is m-tile first_tile_m with all n-tiles, then the next
  // m-tile, wrapping past the last one.
  const u32 tm = 7, tn = 3;
  for (u32 first = 0; first < tm; ++first) {
    kg::TileScheduler s{tm, tn, 1, first};
    for (u32 i = 0; i < s.num_tiles(); ++i) {
      const auto c = s.tile(i);
      EXPECT_EQ(c.tile_m, (first + i / tn) % tm);
      EXPECT_EQ(c.tile_n, i % tn);
    }
  }
  // Grouped: the first tiles visited are still those of the local m-tile's group, starting at it.
  kg::TileScheduler g{10, 4, 4, 6};
  EXPECT_EQ(g.tile(0).tile_m, 6u);
  EXPECT_EQ(g.tile(0).tile_n, 0u);
  EXPECT_EQ(g.tile(1).tile_m, 7u);
  EXPECT_EQ(g.tile(3).tile_m, 9u);
  EXPECT_EQ(g.tile(4).tile_m, 6u);  // next n-tile, back at the group's first m-tile
  EXPECT_EQ(g.tile(4).tile_n, 1u);
  EXPECT_EQ(g.tile(16).tile_m, 0u);  // second group wraps to m-tile 0
}

TEST(GemmSchedule, GroupedRaster) {
  // 5 m-tiles, 3 n-tiles, groups of 2: (0,0) (1,0) (0,1) (1,1) (0,2) (1,2) | (2,0) (3,0) ... | (4,0) (4,1) (4,2)
  kg::TileScheduler s{5, 3, 2, 0};
  const std::vector<std::pair<u32, u32>> want = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 2}, {1, 2}, {2, 0}, {3, 0},
                                                 {2, 1}, {3, 1}, {2, 2}, {3, 2}, {4, 0}, {4, 1}, {4, 2}};
  ASSERT_EQ(s.num_tiles(), want.size());
  for (u32 i = 0; i < s.num_tiles(); ++i) {
    EXPECT_EQ(s.tile(i).tile_m, want[i].first) << "i " << i;
    EXPECT_EQ(s.tile(i).tile_n, want[i].second) << "i " << i;
  }
  // Within a group of g m-tiles, any window of g consecutive linear tiles touches at most 2 n-tiles
  // and g m-tiles: the B tiles stay in L2 while the group's A rows are reused.
  kg::TileScheduler big{64, 32, 8, 0};
  for (u32 i = 0; i + 8 <= 8 * 32; ++i) {
    std::set<u32> ms, ns;
    for (u32 j = i; j < i + 8; ++j) ms.insert(big.tile(j).tile_m), ns.insert(big.tile(j).tile_n);
    EXPECT_LE(ms.size(), 8u);
    EXPECT_LE(ns.size(), 2u);
  }
}

TEST(GemmSchedule, Make) {
  auto s = kg::TileScheduler::make(1000, 300, 128, 256, 0, 9);
  EXPECT_EQ(s.tiles_m, 8u);
  EXPECT_EQ(s.tiles_n, 2u);
  EXPECT_EQ(s.group_m, 1u);
  EXPECT_EQ(s.first_tile_m, 1u);  // 9 mod 8
  auto e = kg::TileScheduler::make(0, 0, 64, 64);
  EXPECT_EQ(e.num_tiles(), 1u);
}

TEST(GemmChunks, RowSplitCoversRows) {
  for (int n = 1; n <= 8; ++n)
    for (u64 m : {1ull, 2ull, 7ull, 8ull, 9ull, 63ull, 127ull, 128ull, 129ull, 1000ull, 4097ull, 8192ull, 12345ull}) {
      kg::RowChunks split{m, n};
      u64 next = 0;
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(split.begin(r), next) << "m " << m << " n " << n << " r " << r;
        for (u64 row = split.begin(r); row < split.begin(r) + split.rows(r); ++row)
          ASSERT_EQ(split.chunk_of(row), r) << "m " << m << " n " << n << " row " << row;
        next += split.rows(r);
      }
      EXPECT_EQ(next, m);
    }
}

// Brute force: a tile must wait for exactly the chunks that own at least one of its rows.
TEST(GemmChunks, TileWaitsForExactlyItsChunks) {
  for (int n = 1; n <= 8; ++n)
    for (u32 block_m : {64u, 128u})
      for (u64 m : {1ull, 3ull, 5ull, 64ull, 100ull, 127ull, 128ull, 129ull, 200ull, 255ull, 383ull, 1000ull, 1025ull,
                    4096ull, 8191ull, 12345ull}) {
        kg::RowChunks split{m, n};
        const u64 tiles_m = (m + block_m - 1) / block_m;
        for (u64 t = 0; t < tiles_m; ++t) {
          const u64 m0 = t * block_m, end = m0 + block_m < m ? m0 + block_m : m;
          std::set<int> owners;
          for (u64 row = m0; row < end; ++row) owners.insert(split.chunk_of(row));
          const kg::ChunkRange range = kg::tile_chunks(split, m0, block_m);
          std::set<int> got;
          for (int c = range.first; c < range.first + range.count; ++c) got.insert(c);
          ASSERT_EQ(got, owners) << "m " << m << " n " << n << " block_m " << block_m << " tile " << t;
          for (int c : got) ASSERT_GT(split.rows(c), 0u);  // never waits on an empty chunk
        }
      }
}

TEST(GemmChunks, RankStartTile) {
  for (int n = 1; n <= 8; ++n)
    for (u64 m : {5ull, 100ull, 1000ull, 8192ull, 12345ull})
      for (int r = 0; r < n; ++r) {
        kg::RowChunks split{m, n};
        const u32 first = kg::rank_first_tile_m(split, r, 128);
        const u64 tiles_m = (m + 127) / 128;
        ASSERT_LT(first, tiles_m);
        if (split.rows(r) > 0) {
          // The walk's first tile holds the rank's first row, so the first tile needs the local chunk.
          EXPECT_EQ(first, split.begin(r) / 128);
          kg::TileScheduler s = kg::TileScheduler::make(m, 512, 128, 128, 8, first);
          const auto c = s.tile(0);
          const auto chunks = kg::tile_chunks(split, static_cast<u64>(c.tile_m) * 128, 128);
          EXPECT_LE(chunks.first, r);
          EXPECT_GE(chunks.first + chunks.count - 1, r);
        }
      }
}

// ---------------- m-grouped GEMM ----------------

namespace {

// Offsets of groups of `counts` rows, each padded to kGroupedAlignment.
template <typename Index>
std::vector<Index> padded_offsets(const std::vector<u64>& counts) {
  std::vector<Index> o(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g)
    o[g + 1] = static_cast<Index>(o[g] + (counts[g] + kg::kGroupedAlignment - 1) / kg::kGroupedAlignment *
                                             kg::kGroupedAlignment);
  return o;
}

struct GroupedTile {
  u32 group, m0, n0, b_row;
  bool operator<(const GroupedTile& o) const {
    return std::tie(group, m0, n0, b_row) < std::tie(o.group, o.m0, o.n0, o.b_row);
  }
  bool operator==(const GroupedTile&) const = default;
};

// What the kernel does: every CTA prepares the schedule, then walks its linear indices.
std::vector<GroupedTile> grouped_walk(const kg::GroupedScheduler& sched, u32 grid, u32 block_m, u32 block_n, u32 m,
                                      u32 n) {
  std::vector<GroupedTile> v;
  for (u32 b = 0; b < grid; ++b) {
    const kg::GroupedScheduler s = sched.prepare();
    for (u32 t = b; t < s.num_tiles(); t += grid) {
      const kg::TileInfo info = s.tile_info(t, block_m, block_n, m, n);
      EXPECT_EQ(info.linear, t);
      v.push_back({info.group, info.m0, info.n0, info.b_row});
    }
  }
  return v;
}

// Brute force: every (group, m-tile, n-tile) of the non-empty groups, from the offsets alone.
template <typename Index>
std::multiset<GroupedTile> expected_tiles(const std::vector<Index>& offsets, u32 block_m, u32 block_n, u32 n) {
  std::multiset<GroupedTile> e;
  for (u32 g = 0; g + 1 < offsets.size(); ++g)
    for (u64 row = offsets[g]; row < static_cast<u64>(offsets[g + 1]); row += block_m)
      for (u32 n0 = 0; n0 < n; n0 += block_n) e.insert({g, static_cast<u32>(row), n0, g * n + n0});
  return e;
}

template <typename Index>
void check_grouped(const std::vector<u64>& counts, u32 block_m, u32 block_n, u32 n, u32 group_m, u32 first, u32 grid,
                   u64 extra_rows) {
  const std::vector<Index> offsets = padded_offsets<Index>(counts);
  const u64 m_total = static_cast<u64>(offsets.back()) + extra_rows;
  const auto sched = kg::GroupedScheduler::make(offsets.data(), sizeof(Index), static_cast<u32>(counts.size()), m_total,
                                                n, block_m, block_n, group_m, first);
  const auto got = grouped_walk(sched, grid, block_m, block_n, static_cast<u32>(m_total), n);
  const auto want = expected_tiles(offsets, block_m, block_n, n);
  ASSERT_EQ(got.size(), want.size()) << "groups " << counts.size() << " grid " << grid;
  std::multiset<GroupedTile> got_set(got.begin(), got.end());
  ASSERT_TRUE(got_set == want) << "groups " << counts.size() << " block_m " << block_m << " grid " << grid;
  for (const auto& t : got) {  // each exactly once
    ASSERT_EQ(got_set.count(t), 1u);
    ASSERT_GT(counts[t.group], 0u) << "a tile of empty group " << t.group;
  }
}

}  // namespace

TEST(GroupedSchedule, EveryTileOfEveryNonEmptyGroupExactlyOnce) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 60; ++trial) {
    const u32 groups = trial < 5 ? 1 + trial : 1 + rng() % 300;
    std::vector<u64> counts(groups);
    for (auto& c : counts) {
      const u32 r = rng() % 4;  // a quarter empty, the rest small to large
      c = r == 0 ? 0 : r == 1 ? 1 + rng() % 128 : rng() % 1000;
    }
    if (trial % 7 == 0) {  // one group holds everything
      std::fill(counts.begin(), counts.end(), 0);
      counts[rng() % groups] = 1 + rng() % 5000;
    }
    if (trial % 11 == 0) std::fill(counts.begin(), counts.end(), 0);  // nothing to do
    for (u32 block_m : {64u, 128u}) {
      const u32 block_n = trial % 2 ? 256 : 128;
      const u32 n = 8 * (1 + rng() % 300);
      const u32 grid = trial % 3 == 0 ? 1 : trial % 3 == 1 ? 7 : 132;
      SCOPED_TRACE(testing::Message() << "trial " << trial << " block_m " << block_m);
      check_grouped<int>(counts, block_m, block_n, n, 1 + rng() % 9, rng() % 50, grid, rng() % 300);
      check_grouped<long long>(counts, block_m, block_n, n, 8, 0, grid, 0);
    }
  }
}

TEST(GroupedSchedule, GroupLookupSkipsEmptyGroups) {
  // Groups 0, 2, 3 and 5 empty: rows of group 1 are [0, 256), of group 4 [256, 384), of 6 [384, 512).
  const std::vector<int> offsets = {0, 0, 256, 256, 256, 384, 384, 512};
  const auto s = kg::GroupedScheduler::make(offsets.data(), 4, 7, 1000, 64, 128, 64).prepare();
  EXPECT_EQ(s.tiles_m, 4u);  // rows [512, 1000) are not groups' rows: no tiles
  EXPECT_EQ(s.num_tiles(), 4u);
  EXPECT_EQ(s.group_of_row(0), 1u);
  EXPECT_EQ(s.group_of_row(128), 1u);
  EXPECT_EQ(s.group_of_row(256), 4u);
  EXPECT_EQ(s.group_of_row(384), 6u);
  const kg::TileInfo info = s.tile_info(2, 128, 64, 1000, 64);  // group_m 8 over one n-tile: m-tile 2
  EXPECT_EQ(info.m0, 256u);
  EXPECT_EQ(info.group, 4u);
  EXPECT_EQ(info.b_row, 4u * 64);
  EXPECT_EQ(info.rows, 128u);
  // Offsets past M_total are clipped to the launch's rows (never a tile outside D).
  const std::vector<long long> big = {0, 128, 1 << 20};
  EXPECT_EQ(kg::GroupedScheduler::make(big.data(), 8, 2, 300, 64, 128, 64).prepare().tiles_m, 3u);
  // Negative offsets read as 0.
  const std::vector<int> neg = {0, -128};
  EXPECT_EQ(kg::GroupedScheduler::make(neg.data(), 4, 1, 300, 64, 128, 64).prepare().num_tiles(), 0u);
}

TEST(GroupedSchedule, RotationAndOrderTable) {
  const std::vector<int> offsets = {0, 256, 256, 640};  // 5 m-tiles of 128 rows
  const u32 tn = 3;
  // Rotation: raster (group_m 1) starting at m-tile 3, wrapping.
  auto s = kg::GroupedScheduler::make(offsets.data(), 4, 3, 640, 3 * 64, 128, 64, 1, 8).prepare();  // 8 % 5 = 3
  ASSERT_EQ(s.num_tiles(), 5u * tn);
  for (u32 i = 0; i < s.num_tiles(); ++i) {
    EXPECT_EQ(s.tile(i).tile_m, (3 + i / tn) % 5);
    EXPECT_EQ(s.tile(i).tile_n, i % tn);
  }
  // An order table replaces the rotation: its m-tiles in its order.
  const std::vector<u32> order = {4, 0, 2, 1, 3};
  auto o = kg::GroupedScheduler::make(offsets.data(), 4, 3, 640, 3 * 64, 128, 64, 1, 8, order.data()).prepare();
  std::vector<u32> visited;
  for (u32 i = 0; i < o.num_tiles(); i += tn) visited.push_back(o.tile(i).tile_m);
  EXPECT_EQ(visited, order);
  EXPECT_EQ(o.tile_info(0, 128, 64, 640, 3 * 64).group, 2u);  // m-tile 4: rows [512, 640)
  // With group_m > 1 the table is still a bijection: every tile once.
  auto og = kg::GroupedScheduler::make(offsets.data(), 4, 3, 640, 3 * 64, 128, 64, 2, 0, order.data()).prepare();
  std::set<std::pair<u32, u32>> seen;
  for (u32 i = 0; i < og.num_tiles(); ++i) EXPECT_TRUE(seen.insert({og.tile(i).tile_m, og.tile(i).tile_n}).second);
  EXPECT_EQ(seen.size(), 15u);
}

// A listed walk (the fused MoE AllGather's): the tiles of list 0, then of list 1, ..., each m-tile of
// each list crossed with every n-tile exactly once, TileInfo::list naming the tile's list.
TEST(GroupedSchedule, ListedWalkRunsListAfterListEveryTileOnce) {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 200; ++trial) {
    const u32 lists = 2 + rng() % (kg::GroupedScheduler::kMaxLists - 1);
    const u32 tiles = trial % 13 == 0 ? 0 : 1 + rng() % 60;
    std::vector<int> offsets = {0, static_cast<int>(tiles * 128)};  // one group: any m-tile is valid
    std::vector<u32> perm(tiles);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    // Cut the permutation into `lists` runs (some empty), stored `stride` apart with garbage after each.
    std::vector<u32> cuts = {0, tiles};
    for (u32 j = 1; j < lists; ++j) cuts.push_back(tiles == 0 ? 0 : rng() % (tiles + 1));
    std::sort(cuts.begin(), cuts.end());
    const u32 stride = tiles + rng() % 5 + (tiles == 0 ? 1 : 0);
    std::vector<u32> order(lists * stride, 0xdeadbeefu), count(lists);
    std::map<u32, u32> list_of_tile;
    for (u32 j = 0; j < lists; ++j) {
      count[j] = cuts[j + 1] - cuts[j];
      for (u32 i = 0; i < count[j]; ++i) {
        order[j * stride + i] = perm[cuts[j] + i];
        list_of_tile[perm[cuts[j] + i]] = j;
      }
    }
    const u32 block_n = 128, n = 128 * (1 + rng() % 5) - 8 * (rng() % 3), group_m = 1 + rng() % 9;
    const auto sched = kg::GroupedScheduler::make(offsets.data(), 4, 1, tiles * 128 + 64, n, 128, block_n, group_m, 0,
                                                  order.data(), count.data(), lists, stride)
                           .prepare();
    const u32 tiles_n = (n + block_n - 1) / block_n;
    SCOPED_TRACE(testing::Message() << "trial " << trial << " lists " << lists << " tiles " << tiles);
    ASSERT_EQ(sched.num_tiles(), tiles * tiles_n);
    std::set<std::pair<u32, u32>> seen;
    u32 last_list = 0;
    for (u32 t = 0; t < sched.num_tiles(); ++t) {
      const kg::TileInfo info = sched.tile_info(t, 128, block_n, tiles * 128 + 64, n);
      ASSERT_LT(info.coord.tile_m, tiles);
      ASSERT_TRUE(seen.insert({info.coord.tile_m, info.coord.tile_n}).second) << "tile visited twice";
      EXPECT_EQ(info.list, list_of_tile.at(info.coord.tile_m));
      EXPECT_GE(info.list, last_list) << "a list before the one already walked";
      last_list = info.list;
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(tiles) * tiles_n);
  }
  // Counts past a list's room are clipped to the stride, the total to the launch's m-tiles.
  const std::vector<int> offsets = {0, 1024};
  const std::vector<u32> order = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<u32> count = {9, 1};
  const auto s =
      kg::GroupedScheduler::make(offsets.data(), 4, 1, 1024, 64, 128, 64, 8, 0, order.data(), count.data(), 2, 4)
          .prepare();
  EXPECT_EQ(s.num_tiles(), 5u);  // 4 of list 0 (clipped), 1 of list 1
  EXPECT_EQ(s.tile_info(4, 128, 64, 1024, 64).coord.tile_m, 4u);
  EXPECT_EQ(s.tile_info(4, 128, 64, 1024, 64).list, 1u);
  const auto clipped =
      kg::GroupedScheduler::make(offsets.data(), 4, 1, 3 * 128, 64, 128, 64, 8, 0, order.data(), count.data(), 2, 4)
          .prepare();
  EXPECT_EQ(clipped.num_tiles(), 3u);
  for (u32 t = 0; t < 3; ++t) EXPECT_EQ(clipped.tile_info(t, 128, 64, 3 * 128, 64).list, 0u);
}

// The pair order (grouped_pair_order.cuh) of a 2-CTA clustered walk: a permutation of the m-tiles in
// which every group's m-tiles sit two by two at even positions, so that the cluster pairs of the walk
// (linear tiles 2q, 2q + 1) share B for sum over groups of count / 2 pairs per n-tile, the most there
// can be; the plain order shares fewer whenever a group starts at an odd m-tile.
TEST(GroupedSchedule, PairOrderKeepsEveryGroupsTilesInPairs) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    const u32 groups = 1 + rng() % 80;
    std::vector<u64> counts(groups);
    for (auto& c : counts) c = rng() % 4 == 0 ? 0 : rng() % (128 * (1 + trial % 5));
    const std::vector<int> offsets = padded_offsets<int>(counts);
    std::vector<int64_t> tiles_per_group(groups);
    u32 pairs = 0;
    for (u32 g = 0; g < groups; ++g) {
      const auto s = kg::GroupedScheduler::make(offsets.data(), 4, groups, offsets.back(), 8, 128, 8).prepare();
      u32 first, count;
      kg::group_tiles(s, g, &first, &count);  // the kernel's view of the group
      ASSERT_EQ(first, static_cast<u32>(offsets[g] / 128));
      ASSERT_EQ(count, static_cast<u32>((offsets[g + 1] - offsets[g]) / 128));
      tiles_per_group[g] = count;
      pairs += count / 2;
    }
    const std::vector<u32> order = tdist::grouped_pair_order(tiles_per_group);
    const u32 tiles_m = static_cast<u32>(offsets.back() / 128);
    ASSERT_EQ(order.size(), tiles_m);
    std::vector<u32> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (u32 i = 0; i < tiles_m; ++i) ASSERT_EQ(sorted[i], i) << "not a permutation, trial " << trial;

    // Cluster pairs of the walk that share B, with the order table and without.
    const u32 tiles_n = 1 + rng() % 5;
    auto shared_pairs = [&](const u32* table) {
      const auto s =
          kg::GroupedScheduler::make(offsets.data(), 4, groups, offsets.back(), tiles_n * 64, 128, 64, 8, 0, table)
              .prepare();
      u32 shared = 0;
      for (u32 q = 0; 2 * q + 1 < s.num_tiles(); ++q)
        shared += s.tile_info(2 * q, 128, 64, offsets.back(), tiles_n * 64).b_row ==
                  s.tile_info(2 * q + 1, 128, 64, offsets.back(), tiles_n * 64).b_row;
      return shared;
    };
    const u32 with_order = shared_pairs(order.data()), plain = shared_pairs(nullptr);
    EXPECT_GE(with_order, plain) << "trial " << trial;
    // Every raster group of 8 m-tiles keeps its pairs within one n-tile; an odd last one may split one.
    if (tiles_m % 2 == 0) EXPECT_EQ(with_order, pairs * tiles_n) << "trial " << trial;
    EXPECT_LE(with_order, pairs * tiles_n) << "trial " << trial;
  }
  EXPECT_EQ(tdist::grouped_pair_order({3, 2, 1, 0, 4}), (std::vector<u32>{0, 1, 3, 4, 6, 7, 8, 9, 2, 5}));
}

TEST(GroupedSchedule, AlignmentSuitsEveryBlockM) {
  for (u32 block_m : {64u, 128u}) EXPECT_EQ(kg::kGroupedAlignment % block_m, 0u);
}

// ---------------- pipeline state ----------------

// The state the producer and the consumers advance: stage cycles through the ring, the phase flips
// once per pass, and previous() is one step back (the stage a consumer releases).
template <int kStages>
void check_pipeline_sequence() {
  kg::PipelineState<kStages> st;
  for (u32 i = 0; i < 1000; ++i, ++st) {
    ASSERT_EQ(st.count, i);
    ASSERT_EQ(st.stage(), i % kStages);
    ASSERT_EQ(st.phase(), (i / kStages) % 2);
    if (i > 0) {
      ASSERT_EQ(st.previous().stage(), (i - 1) % kStages);
      ASSERT_EQ(st.previous().phase(), ((i - 1) / kStages) % 2);
    }
  }
  // Across tiles: a producer and a consumer that run K blocks of several tiles in turn see the same
  // sequence whatever the K blocks per tile (they share only the running count).
  kg::PipelineState<kStages> producer, consumer;
  for (u32 tile = 0; tile < 9; ++tile) {
    const u32 k_blocks = 1 + (tile * 7) % 5;
    for (u32 kb = 0; kb < k_blocks; ++kb, ++producer) {
    }
    for (u32 kb = 0; kb < k_blocks; ++kb, ++consumer) ASSERT_LE(consumer.count, producer.count);
    ASSERT_EQ(producer.stage(), consumer.stage());
    ASSERT_EQ(producer.phase(), consumer.phase());
  }
}

TEST(GemmPipeline, StageAndPhaseSequence) {
  check_pipeline_sequence<2>();
  check_pipeline_sequence<4>();
  check_pipeline_sequence<5>();
  check_pipeline_sequence<6>();
  check_pipeline_sequence<8>();
  // The producer's first pass waits for parity 1 of a fresh barrier (which returns at once), the
  // consumers' for parity 0 (the loads' phase).
  kg::PipelineState<4> st;
  EXPECT_EQ(st.phase() ^ 1, 1u);
}
