// tdist::Gemm and tdist::GroupedGemm without a GPU: argument checks, tile checks and choice, launch
// shapes, tensor-map parameters, the typed runtime's names; and every registered kernel instance
// (plain and grouped) compiled for sm_90a through NVRTC, with the
// facts ptxas reports checked (no spills, no stack, no wgmma serialisation, registers within the
// setmaxnreg split) and the instructions the design relies on present in the PTX.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "cpu/errors.hpp"
#include "cpu/temp_dir.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"
#include "tdist/kernels/gemm/config.cuh"
#include "tdist/ops/detail/gemm_runtime.hpp"
#include "tdist/ops/gemm.hpp"
#include "tdist/ops/grouped_gemm.hpp"

namespace jit = tdist::jit;
using tdist::DType;
using tdist::GemmArgs;
using tdist::GemmTile;
using tdist::test::TempDir;

using tdist::test::expect_arg_error;

namespace {

// A valid problem with fake (aligned) device pointers: nothing is dereferenced on the host.
GemmArgs valid() {
  GemmArgs a;
  a.a = reinterpret_cast<const void*>(0x10000);
  a.b = reinterpret_cast<const void*>(0x20000);
  a.d = reinterpret_cast<void*>(0x30000);
  a.m = 1000;
  a.n = 520;
  a.k = 72;
  return a;
}

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST(GemmArgs, DefaultsAndAccepts) {
  GemmArgs a = tdist::check_gemm_args(valid());
  EXPECT_EQ(a.lda, 72);
  EXPECT_EQ(a.ldb, 72);
  EXPECT_EQ(a.ldd, 520);
  GemmArgs f = valid();
  f.dtype = DType::kFloat16;
  f.n = 13;  // N itself needs no alignment when ldd is padded
  f.ldd = 16;
  f.lda = 80;
  EXPECT_NO_THROW(tdist::check_gemm_args(f));
  GemmArgs empty = valid();
  empty.m = 0;
  empty.a = nullptr;  // nothing to compute: pointers are not looked at
  EXPECT_NO_THROW(tdist::check_gemm_args(empty));
}

TEST(GemmArgs, ErrorsNameTheArgument) {
  auto with = [](auto change) {
    GemmArgs a = valid();
    change(a);
    return [a] { tdist::check_gemm_args(a); };
  };
  expect_arg_error(with([](GemmArgs& a) { a.dtype = DType::kFloat32; }), "dtype");
  expect_arg_error(with([](GemmArgs& a) { a.m = -1; }), "m");
  expect_arg_error(with([](GemmArgs& a) { a.n = int64_t{1} << 31; }), "n");
  expect_arg_error(with([](GemmArgs& a) { a.k = 0; }), "k");
  expect_arg_error(with([](GemmArgs& a) { a.k = 100; }), "k");
  expect_arg_error(with([](GemmArgs& a) { a.lda = 64; }), "lda");
  expect_arg_error(with([](GemmArgs& a) { a.lda = 76; }), "lda");
  expect_arg_error(with([](GemmArgs& a) { a.ldb = 60; }), "ldb");
  expect_arg_error(with([](GemmArgs& a) { a.ldb = 84; }), "ldb");
  expect_arg_error(with([](GemmArgs& a) { a.ldd = 512; }), "ldd");
  expect_arg_error(with([](GemmArgs& a) { a.ldd = 524; }), "ldd");
  expect_arg_error(with([](GemmArgs& a) { a.a = nullptr; }), "a");
  expect_arg_error(with([](GemmArgs& a) { a.b = nullptr; }), "b");
  expect_arg_error(with([](GemmArgs& a) { a.d = nullptr; }), "d");
  expect_arg_error(with([](GemmArgs& a) { a.a = reinterpret_cast<const void*>(0x10008); }), "a");
  expect_arg_error(with([](GemmArgs& a) { a.b = reinterpret_cast<const void*>(0x20002); }), "b");
  expect_arg_error(with([](GemmArgs& a) { a.d = reinterpret_cast<void*>(0x30004); }), "d");
}

TEST(GemmTiles, ShippedTilesAreValidAndFit) {
  for (const GemmTile& t : tdist::gemm_tiles()) {
    EXPECT_NO_THROW(tdist::check_gemm_tile(t)) << t.name();
    EXPECT_LE(tdist::gemm_shared_bytes(t, DType::kBFloat16), tdist::kernels::gemm::kMaxSmemBytes) << t.name();
    EXPECT_EQ(tdist::gemm_threads(t), 128u * (1 + t.block_m / 64)) << t.name();
  }
  EXPECT_EQ(GemmTile{}.name(), "128x256x64_s4_c1");
  // 4 stages of (128 + 256) x 64 bf16, two 64 x 64 D chunk buffers per consumer warpgroup, the
  // barriers, the alignment slack.
  EXPECT_EQ(tdist::gemm_shared_bytes(GemmTile{}, DType::kBFloat16), 1024u + 4 * 49152 + 2 * 2 * 8192 + 64);
  namespace kg = tdist::kernels::gemm;
  EXPECT_EQ(kg::gemm_epi_buffers(128, 256, 64, 4, 2), 2u);
  // 128 x 192 with 5 stages: two buffers per warpgroup would not fit, one does.
  EXPECT_EQ(kg::gemm_epi_buffers(128, 192, 64, 5, 2), 1u);
  EXPECT_EQ(tdist::gemm_shared_bytes({128, 192, 64, 5, 1}, DType::kBFloat16), 1024u + 5 * 40960 + 2 * 8192 + 80);
  EXPECT_EQ(kg::gemm_epi_cols(256), 64u);
  EXPECT_EQ(kg::gemm_epi_cols(192), 64u);
  EXPECT_EQ(kg::gemm_epi_cols(160), 32u);
  EXPECT_EQ(kg::gemm_epi_cols(208), 16u);
  // Every shipped tile keeps two chunk buffers or the deepest ring that fits with one.
  for (const GemmTile& t : tdist::gemm_tiles()) {
    SCOPED_TRACE(t.name());
    const unsigned bufs = kg::gemm_epi_buffers(t.block_m, t.block_n, t.block_k, t.stages, 2);
    if (bufs == 1)
      EXPECT_GT(kg::gemm_smem_bytes_with(t.block_m, t.block_n, t.block_k, t.stages, 2, 2, 2), kg::kMaxSmemBytes);
  }
  expect_arg_error([] { tdist::check_gemm_tile({96, 256, 64, 4, 1}); }, "tile");
  expect_arg_error([] { tdist::check_gemm_tile({128, 264, 64, 4, 1}); }, "tile");
  expect_arg_error([] { tdist::check_gemm_tile({128, 256, 32, 4, 1}); }, "tile");
  expect_arg_error([] { tdist::check_gemm_tile({128, 256, 64, 5, 1}); }, "tile");  // 241 KiB
  expect_arg_error([] { tdist::check_gemm_tile({128, 256, 64, 1, 1}); }, "tile");
  expect_arg_error([] { tdist::check_gemm_tile({128, 256, 64, 4, 3}); }, "tile");
  expect_arg_error([] { tdist::check_gemm_tile({128, 256, 64, 4, 0}); }, "tile");
  EXPECT_NO_THROW(tdist::check_gemm_tile({128, 256, 64, 4, 2}));
  EXPECT_EQ((GemmTile{128, 224, 64, 4, 2}.name()), "128x224x64_s4_c2");
}

TEST(GemmTiles, MulticastOfUnalignedB) {
  const GemmTile t{128, 224, 64, 4, 1}, pair{128, 224, 64, 4, 2};
  const void* aligned = reinterpret_cast<const void*>(0x10000);
  const void* off16 = reinterpret_cast<const void*>(0x10010);
  // Rows 32-byte aligned (base and stride): no cluster; either unaligned: a pair of CTAs.
  EXPECT_EQ(tdist::with_b_multicast(t, 4096, aligned, 6400, DType::kBFloat16), t);
  EXPECT_EQ(tdist::with_b_multicast(t, 4096, aligned, 6376, DType::kBFloat16), pair);
  EXPECT_EQ(tdist::with_b_multicast(t, 4096, off16, 6400, DType::kFloat16), pair);
  EXPECT_EQ(tdist::with_b_multicast(t, 4096, aligned, 6392, DType::kBFloat16), pair);  // 12784 bytes: 16 mod 32
  // One m-tile per B or a 64-row tile: the cluster's tiles would not share B, none. In a walk that keeps
  // each B's m-tiles in pairs (dense, or grouped in pair order) more than one m-tile per B on average
  // suffices; otherwise two or more (groups starting at odd m-tiles split their pairs).
  EXPECT_EQ(tdist::with_b_multicast(t, 128, aligned, 6376, DType::kBFloat16), t);
  EXPECT_EQ(tdist::with_b_multicast(t, 129, aligned, 6376, DType::kBFloat16), pair);
  EXPECT_EQ(tdist::with_b_multicast(t, 10 * 128, aligned, 6376, DType::kBFloat16, 10), t);
  EXPECT_EQ(tdist::with_b_multicast(t, 10 * 192, aligned, 6376, DType::kBFloat16, 10), pair);
  EXPECT_EQ(tdist::with_b_multicast(t, 10 * 243, aligned, 6376, DType::kBFloat16, 10, false), t);
  EXPECT_EQ(tdist::with_b_multicast(t, 10 * 256, aligned, 6376, DType::kBFloat16, 10, false), pair);
  EXPECT_EQ(tdist::with_b_multicast(GemmTile{64, 256, 64, 5, 1}, 4096, aligned, 6376, DType::kBFloat16),
            (GemmTile{64, 256, 64, 5, 1}));
  // A tile with its cluster already set is kept.
  EXPECT_EQ(tdist::with_b_multicast(pair, 128, aligned, 6400, DType::kBFloat16), pair);
  // The variable forces the cluster either way, and names itself when it holds anything else.
  ASSERT_EQ(setenv("TDIST_GEMM_CLUSTER", "2", 1), 0);
  EXPECT_EQ(tdist::with_b_multicast(t, 4096, aligned, 6400, DType::kBFloat16), pair);
  ASSERT_EQ(setenv("TDIST_GEMM_CLUSTER", "1", 1), 0);
  EXPECT_EQ(tdist::with_b_multicast(t, 4096, aligned, 6376, DType::kBFloat16), t);
  ASSERT_EQ(setenv("TDIST_GEMM_CLUSTER", "4", 1), 0);
  expect_arg_error([&] { tdist::with_b_multicast(t, 4096, aligned, 6376, DType::kBFloat16); }, "TDIST_GEMM_CLUSTER");
  unsetenv("TDIST_GEMM_CLUSTER");
}

TEST(GemmTiles, Choice) {
  // Large problems: the biggest tile.
  EXPECT_EQ(tdist::choose_gemm_tile(8192, 8192, 8192, 132), (GemmTile{128, 256, 64, 4, 1}));
  // Every choice is a shipped tile, for any shape.
  for (int64_t m : {1, 64, 100, 1024, 4096, 8192, 16384})
    for (int64_t n : {8, 256, 1000, 8192, 14336}) {
      const GemmTile t = tdist::choose_gemm_tile(m, n, 8192, 132);
      bool shipped = false;
      for (const GemmTile& s : tdist::gemm_tiles()) shipped = shipped || s == t;
      EXPECT_TRUE(shipped) << m << "x" << n << " -> " << t.name();
    }
  // A single row: a 64-row tile wastes less.
  EXPECT_EQ(tdist::choose_gemm_tile(64, 8192, 8192, 132).block_m, 64);
  // Unless the rows come in 128-row tiles (the MoE routing's): the best of those.
  EXPECT_EQ(tdist::choose_gemm_tile(64, 8192, 8192, 132, false, 128), (GemmTile{128, 128, 64, 6, 1}));
}

TEST(GemmTiles, GatheredANeverNarrowsTheTile) {
  // DeepSeek-V2-Lite's first projection at TP 2, 4096 tokens (28544 expert rows, N 1408): TMA-fed A
  // takes the 128 x 128 tile, which gathered A cannot feed (kGatheredFedColumns).
  EXPECT_EQ(tdist::choose_gemm_tile(28544, 1408, 2048, 132), (GemmTile{128, 128, 64, 6, 1}));
  EXPECT_GE(tdist::choose_gemm_tile(28544, 1408, 2048, 132, /*gathered_a=*/true).block_n, tdist::kGatheredFedColumns);
  // Only tiles narrower than the feed lose score, so the choice never gets narrower.
  for (int64_t m : {128, 1000, 8192, 28544, 40832, 139776})
    for (int64_t n : {128, 512, 768, 1408, 2816, 14336}) {
      const GemmTile fed = tdist::choose_gemm_tile(m, n, 2048, 132);
      const GemmTile gathered = tdist::choose_gemm_tile(m, n, 2048, 132, /*gathered_a=*/true);
      EXPECT_GE(gathered.block_n, fed.block_n) << m << "x" << n << ": " << gathered.name() << " vs " << fed.name();
      if (fed.block_n >= tdist::kGatheredFedColumns) EXPECT_EQ(gathered, fed) << m << "x" << n;
    }
}

TEST(GemmTiles, ForcedByEnvironment) {
  ASSERT_EQ(setenv("TDIST_GEMM_TILE", "64x128x64_s8_c1", 1), 0);
  EXPECT_EQ(tdist::choose_gemm_tile(8192, 8192, 8192, 132), (GemmTile{64, 128, 64, 8, 1}));
  // A forced tile of another height than the one asked for is passed over.
  EXPECT_EQ(tdist::choose_gemm_tile(8192, 8192, 8192, 132, false, 128), (GemmTile{128, 256, 64, 4, 1}));
  ASSERT_EQ(setenv("TDIST_GEMM_TILE", "128x96x64_s4_c1", 1), 0);
  try {
    tdist::choose_gemm_tile(8192, 8192, 8192, 132);
    ADD_FAILURE() << "an unshipped tile was accepted";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("TDIST_GEMM_TILE='128x96x64_s4_c1' names no shipped tile"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("128x256x64_s4_c1"), std::string::npos) << e.what();
  }
  unsetenv("TDIST_GEMM_TILE");
  EXPECT_EQ(tdist::choose_gemm_tile(8192, 8192, 8192, 132), (GemmTile{128, 256, 64, 4, 1}));
  // The FP8 tiles have their own variable; a bf16 tile's name is not one of them.
  ASSERT_EQ(setenv("TDIST_GEMM_FP8_TILE", "64x128x128_s8_c1", 1), 0);
  EXPECT_EQ(tdist::choose_fp8_gemm_tile(8192, 8192, 132), (GemmTile{64, 128, 128, 8, 1}));
  ASSERT_EQ(setenv("TDIST_GEMM_FP8_TILE", "128x256x64_s4_c1", 1), 0);
  try {
    tdist::choose_fp8_gemm_tile(8192, 8192, 132);
    ADD_FAILURE() << "a bf16 tile was accepted as an FP8 one";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("TDIST_GEMM_FP8_TILE='128x256x64_s4_c1' names no shipped tile"),
              std::string::npos)
        << e.what();
  }
  unsetenv("TDIST_GEMM_FP8_TILE");
  EXPECT_EQ(tdist::choose_fp8_gemm_tile(8192, 8192, 132).block_m, 128);
}

