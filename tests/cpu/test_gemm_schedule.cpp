// The GEMM's tile order and the AllGather-GEMM chunk-to-flag mapping (include/tdist/kernels/gemm/
// tile_scheduler.cuh), checked exhaustively on the CPU: the same code runs in the kernel.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "tdist/kernels/gemm/tile_scheduler.cuh"

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