TEST(GemmLaunch, ConfigScheduleAndTensorMaps) {
  GemmArgs a = tdist::check_gemm_args(valid());  // 1000 x 520 x 72
  const GemmTile t{128, 256, 64, 4, 1};
  auto cfg = tdist::gemm_launch_config(a, t, 132, 0, nullptr);
  EXPECT_EQ(cfg.grid.x, 8u * 3u);  // fewer tiles than SMs: one CTA per tile
  EXPECT_EQ(cfg.block.x, 384u);
  EXPECT_EQ(cfg.shared_bytes, tdist::gemm_shared_bytes(t, DType::kBFloat16));
  EXPECT_EQ(cfg.cluster.x, 1u);
  EXPECT_EQ(tdist::gemm_launch_config(a, t, 132, 5, nullptr).grid.x, 5u);
  a.m = a.n = 8192;
  EXPECT_EQ(tdist::gemm_launch_config(a, t, 132, 0, nullptr).grid.x, 132u);

  GemmArgs b = tdist::check_gemm_args(valid());
  auto sched = tdist::gemm_schedule(b, t, 8, 300);  // row 300 is in m-tile 2
  EXPECT_EQ(sched.tiles_m, 8u);
  EXPECT_EQ(sched.tiles_n, 3u);
  EXPECT_EQ(sched.first_tile_m, 2u);
  EXPECT_EQ(sched.group_m, 8u);
  expect_arg_error([&] { tdist::gemm_schedule(b, t, 0, 0); }, "group_m");

  // K = 72: rows 144 bytes apart, 16-byte aligned only: 128-byte L2 promotion; 32-byte rows keep 256.
  EXPECT_EQ(tdist::gemm_tensor_map_a(b, t).l2_promotion_bytes, 128u);
  EXPECT_EQ(tdist::gemm_tensor_map_b(b, t).l2_promotion_bytes, 128u);
  b.lda = 80;
  auto ma = tdist::gemm_tensor_map_a(b, t);
  EXPECT_EQ(ma.l2_promotion_bytes, 256u);
  b.a = reinterpret_cast<const void*>(0x10010);  // a 16-byte aligned base: every row unaligned
  EXPECT_EQ(tdist::gemm_tensor_map_a(b, t).l2_promotion_bytes, 128u);
  b.a = reinterpret_cast<const void*>(0x10000);
  EXPECT_EQ(ma.base, b.a);
  EXPECT_EQ(ma.dims[0], 72u);
  EXPECT_EQ(ma.dims[1], 1000u);
  EXPECT_EQ(ma.row_stride_bytes, 160u);
  EXPECT_EQ(ma.box[0], 64u);
  EXPECT_EQ(ma.box[1], 128u);
  EXPECT_EQ(ma.swizzle_bytes, 128u);
  auto mb = tdist::gemm_tensor_map_b(b, t);
  EXPECT_EQ(mb.dims[1], 520u);
  EXPECT_EQ(mb.row_stride_bytes, 144u);
  EXPECT_EQ(mb.box[1], 256u);
  EXPECT_EQ(mb.swizzle_bytes, 128u);
  // A 2-CTA cluster: each CTA loads half of B's rows (and multicasts them); the grid is whole clusters.
  const GemmTile pair{128, 256, 64, 4, 2};
  EXPECT_EQ(tdist::gemm_tensor_map_b(b, pair).box[1], 128u);
  EXPECT_EQ(tdist::gemm_tensor_map_a(b, pair).box[1], 128u);
  const auto pair_cfg = tdist::gemm_launch_config(b, pair, 132, 5, nullptr);
  EXPECT_EQ(pair_cfg.cluster.x, 2u);
  EXPECT_EQ(pair_cfg.grid.x, 4u);
  GemmArgs one_tile = b;
  one_tile.m = 100;
  one_tile.n = 200;
  EXPECT_EQ(tdist::gemm_launch_config(one_tile, pair, 132, 0, nullptr).grid.x, 2u);  // one tile: a whole cluster
  // D: dims {N rounded down to 8, M} (TMA clips in 16-byte units; the kernel stores the N % 8 tail
  // columns itself), one warpgroup's 64 x 64 chunk.
  b.n = 517;
  b.ldd = 528;
  auto md = tdist::gemm_tensor_map_d(b, t);
  EXPECT_EQ(md.base, b.d);
  EXPECT_EQ(md.dims[0], 512u);
  EXPECT_EQ(md.dims[1], 1000u);
  EXPECT_EQ(md.row_stride_bytes, 1056u);
  EXPECT_EQ(md.box[0], 64u);
  EXPECT_EQ(md.box[1], 64u);
  EXPECT_EQ(md.swizzle_bytes, 128u);
  b.n = 5;  // no full 16-byte unit: the map is unused, 8 columns keep it encodable
  EXPECT_EQ(tdist::gemm_tensor_map_d(b, t).dims[0], 8u);
  b.n = 517;
  auto md32 = tdist::gemm_tensor_map_d(b, GemmTile{128, 160, 64, 4, 1});
  EXPECT_EQ(md32.box[0], 32u);
  EXPECT_EQ(md32.swizzle_bytes, 64u);
  auto md16 = tdist::gemm_tensor_map_d(b, GemmTile{64, 48, 64, 4, 1});
  EXPECT_EQ(md16.box[0], 16u);
  EXPECT_EQ(md16.box[1], 64u);
  EXPECT_EQ(md16.swizzle_bytes, 32u);
}

TEST(GemmKernels, Registered) {
  bool found = false;
  for (const auto& f : jit::registered_kernels()) {
    if (f.name != "gemm") continue;
    found = true;
    const auto reqs = f.requests();
    size_t tiles = 0;  // every shipped tile, and the 2-CTA cluster of the 128-row ones
    for (const GemmTile& t : tdist::gemm_tiles()) tiles += t.block_m == 128 ? 2 : 1;
    EXPECT_EQ(reqs.size(), tiles);
    for (const auto& r : reqs) {
      EXPECT_TRUE(r.arch.empty());
      EXPECT_EQ(r.name_expressions.size(), 2u);
    }
  }
  EXPECT_TRUE(found) << "the gemm family is not registered";
}

// Compiles every shipped instance (bf16 and fp16) for sm_90a and checks what ptxas and the PTX say.
TEST(GemmKernels, EveryInstanceCompilesForSm90aWithoutSpills) {
  TempDir cache, dump;
  ASSERT_EQ(setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1), 0);
  jit::KernelCache kernels(cache.path);
  const std::regex used(R"(Used (\d+) registers)");
  // The shipped tiles and the 2-CTA clusters of the 128-row ones.
  const std::vector<GemmTile> instances = tdist::detail::PlainGemm::instance_tiles();
  for (const GemmTile& t : instances) {
    SCOPED_TRACE(t.name());
    jit::CompileRequest r = tdist::gemm_compile_request(t);
    r.compiler = jit::CompilerKind::kNvrtc;
    const auto compiled = jit::compile(r, kernels);
    ASSERT_FALSE(compiled->cubin.empty());
    for (const auto& name : r.name_expressions) EXPECT_FALSE(compiled->lowered_name(name).empty()) << name;
    EXPECT_EQ(compiled->spill_stores, 0);
    EXPECT_EQ(compiled->spill_loads, 0);
    const std::string& log = compiled->log;
    EXPECT_EQ(log.find("C7510"), std::string::npos) << "wgmma serialised:\n" << log;  // any C75xx warning
    EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << log;
    const std::regex stack(R"((\d+) bytes stack frame)");
    for (auto it = std::sregex_iterator(log.begin(), log.end(), stack); it != std::sregex_iterator(); ++it)
      EXPECT_EQ((*it)[1].str(), "0") << "stack frame (local memory):\n" << log;
    // Registers: the launch allocation (registers x threads) must hold the setmaxnreg split, and fit
    // the register file at one CTA per SM.
    const unsigned threads = tdist::gemm_threads(t);
    const int consumers = t.block_m / 64;
    int functions = 0;
    for (auto it = std::sregex_iterator(log.begin(), log.end(), used); it != std::sregex_iterator(); ++it) {
      ++functions;
      const int regs = std::stoi((*it)[1]);
      EXPECT_LE(static_cast<long>(regs) * threads, 65536L) << log;
      if (consumers >= 2) EXPECT_GE(static_cast<long>(regs) * threads, 40L * 128 + 232L * 128 * consumers) << log;
    }
    EXPECT_EQ(functions, 2) << log;
  }
  unsetenv("TDIST_JIT_DUMP");
  // The PTX of each module holds the instructions the design is built on.
  int ptx_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dump.path)) {
    if (e.path().extension() != ".ptx") continue;
    ++ptx_files;
    const std::string ptx = read(e.path());
    const std::string file = e.path().filename().string();
    SCOPED_TRACE(file);
    EXPECT_NE(ptx.find("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"),
              std::string::npos);
    EXPECT_NE(ptx.find("mbarrier.try_wait.parity"), std::string::npos);
    EXPECT_NE(ptx.find(".f32.bf16.bf16"), std::string::npos);
    EXPECT_NE(ptx.find(".f32.f16.f16"), std::string::npos);
    const std::smatch m = [&] {
      std::smatch s;
      std::regex_search(file, s, std::regex(R"(gemm_sm90_(\d+)x(\d+)x)"));
      return s;
    }();
    ASSERT_EQ(m.size(), 3u);
    EXPECT_NE(ptx.find("wgmma.mma_async.sync.aligned.m64n" + m[2].str() + "k16"), std::string::npos);
    // Mainloop: one wgmma group stays in flight across K blocks.
    EXPECT_NE(ptx.find("wgmma.wait_group.sync.aligned 1;"), std::string::npos);
    // Epilogue: stmatrix into shared memory, proxy fence, TMA store in bulk groups; the only global
    // stores are the 2-byte ones of the N % 8 tail columns.
    EXPECT_NE(ptx.find("stmatrix.sync.aligned.m8n8.x4.shared.b16"), std::string::npos);
    EXPECT_NE(ptx.find("fence.proxy.async.shared::cta"), std::string::npos);
    EXPECT_NE(ptx.find("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"), std::string::npos);
    EXPECT_NE(ptx.find("cp.async.bulk.commit_group"), std::string::npos);
    EXPECT_NE(ptx.find("cp.async.bulk.wait_group.read"), std::string::npos);
    const std::regex global_store(R"(st(\.[a-z0-9]+)*\.global(\.[a-z0-9]+)*)");
    for (auto it = std::sregex_iterator(ptx.begin(), ptx.end(), global_store); it != std::sregex_iterator(); ++it)
      EXPECT_TRUE(it->str() == "st.global.u16" || it->str() == "st.global.b16") << it->str();
    EXPECT_EQ(ptx.find("st.local"), std::string::npos);
    EXPECT_EQ(ptx.find("ld.local"), std::string::npos);
    if (m[1].str() == "128") {
      EXPECT_NE(ptx.find("setmaxnreg.dec.sync.aligned.u32 40"), std::string::npos);
      EXPECT_NE(ptx.find("setmaxnreg.inc.sync.aligned.u32 232"), std::string::npos);
    }
    // A cluster: B multicast to both CTAs, consumers' releases on both CTAs' barriers, the cluster's
    // barrier after the initialisation; without one, none of them.
    const bool pair = file.find("_c2") != std::string::npos;
    EXPECT_EQ(ptx.find(".multicast::cluster") != std::string::npos, pair);
    EXPECT_EQ(ptx.find("mbarrier.arrive.shared::cluster.b64") != std::string::npos, pair);
    EXPECT_EQ(ptx.find("mapa.shared::cluster.u32") != std::string::npos, pair);
    // ... with the default (CTA-scope) release: a cluster-scope one ran the GEMM 1.7-2x slower.
    EXPECT_EQ(ptx.find("arrive.release.cluster"), std::string::npos);
    EXPECT_EQ(ptx.find("barrier.cluster.wait.acquire.aligned") != std::string::npos, pair);
  }
  EXPECT_EQ(ptx_files, static_cast<int>(instances.size()));
}

// The hook points: hooks that wait for a flag before a tile's loads and publish each tile (fence,
// then a flag per tile), as the fused ops do, compile into the kernel without spills or wgmma
// serialisation.
TEST(GemmKernels, TileHooksCompile) {
  TempDir cache;
  jit::KernelCache kernels(cache.path);
  jit::CompileRequest r;
  r.file_name = "gemm_hook.cu";
  r.source = R"(
#include "tdist/kernels/gemm/sm90_gemm.cuh"
struct TileFlagHook {
  unsigned long long* flags;
  unsigned long long value;
  template <typename Info>
  __device__ void before_loads(const Info& info) const {
    while (*reinterpret_cast<volatile unsigned long long*>(flags + info.coord.tile_m) < value) {
    }
  }
  template <typename Info>
  __device__ void after_store(const Info& info, unsigned thread, unsigned) const {
    if (thread == 0) {
      __threadfence();
      atomicExch(flags + info.linear, value);
    }
  }
};
// Waits before loads only: opts out of waiting for each tile's stores.
struct LoadWaitHook {
  static constexpr bool kNeedsStoredTile = false;
  unsigned long long* flags;
  template <typename Info>
  __device__ void before_loads(const Info& info) const {
    while (*reinterpret_cast<volatile unsigned long long*>(flags + info.coord.tile_m) == 0) {
    }
  }
  template <typename Info>
  __device__ void after_store(const Info&, unsigned, unsigned) const {}
};
namespace kg = tdist::kernels::gemm;
static_assert(kg::HooksNeedStoredTile<TileFlagHook>::value, "a publishing hook gets the stored tile");
static_assert(!kg::HooksNeedStoredTile<LoadWaitHook>::value, "kNeedsStoredTile = false opts out");
static_assert(!kg::HooksNeedStoredTile<kg::NoTileHooks>::value, "the plain GEMM does not wait for its stores");
)";
  r.arch = "sm_90a";
  r.compiler = jit::CompilerKind::kNvrtc;
  auto count = [](const std::string& text, const std::string& what) {
    int c = 0;
    for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++c;
    return c;
  };
  // Tiles with two epilogue buffers (128 x 256) and one (128 x 192, 5 stages), and a 64-row one
  // with 32-column D chunks.
  for (const GemmTile& t : {GemmTile{128, 256, 64, 4, 1}, GemmTile{128, 192, 64, 5, 1}, GemmTile{64, 160, 64, 4, 1}}) {
    SCOPED_TRACE(t.name());
    TempDir dump;
    ASSERT_EQ(setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1), 0);
    jit::CompileRequest rt = r;
    rt.file_name = "gemm_hook_" + t.name() + ".cu";
    rt.name_expressions = {tdist::gemm_kernel_name(DType::kBFloat16, t, "TileFlagHook")};
    const auto compiled = jit::compile(rt, kernels);
    unsetenv("TDIST_JIT_DUMP");
    EXPECT_EQ(compiled->spill_stores + compiled->spill_loads, 0);
    EXPECT_EQ(compiled->log.find("Potential Performance Loss"), std::string::npos) << compiled->log;
    // The hook runs only once the tile's TMA stores have completed (not just read shared memory).
    int ptx_files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dump.path)) {
      if (e.path().extension() != ".ptx") continue;
      ++ptx_files;
      const std::string ptx = read(e.path());
      // Once per tile before the hook, once before the kernel exits.
      EXPECT_EQ(count(ptx, "cp.async.bulk.wait_group 0;"), 2);
      EXPECT_NE(ptx.find("fence.proxy.async.global"), std::string::npos);
      EXPECT_NE(ptx.find("atom.global.exch"), std::string::npos);
    }
    EXPECT_EQ(ptx_files, 1);
  }
  // A hook that opts out: only the wait before the kernel exits.
  TempDir dump;
  ASSERT_EQ(setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1), 0);
  jit::CompileRequest rt = r;
  rt.file_name = "gemm_hook_load_wait.cu";
  rt.name_expressions = {tdist::gemm_kernel_name(DType::kBFloat16, GemmTile{}, "LoadWaitHook")};
  const auto compiled = jit::compile(rt, kernels);
  unsetenv("TDIST_JIT_DUMP");
  EXPECT_EQ(compiled->spill_stores + compiled->spill_loads, 0);
  EXPECT_EQ(compiled->log.find("Potential Performance Loss"), std::string::npos) << compiled->log;
  int ptx_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dump.path)) {
    if (e.path().extension() != ".ptx") continue;
    ++ptx_files;
    EXPECT_EQ(count(read(e.path()), "cp.async.bulk.wait_group 0;"), 1);
  }
  EXPECT_EQ(ptx_files, 1);
}

// ---------------- grouped GEMM and the typed runtime ----------------

namespace {

using tdist::GroupedGemmArgs;

// What ptxas reports of one sm90 GEMM module: no spills, no stack, no wgmma serialisation, and, for
// each of its `functions` kernels, registers within the register file at one CTA per SM and, with
// two consumer warpgroups, enough for the setmaxnreg split (40 producer, 232 per consumer).
template <typename Compiled>
void expect_clean_ptxas_report(const Compiled& compiled, int block_m, int functions) {
  EXPECT_EQ(compiled.spill_stores, 0);
  EXPECT_EQ(compiled.spill_loads, 0);
  const std::string& log = compiled.log;
  EXPECT_EQ(log.find("C7510"), std::string::npos) << "wgmma serialised:\n" << log;
  EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << log;
  const std::regex stack(R"((\d+) bytes stack frame)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), stack); it != std::sregex_iterator(); ++it)
    EXPECT_EQ((*it)[1].str(), "0") << "stack frame (local memory):\n" << log;
  const unsigned threads = 128u * (1 + block_m / 64);
  const std::regex used(R"(Used (\d+) registers)");
  int seen = 0;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), used); it != std::sregex_iterator(); ++it) {
    ++seen;
    const int regs = std::stoi((*it)[1]);
    EXPECT_LE(static_cast<long>(regs) * threads, 65536L) << log;
    if (block_m == 128) EXPECT_GE(static_cast<long>(regs) * threads, 40L * 128 + 232L * 128 * 2) << log;
  }
  EXPECT_EQ(seen, functions) << log;
}

GroupedGemmArgs valid_grouped() {
  GroupedGemmArgs a;
  a.a = reinterpret_cast<const void*>(0x10000);
  a.b = reinterpret_cast<const void*>(0x20000);
  a.d = reinterpret_cast<void*>(0x30000);
  a.offsets = reinterpret_cast<const void*>(0x40004);
  a.m = 4096;
  a.n = 520;
  a.k = 72;
  a.num_groups = 16;
  return a;
}

}  // namespace

TEST(GroupedGemmArgs, DefaultsAndAccepts) {
  GroupedGemmArgs a = tdist::check_grouped_gemm_args(valid_grouped());
  EXPECT_EQ(a.lda, 72);
  EXPECT_EQ(a.ldb, 72);
  EXPECT_EQ(a.ldd, 520);
  GroupedGemmArgs odd = valid_grouped();
  odd.n = 13;  // any N, with ldd padded
  odd.ldd = 16;
  odd.offsets_type = tdist::IndexType::kInt64;
  odd.offsets = reinterpret_cast<const void*>(0x40008);
  EXPECT_NO_THROW(tdist::check_grouped_gemm_args(odd));
  GroupedGemmArgs empty = valid_grouped();
  empty.m = 0;
  empty.offsets = nullptr;
  EXPECT_NO_THROW(tdist::check_grouped_gemm_args(empty));
}

TEST(GroupedGemmArgs, ErrorsNameTheArgument) {
  auto with = [](auto change) {
    GroupedGemmArgs a = valid_grouped();
    change(a);
    return [a] { tdist::check_grouped_gemm_args(a); };
  };
  expect_arg_error(with([](GroupedGemmArgs& a) { a.dtype = DType::kFloat32; }), "dtype");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.m = -5; }), "m");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.n = int64_t{1} << 31; }), "n");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.k = 0; }), "k");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.k = 68; }), "k");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.num_groups = 0; }), "num_groups");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.num_groups = -3; }), "num_groups");
  expect_arg_error(with([](GroupedGemmArgs& a) {
                     a.num_groups = 1 << 22;
                     a.n = 1024;
                   }),
                   "num_groups");  // G N >= 2^31
  expect_arg_error(with([](GroupedGemmArgs& a) { a.lda = 64; }), "lda");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.ldb = 76; }), "ldb");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.ldd = 516; }), "ldd");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.a = nullptr; }), "a");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.b = reinterpret_cast<const void*>(0x20008); }), "b");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.d = reinterpret_cast<void*>(0x30002); }), "d");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.offsets = nullptr; }), "offsets");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.offsets = reinterpret_cast<const void*>(0x40002); }), "offsets");
  expect_arg_error(with([](GroupedGemmArgs& a) { a.offsets_type = tdist::IndexType::kInt64; }),
                   "offsets");  // 4-aligned only
  expect_arg_error(with([](GroupedGemmArgs& a) {
                     a.num_groups = 0;
                     a.a = nullptr;
                   }),
                   "num_groups");  // named before the pointers
  // Gathered A: `a` is not read (null accepted); the index and the token rows are checked instead.
  auto gathered = [](GroupedGemmArgs& a) {
    a.a = nullptr;
    a.a_gather = tdist::kernels::gemm::RowGather{.token_of_row = reinterpret_cast<const int*>(0x50000),
                                                 .gathered = reinterpret_cast<const void*>(0x60000),
                                                 .ld_bytes = static_cast<uint64_t>(a.k) * 2};
  };
  EXPECT_NO_THROW(with(gathered)());
  expect_arg_error(with([&](GroupedGemmArgs& a) {
                     gathered(a);
                     a.a_gather->token_of_row = reinterpret_cast<const int*>(0x50002);
                   }),
                   "a_gather.token_of_row");
  expect_arg_error(with([&](GroupedGemmArgs& a) {
                     gathered(a);
                     a.a_gather->gathered = nullptr;
                   }),
                   "a_gather.gathered");
  expect_arg_error(with([&](GroupedGemmArgs& a) {
                     gathered(a);
                     a.a_gather->local_rows = 3;  // local rows without a local pointer
                   }),
                   "a_gather.local");
  expect_arg_error(with([&](GroupedGemmArgs& a) {
                     gathered(a);
                     a.a_gather->ld_bytes = static_cast<uint64_t>(a.k) * 2 - 16;  // shorter than a row
                   }),
                   "a_gather.ld_bytes");
  expect_arg_error(with([&](GroupedGemmArgs& a) {
                     gathered(a);
                     a.a_gather->ld_bytes += 8;  // not 16-byte rows
                   }),
                   "a_gather.ld_bytes");
  // Schedule options.
  const GroupedGemmArgs ok = tdist::check_grouped_gemm_args(valid_grouped());
  expect_arg_error([&] { tdist::grouped_gemm_schedule(ok, GemmTile{}, {.group_m = 0}); }, "group_m");
  expect_arg_error([&] { tdist::grouped_gemm_schedule(ok, GemmTile{}, {.first_row = -1}); }, "first_row");
  expect_arg_error([&] { tdist::grouped_gemm_schedule(ok, GemmTile{96, 128, 64, 4, 1}, {}); }, "tile");
  tdist::GroupedGemmRunOptions bad_order;
  bad_order.m_tile_order = reinterpret_cast<const uint32_t*>(0x50002);
  expect_arg_error([&] { tdist::grouped_gemm_schedule(ok, GemmTile{}, bad_order); }, "m_tile_order");
}

TEST(GroupedGemmArgs, OffsetsAndSchedule) {
  EXPECT_EQ(tdist::grouped_gemm_alignment(), 128);
  const std::vector<int64_t> offs = tdist::grouped_gemm_offsets({0, 1, 128, 129, 0, 300});
  EXPECT_EQ(offs, (std::vector<int64_t>{0, 0, 128, 256, 512, 512, 896}));
  EXPECT_NO_THROW(tdist::check_grouped_gemm_offsets(offs, 896));
  expect_arg_error([&] { tdist::check_grouped_gemm_offsets(offs, 895); }, "offsets");
  expect_arg_error([] { tdist::check_grouped_gemm_offsets({0, 128, 64 + 128}, 1000); }, "offsets");
  expect_arg_error([] { tdist::check_grouped_gemm_offsets({0, 256, 128}, 1000); }, "offsets");
  expect_arg_error([] { tdist::check_grouped_gemm_offsets({128, 256}, 1000); }, "offsets");
  expect_arg_error([] { tdist::check_grouped_gemm_offsets({0}, 1000); }, "offsets");
  expect_arg_error([] { tdist::grouped_gemm_offsets({5, -1}); }, "counts");

  const GroupedGemmArgs a = tdist::check_grouped_gemm_args(valid_grouped());  // 4096 x 520, 16 groups
  const GemmTile t{128, 256, 64, 4, 1};
  const auto s = tdist::grouped_gemm_schedule(a, t, {.group_m = 4, .first_row = 300});
  EXPECT_EQ(s.offsets, a.offsets);
  EXPECT_EQ(s.offset_bytes, 4u);
  EXPECT_EQ(s.num_groups, 16u);
  EXPECT_EQ(s.block_m, 128u);
  EXPECT_EQ(s.max_tiles_m, 32u);
  EXPECT_EQ(s.tiles_n, 3u);
  EXPECT_EQ(s.group_m, 4u);
  EXPECT_EQ(s.first_tile_m, 2u);
  EXPECT_EQ(s.m_tile_order, nullptr);
  // The launch covers M_total's tiles (the offsets are only known on the device).
  const auto cfg = tdist::gemm_launch_config(tdist::grouped_gemm_problem(a), t, 132, 0, nullptr);
  EXPECT_EQ(cfg.grid.x, 32u * 3u < 132u ? 32u * 3u : 132u);
  // B's tensor map spans the G x N rows.
  EXPECT_EQ(tdist::gemm_tensor_map_b_rows(tdist::grouped_gemm_problem(a), t, 16 * 520).dims[1], 16u * 520u);
}

TEST(GemmRuntime, NamesAndRequests) {
  namespace kg = tdist::kernels::gemm;
  using tdist::detail::GemmRuntime;
  const GemmTile t{128, 192, 64, 5, 1};
  // The plain instance keeps the names and the request of the free functions (and the JIT cache).
  EXPECT_EQ(tdist::detail::PlainGemm::kernel_name(DType::kBFloat16, t), tdist::gemm_kernel_name(DType::kBFloat16, t));
  const auto plain = tdist::detail::PlainGemm::compile_request(t);
  const auto legacy = tdist::gemm_compile_request(t);
  EXPECT_EQ(plain.source, legacy.source);
  EXPECT_EQ(plain.file_name, legacy.file_name);
  EXPECT_EQ(plain.name_expressions, legacy.name_expressions);
  EXPECT_EQ(plain.file_name, "gemm_sm90_128x192x64_s5_c1.cu");
  // A hooked instance names its device hooks type once, through the traits.
  using AgGemm = tdist::detail::HookedGemm<kg::AllGatherWaitParams>;
  EXPECT_EQ(AgGemm::kernel_name(DType::kFloat16, t),
            "tdist::kernels::gemm::sm90_gemm_tn<__half, 128, 192, 64, 5, 1, tdist::kernels::gemm::AllGatherWaitHooks>");
  EXPECT_EQ(AgGemm::kernel_name(DType::kFloat16, t),
            tdist::gemm_kernel_name(DType::kFloat16, t, "tdist::kernels::gemm::AllGatherWaitHooks"));
  const auto ag = AgGemm::compile_request(t);
  EXPECT_NE(ag.source.find("tdist/kernels/gemm/overlap.cuh"), std::string::npos);
  EXPECT_EQ(ag.file_name, "gemm_sm90_128x192x64_s5_c1_AllGatherWaitHooks.cu");
  EXPECT_EQ(ag.arch, "sm_90a");
  // Hooked instances take no cluster: an error before anything reaches the GPU.
  static_assert(!AgGemm::kClusters && tdist::detail::HookedGemm<kg::NoTileHooks>::kClusters);
  AgGemm hooked(132);
  expect_arg_error(
      [&] {
        hooked.launch(tdist::check_gemm_args(valid()), GemmTile{128, 192, 64, 5, 2}, 520, kg::TileScheduler{},
                      kg::AllGatherWaitParams{}, 0, nullptr);
      },
      "tile");
  const auto rs = tdist::detail::HookedGemm<kg::ChunkPublishParams>::compile_request(t);
  EXPECT_EQ(rs.name_expressions.size(), 2u);
  EXPECT_NE(rs.name_expressions[0].find("ChunkPublishHooks>"), std::string::npos);
  // The grouped instance names its scheduler after the hooks.
  EXPECT_EQ(tdist::grouped_gemm_kernel_name(DType::kBFloat16, t),
            "tdist::kernels::gemm::sm90_gemm_tn<__nv_bfloat16, 128, 192, 64, 5, 1, tdist::kernels::gemm::NoTileHooks, "
            "tdist::kernels::gemm::GroupedScheduler>");
  EXPECT_EQ(tdist::grouped_gemm_kernel_name(DType::kFloat16, t, /*gathered_a=*/true),
            "tdist::kernels::gemm::sm90_gemm_tn<__half, 128, 192, 64, 5, 1, tdist::kernels::gemm::NoTileHooks, "
            "tdist::kernels::gemm::GatherGroupedScheduler>");
  // One plain and one gathered-A instance per shipped tile, and for both the 2-CTA cluster of the
  // 128-row ones.
  const auto reqs = tdist::grouped_gemm_compile_requests();
  size_t rows128 = 0;
  for (const GemmTile& s : tdist::gemm_tiles()) rows128 += s.block_m == 128;
  ASSERT_EQ(reqs.size(), 2 * (tdist::gemm_tiles().size() + rows128));
  size_t gathered = 0, pairs = 0;
  for (const auto& r : reqs) {
    EXPECT_TRUE(r.arch.empty());
    EXPECT_NE(r.file_name.find("_grouped"), std::string::npos) << r.file_name;
    gathered += r.file_name.find("_grouped_gather") != std::string::npos;
    pairs += r.file_name.find("_c2_") != std::string::npos;
  }
  EXPECT_EQ(gathered, tdist::gemm_tiles().size() + rows128);
  EXPECT_EQ(pairs, 2 * rows128);
  // The runtimes with clusters: no hooks, or the MoE ops' gathered-A waits; none for the dense
  // fused ops' hooks.
  static_assert(tdist::detail::GemmRuntime<kg::GatherGroupedScheduler, kg::MoeGatherWaitParams>::kClusters);
  static_assert(!tdist::detail::HookedGemm<kg::ChunkPublishParams>::kClusters);
  bool found = false;
  for (const auto& f : jit::registered_kernels()) found = found || f.name == "grouped_gemm";
  EXPECT_TRUE(found) << "the grouped_gemm family is not registered";
}

// Every grouped instance (bf16 and fp16) compiles for sm_90a without spills, stack or wgmma
// serialisation, within the register split, with B loaded at the group's rows.
TEST(GroupedGemmKernels, EveryInstanceCompilesForSm90aWithoutSpills) {
  TempDir cache, dump;
  ASSERT_EQ(setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1), 0);
  jit::KernelCache kernels(cache.path);
  for (jit::CompileRequest r : tdist::grouped_gemm_compile_requests()) {
    SCOPED_TRACE(r.file_name);
    r.arch = "sm_90a";
    r.compiler = jit::CompilerKind::kNvrtc;
    const auto compiled = jit::compile(r, kernels);
    ASSERT_FALSE(compiled->cubin.empty());
    for (const auto& name : r.name_expressions) EXPECT_FALSE(compiled->lowered_name(name).empty()) << name;
    const std::smatch m = [&] {
      std::smatch s;
      std::regex_search(r.file_name, s, std::regex(R"(gemm_sm90_(\d+)x(\d+)x)"));
      return s;
    }();
    ASSERT_EQ(m.size(), 3u);
    expect_clean_ptxas_report(*compiled, std::stoi(m[1].str()), 2);
  }
  unsetenv("TDIST_JIT_DUMP");
  int ptx_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dump.path)) {
    if (e.path().extension() != ".ptx") continue;
    ++ptx_files;
    const std::string ptx = read(e.path());
    SCOPED_TRACE(e.path().filename().string());
    EXPECT_NE(ptx.find("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"),
              std::string::npos);
    EXPECT_NE(ptx.find("wgmma.wait_group.sync.aligned 1;"), std::string::npos);
    EXPECT_NE(ptx.find("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"), std::string::npos);
    EXPECT_EQ(ptx.find("st.local"), std::string::npos);
    EXPECT_EQ(ptx.find("ld.local"), std::string::npos);
    // The gathered-A instances load A with zero-filling cp.async that arrive on the stage's barrier.
    const bool gathers = e.path().filename().string().find("_grouped_gather") != std::string::npos;
    EXPECT_EQ(ptx.find("cp.async.cg.shared.global") != std::string::npos, gathers);
    EXPECT_EQ(ptx.find("cp.async.mbarrier.arrive.noinc.shared::cta.b64") != std::string::npos, gathers);
    const bool pair = e.path().filename().string().find("_c2_") != std::string::npos;
    EXPECT_EQ(ptx.find(".multicast::cluster") != std::string::npos, pair);
  }
  EXPECT_EQ(ptx_files, static_cast<int>(tdist::grouped_gemm_compile_requests().size()));
}

// ---------------- FP8 grouped GEMM ----------------

namespace {

using tdist::GroupedGemmFp8Args;

GroupedGemmFp8Args valid_fp8() {
  GroupedGemmFp8Args a;
  a.a = reinterpret_cast<const void*>(0x10000);
  a.a_scales = reinterpret_cast<const float*>(0x50004);
  a.b = reinterpret_cast<const void*>(0x20000);
  a.b_scales = reinterpret_cast<const float*>(0x60004);
  a.d = reinterpret_cast<void*>(0x30000);
  a.offsets = reinterpret_cast<const void*>(0x40004);
  a.m = 4096;
  a.n = 520;
  a.k = 400;  // not a multiple of 128: the last scale block is partial
  a.num_groups = 16;
  return a;
}

}  // namespace

TEST(GroupedGemmFp8Args, DefaultsAndAccepts) {
  const GroupedGemmFp8Args a = tdist::check_grouped_gemm_fp8_args(valid_fp8());
  EXPECT_EQ(a.lda, 400);
  EXPECT_EQ(a.ldb, 400);
  EXPECT_EQ(a.ldd, 520);
  EXPECT_EQ(a.a_scales_row_stride, 4);  // row-major [M][ceil(400 / 128)]
  EXPECT_EQ(a.a_scales_kb_stride, 1);
  GroupedGemmFp8Args column_major = valid_fp8();
  column_major.a_scales_row_stride = 1;
  column_major.a_scales_kb_stride = 4096;
  const GroupedGemmFp8Args c = tdist::check_grouped_gemm_fp8_args(column_major);
  EXPECT_EQ(c.a_scales_row_stride, 1);
  EXPECT_EQ(c.a_scales_kb_stride, 4096);
  GroupedGemmFp8Args empty = valid_fp8();
  empty.m = 0;
  empty.a = nullptr;
  empty.a_scales = nullptr;
  EXPECT_NO_THROW(tdist::check_grouped_gemm_fp8_args(empty));
}

TEST(GroupedGemmFp8Args, ErrorsNameTheArgument) {
  auto with = [](auto change) {
    GroupedGemmFp8Args a = valid_fp8();
    change(a);
    return [a] { tdist::check_grouped_gemm_fp8_args(a); };
  };
  expect_arg_error(with([](auto& a) { a.num_groups = 0; }), "num_groups");
  expect_arg_error(with([](auto& a) { a.k = 72; }), "k");  // a multiple of 8, not of 16
  expect_arg_error(with([](auto& a) { a.m = -1; }), "m");
  expect_arg_error(with([](auto& a) { a.lda = 408; }), "lda");
  expect_arg_error(with([](auto& a) { a.ldb = 384; }), "ldb");
  expect_arg_error(with([](auto& a) { a.ldd = 500; }), "ldd");
  expect_arg_error(with([](auto& a) { a.a_scales_row_stride = -4; }), "a_scales_row_stride");
  expect_arg_error(with([](auto& a) { a.a_scales_kb_stride = -1; }), "a_scales_kb_stride");
  expect_arg_error(with([](auto& a) { a.a = reinterpret_cast<const void*>(0x10008); }), "a");
  expect_arg_error(with([](auto& a) { a.b = nullptr; }), "b");
  expect_arg_error(with([](auto& a) { a.d = reinterpret_cast<void*>(0x30002); }), "d");
  expect_arg_error(with([](auto& a) { a.a_scales = nullptr; }), "a_scales");
  expect_arg_error(with([](auto& a) { a.b_scales = reinterpret_cast<const float*>(0x60002); }), "b_scales");
  expect_arg_error(with([](auto& a) { a.offsets = nullptr; }), "offsets");
  expect_arg_error(with([](auto& a) { a.num_groups = 1 << 30; }), "num_groups");
}

// Gathered A: the index's fields and the local tokens' scales are checked; `a` and lda are not read.
TEST(GroupedGemmFp8Args, GatheredA) {
  tdist::kernels::gemm::RowGather g;
  g.token_of_row = reinterpret_cast<const int*>(0x70000);
  g.gathered = reinterpret_cast<const void*>(0x80000);
  g.local = reinterpret_cast<const void*>(0x90000);
  g.local_begin = 100;
  g.local_rows = 50;
  g.ld_bytes = 416;  // >= k = 400 e4m3 bytes, a multiple of 16
  auto with = [&](auto change) {
    GroupedGemmFp8Args a = valid_fp8();
    a.a = nullptr;
    a.lda = 7;
    a.a_gather = g;
    a.a_scales_local = reinterpret_cast<const float*>(0xa0000);
    change(a);
    return a;
  };
  const GroupedGemmFp8Args ok = tdist::check_grouped_gemm_fp8_args(with([](auto&) {}));
  EXPECT_EQ(ok.a, g.gathered);
  EXPECT_EQ(ok.lda, 400);
  auto bad = [&](auto change) { return [a = with(change)] { tdist::check_grouped_gemm_fp8_args(a); }; };
  expect_arg_error(bad([](auto& a) { a.a_scales_local = nullptr; }), "a_scales_local");
  expect_arg_error(bad([](auto& a) { a.a_gather->ld_bytes = 392; }), "a_gather.ld_bytes");
  expect_arg_error(bad([](auto& a) { a.a_gather->token_of_row = nullptr; }), "a_gather.token_of_row");
  expect_arg_error(bad([](auto& a) { a.a_gather->local = nullptr; }), "a_gather.local");
  // No local tokens: no local scales needed.
  EXPECT_NO_THROW(tdist::check_grouped_gemm_fp8_args(with([](auto& a) {
    a.a_gather->local_rows = 0;
    a.a_scales_local = nullptr;
  })));
}

TEST(Fp8GemmTiles, ShippedTilesAreValidAndChosen) {
  for (const GemmTile& t : tdist::fp8_gemm_tiles()) {
    SCOPED_TRACE(t.name());
    EXPECT_NO_THROW(tdist::check_fp8_gemm_tile(t));
    EXPECT_LE(tdist::fp8_gemm_shared_bytes(t), tdist::kernels::gemm::kMaxSmemBytes);
  }
  // The 128 x 128 tile: a 6-stage ring of 32 KiB operand stages and 528-byte scale stages beside one
  // 8 KiB bf16 chunk per warpgroup (two do not fit).
  EXPECT_EQ(tdist::fp8_gemm_shared_bytes({128, 128, 128, 6, 1}), 1024u + 6 * (32768 + 528) + 2 * 8192 + 2 * 6 * 8);
  expect_arg_error([] { tdist::check_fp8_gemm_tile({128, 256, 128, 3, 1}); }, "tile");  // two B scales per tile
  expect_arg_error([] { tdist::check_fp8_gemm_tile({128, 128, 64, 6, 1}); }, "tile");
  expect_arg_error([] { tdist::check_fp8_gemm_tile({128, 128, 128, 7, 1}); }, "tile");  // shared memory
  // Large problems take the big tile; few rows the 64-row one.
  EXPECT_EQ(tdist::choose_fp8_gemm_tile(16384, 4096, 132).block_m, 128);
  EXPECT_EQ(tdist::choose_fp8_gemm_tile(16384, 4096, 132).block_n, 128);
  EXPECT_EQ(tdist::choose_fp8_gemm_tile(64, 16384, 132).block_m, 64);
  EXPECT_NE(tdist::grouped_gemm_fp8_kernel_name({128, 128, 128, 6, 1}).find("sm90_fp8_gemm_tn<128, 128, 6, "),
            std::string::npos);
  using tdist::Fp8GroupedKernel;
  EXPECT_NE(tdist::grouped_gemm_fp8_kernel_name({128, 128, 128, 6, 1}, Fp8GroupedKernel::kGatheredA)
                .find(", tdist::kernels::gemm::GatherGroupedScheduler>"),
            std::string::npos);
  EXPECT_NE(tdist::grouped_gemm_fp8_kernel_name({128, 64, 128, 8, 1}, Fp8GroupedKernel::kGatheredAWaiting)
                .find("sm90_fp8_gemm_tn<128, 64, 8, tdist::kernels::gemm::GatherGroupedScheduler, "
                      "tdist::kernels::gemm::MoeGatherWaitHooks>"),
            std::string::npos);
  // The waiting instance's request brings the hooks' header; the family's requests leave it out.
  const auto waiting =
      tdist::grouped_gemm_fp8_compile_request({128, 128, 128, 6, 1}, Fp8GroupedKernel::kGatheredAWaiting);
  EXPECT_NE(waiting.source.find("tdist/kernels/gemm/overlap.cuh"), std::string::npos);
  EXPECT_NE(waiting.file_name.find("MoeGatherWaitHooks"), std::string::npos);
  for (const auto& r : tdist::grouped_gemm_fp8_compile_requests())
    EXPECT_EQ(r.file_name.find("Hooks"), std::string::npos) << r.file_name;
}

// Every FP8 instance (TMA and gathered A, each tile) compiles for sm_90a without spills, stack or
// wgmma serialisation, within the register split, with e4m3 wgmma of K 32, each block's group waited
// for before its scaling.
TEST(GroupedGemmFp8Kernels, EveryInstanceCompilesForSm90aWithoutSpills) {
  TempDir cache, dump;
  ASSERT_EQ(setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1), 0);
  jit::KernelCache kernels(cache.path);
  const auto requests = tdist::grouped_gemm_fp8_compile_requests();
  ASSERT_EQ(requests.size(), 2 * tdist::fp8_gemm_tiles().size());
  for (jit::CompileRequest r : requests) {
    SCOPED_TRACE(r.file_name);
    r.arch = "sm_90a";
    r.compiler = jit::CompilerKind::kNvrtc;
    const auto compiled = jit::compile(r, kernels);
    ASSERT_FALSE(compiled->cubin.empty());
    for (const auto& name : r.name_expressions) EXPECT_FALSE(compiled->lowered_name(name).empty()) << name;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.file_name, m, std::regex(R"(gemm_sm90_fp8_(\d+)x(\d+)x128_)")));
    expect_clean_ptxas_report(*compiled, std::stoi(m[1].str()), 1);
  }
  unsetenv("TDIST_JIT_DUMP");
  int ptx_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dump.path)) {
    if (e.path().extension() != ".ptx") continue;
    ++ptx_files;
    const std::string ptx = read(e.path());
    SCOPED_TRACE(e.path().filename().string());
    EXPECT_NE(ptx.find(".f32.e4m3.e4m3"), std::string::npos);
    EXPECT_NE(ptx.find("wgmma.wait_group.sync.aligned 0;"), std::string::npos);
    EXPECT_EQ(ptx.find("wgmma.wait_group.sync.aligned 1;"), std::string::npos);
    EXPECT_NE(ptx.find("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"), std::string::npos);
    EXPECT_EQ(ptx.find("st.local"), std::string::npos);
    EXPECT_EQ(ptx.find("ld.local"), std::string::npos);
  }
  EXPECT_EQ(ptx_files, static_cast<int>(2 * tdist::fp8_gemm_tiles().size()));
}

// ---------------- FP8 row quantisation ----------------

TEST(Fp8Quantize, DefaultsAndErrorsNameTheArgument) {
  using tdist::Fp8QuantizeArgs;
  auto valid = [] {
    Fp8QuantizeArgs a;
    a.x = reinterpret_cast<const void*>(0x10000);
    a.q = reinterpret_cast<void*>(0x20000);
    a.scales = reinterpret_cast<float*>(0x30004);
    a.rows = 300;
    a.k = 208;  // two scale blocks, the second partial
    return a;
  };
  const Fp8QuantizeArgs d = tdist::check_fp8_quantize_args(valid());
  EXPECT_EQ(d.ldx, 208);
  EXPECT_EQ(d.ldq, 208);
  EXPECT_EQ(d.scale_ld, 2);
  EXPECT_EQ(d.scale_kb_stride, 1);
  Fp8QuantizeArgs column_major = valid();  // [KB][304]: rows padded to 4
  column_major.scale_ld = 1;
  column_major.scale_kb_stride = 304;
  const Fp8QuantizeArgs c = tdist::check_fp8_quantize_args(column_major);
  EXPECT_EQ(c.scale_ld, 1);
  EXPECT_EQ(c.scale_kb_stride, 304);
  Fp8QuantizeArgs glu = valid();
  glu.swiglu = true;
  EXPECT_EQ(tdist::check_fp8_quantize_args(glu).ldx, 416);  // gate and up columns
  Fp8QuantizeArgs empty = valid();
  empty.rows = 0;
  empty.x = nullptr;
  EXPECT_NO_THROW(tdist::check_fp8_quantize_args(empty));
  auto with = [&](auto change) {
    Fp8QuantizeArgs a = valid();
    change(a);
    return [a] { tdist::check_fp8_quantize_args(a); };
  };
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.dtype = DType::kFloat8E4M3; }), "dtype");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.k = 200; }), "k");  // not a multiple of 16
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.rows = -1; }), "rows");
  expect_arg_error(with([](Fp8QuantizeArgs& a) {
                     a.swiglu = true;
                     a.ldx = 208;  // holds the gate only
                   }),
                   "ldx");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.ldq = 216; }), "ldq");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.scale_ld = 1; }), "scale_ld");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.scale_kb_stride = 4; }), "scale_ld");  // blocks and rows overlap
  expect_arg_error(with([](Fp8QuantizeArgs& a) {
                     a.scale_ld = 1;
                     a.scale_kb_stride = 296;  // fewer than the rows
                   }),
                   "scale_kb_stride");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.x = reinterpret_cast<const void*>(0x10008); }), "x");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.q = nullptr; }), "q");
  expect_arg_error(with([](Fp8QuantizeArgs& a) { a.scales = reinterpret_cast<float*>(0x30002); }), "scales");
}

// Every instance (bf16, fp16, fp32 rows; plain and SwiGLU) compiles for sm_90a without spills or
// local memory, converting with the saturating round-to-nearest e4m3 instruction.
TEST(Fp8Quantize, KernelsCompileForSm90a) {
  TempDir cache, dump;
  ASSERT_EQ(setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1), 0);
  jit::KernelCache kernels(cache.path);
  const auto requests = tdist::fp8_quantize_compile_requests();
  ASSERT_EQ(requests.size(), 1u);
  jit::CompileRequest r = requests[0];
  r.arch = "sm_90a";
  r.compiler = jit::CompilerKind::kNvrtc;
  const auto compiled = jit::compile(r, kernels);
  unsetenv("TDIST_JIT_DUMP");
  ASSERT_FALSE(compiled->cubin.empty());
  EXPECT_EQ(r.name_expressions.size(), 6u);
  for (const auto& name : r.name_expressions) EXPECT_FALSE(compiled->lowered_name(name).empty()) << name;
  EXPECT_EQ(compiled->spill_stores + compiled->spill_loads, 0) << compiled->log;
  int ptx_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dump.path)) {
    if (e.path().extension() != ".ptx") continue;
    ++ptx_files;
    const std::string ptx = read(e.path());
    EXPECT_NE(ptx.find("cvt.rn.satfinite.e4m3x2.f32"), std::string::npos);
    EXPECT_EQ(ptx.find("ld.local"), std::string::npos);
    EXPECT_EQ(ptx.find("st.local"), std::string::npos);
  }
  EXPECT_EQ(ptx_files, 1);
}
