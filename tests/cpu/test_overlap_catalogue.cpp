// The catalogue of overlapped ops (include/tdist/ops/overlap_ops.hpp) without a GPU: its entries,
// the checks every call shares, the context cache's sizing and growth, and the typed symmetric
// layouts the ops' heap sizes come from.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "cpu/errors.hpp"
#include "tdist/common/error.hpp"
#include "tdist/ops/gemm_overlap.hpp"
#include "tdist/ops/overlap_ops.hpp"
#include "tdist/runtime/symmetric_layout.hpp"

using namespace tdist;
using tdist::test::error_of;

namespace {

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// A call of `op` with every operand at a distinct aligned fake address.
OverlapCall call_of(const OverlapOpTraits& op, int64_t m, int64_t n, int64_t k) {
  OverlapCall c;
  for (int i = 0; i < op.num_operands(); ++i) c.operands[i] = ptr((uintptr_t{1} << 30) * (i + 1));
  c.m = m;
  c.n = n;
  c.k = k;
  return c;
}

}  // namespace

TEST(OverlapCatalogue, HoldsTheOpsSortedAndWellFormed) {
  std::vector<std::string> names;
  for (const OverlapOpTraits* op : overlap_ops()) {
    names.push_back(op->name);
    ASSERT_GE(op->num_operands(), 2) << op->name;
    ASSERT_LE(op->num_operands(), kMaxOverlapOperands) << op->name;
    bool seen_output = false;
    for (const OperandTraits& o : op->operands) {
      if (o.role != OperandRole::kInput)
        seen_output = true;
      else
        EXPECT_FALSE(seen_output) << op->name << ": input '" << o.name << "' after an output";
      EXPECT_EQ(op->operand_index(o.name), &o - op->operands.data()) << op->name << " " << o.name;
    }
    EXPECT_TRUE(seen_output) << op->name;
    EXPECT_EQ(op->n_multiple % 8, 0) << op->name;
    EXPECT_EQ(&find_overlap_op(op->name), op);
    // A context of a mid-size config takes more heap than a tiny one, and the sizes are pure.
    const OverlapContextConfig big = overlap_context_for(*op, DType::kBFloat16, 4096, 4096, 4096);
    const OverlapContextConfig tiny = overlap_context_for(*op, DType::kBFloat16, 16, 16, 16);
    EXPECT_GT(op->heap_bytes(big, 2, 132), op->heap_bytes(tiny, 2, 132)) << op->name;
    EXPECT_EQ(op->heap_bytes(big, 2, 132), op->heap_bytes(big, 2, 132)) << op->name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"ag_gemm", "ag_gemm_swiglu", "gemm_ar", "gemm_rs"}));
  EXPECT_EQ(find_overlap_op("ag_gemm").operand_index("gathered"), 3);
  EXPECT_EQ(find_overlap_op("gemm_rs").operand_index("gathered"), -1);
}

TEST(OverlapCatalogue, UnknownNameListsTheKnownOnes) {
  const std::string e = error_of([] { find_overlap_op("gemm_a2a"); });
  EXPECT_NE(e.find("'op'"), std::string::npos) << e;
  EXPECT_NE(e.find("gemm_a2a"), std::string::npos) << e;
  EXPECT_NE(e.find("ag_gemm, ag_gemm_swiglu, gemm_ar, gemm_rs"), std::string::npos) << e;
  EXPECT_NE(error_of([] { find_overlap_op("x", "TDIST_OP"); }).find("'TDIST_OP'"), std::string::npos);
}

TEST(OverlapCatalogue, ExtentsFollowRowChunks) {
  const OverlapExtents e = overlap_extents(7, 24, 64, 3, 2);  // 7 rows over 3 ranks: 3, 2, 2
  EXPECT_EQ(e[Extent::kM], 7);
  EXPECT_EQ(e[Extent::kRows], 2);
  EXPECT_EQ(e[Extent::kN], 24);
  EXPECT_EQ(e[Extent::kHalfN], 12);
  EXPECT_EQ(e[Extent::kK], 64);
  EXPECT_EQ(overlap_extents(7, 24, 64, 3, 0).rows, 3);
  EXPECT_NE(error_of([] { overlap_extents(7, 8, 8, 2, 2); }).find("'rank'"), std::string::npos);
  EXPECT_NE(error_of([] { overlap_extents(-1, 8, 8, 2, 0); }).find("'m'"), std::string::npos);
}

TEST(OverlapCatalogue, CallChecksNameTheArgument) {
  const OverlapOpTraits& swiglu = find_overlap_op("ag_gemm_swiglu");
  const OverlapOpTraits& ag = find_overlap_op("ag_gemm");
  const OverlapOpTraits& rs = find_overlap_op("gemm_rs");
  EXPECT_NO_THROW(check_overlap_call(swiglu, DType::kBFloat16, call_of(swiglu, 1000, 528, 264), 2, 1));
  // N a multiple of 8 but not of the op's 16.
  std::string e = error_of([&] { check_overlap_call(swiglu, DType::kBFloat16, call_of(swiglu, 1000, 24, 264), 2, 0); });
  EXPECT_NE(e.find("'n'"), std::string::npos) << e;
  EXPECT_NE(e.find("16"), std::string::npos) << e;
  EXPECT_NO_THROW(check_overlap_call(ag, DType::kBFloat16, call_of(ag, 1000, 24, 264), 2, 0));
  e = error_of([&] { check_overlap_call(rs, DType::kFloat16, call_of(rs, 1000, 24, 12), 2, 0); });
  EXPECT_NE(e.find("'k'"), std::string::npos) << e;
  e = error_of([&] { check_overlap_call(rs, DType::kFloat32, call_of(rs, 1000, 24, 64), 2, 0); });
  EXPECT_NE(e.find("'dtype'"), std::string::npos) << e;
  // Operands by name: null, misaligned; an absent optional output and an empty operand are fine.
  OverlapCall c = call_of(ag, 1000, 24, 264);
  c.operands[3] = nullptr;
  EXPECT_NO_THROW(check_overlap_call(ag, DType::kBFloat16, c, 2, 0));
  c.operands[1] = nullptr;
  e = error_of([&] { check_overlap_call(ag, DType::kBFloat16, c, 2, 0); });
  EXPECT_NE(e.find("'b'"), std::string::npos) << e;
  c = call_of(ag, 1000, 24, 264);
  c.operands[2] = ptr((uintptr_t{1} << 30) + 8);
  e = error_of([&] { check_overlap_call(ag, DType::kBFloat16, c, 2, 0); });
  EXPECT_NE(e.find("'d'"), std::string::npos) << e;
  c = call_of(ag, 1, 24, 264);  // rank 1 owns no row of M = 1
  c.operands[0] = nullptr;
  EXPECT_NO_THROW(check_overlap_call(ag, DType::kBFloat16, c, 2, 1));
  EXPECT_NE(error_of([&] { check_overlap_call(ag, DType::kBFloat16, c, 2, 0); }).find("'a_local'"), std::string::npos);
}

TEST(OverlapCatalogue, ContextConfigsAndServing) {
  const OverlapOpTraits& ag = find_overlap_op("ag_gemm");
  const OverlapOpTraits& rs = find_overlap_op("gemm_rs");
  const OverlapOpTraits& swiglu = find_overlap_op("ag_gemm_swiglu");
  const OverlapContextConfig a = overlap_context_for(ag, DType::kBFloat16, 4096, 7168, 8192);
  EXPECT_EQ(a.max_m, 4096);
  EXPECT_EQ(a.max_n, 0);  // ag_gemm's buffers do not depend on N
  EXPECT_EQ(a.k, 8192);
  EXPECT_TRUE(overlap_context_serves(ag, a, overlap_context_for(ag, DType::kBFloat16, 100, 99999, 8192)));
  EXPECT_FALSE(overlap_context_serves(ag, a, overlap_context_for(ag, DType::kBFloat16, 100, 8, 4096)));
  EXPECT_FALSE(overlap_context_serves(ag, a, overlap_context_for(ag, DType::kFloat16, 100, 8, 8192)));
  const OverlapContextConfig r = overlap_context_for(rs, DType::kBFloat16, 4096, 8192, 7168);
  EXPECT_EQ(r.k, 0);  // any K
  EXPECT_TRUE(overlap_context_serves(rs, r, overlap_context_for(rs, DType::kBFloat16, 4096, 8192, 64)));
  EXPECT_FALSE(overlap_context_serves(rs, r, overlap_context_for(rs, DType::kBFloat16, 4096, 8200, 64)));
  const OverlapContextConfig s = overlap_context_for(swiglu, DType::kBFloat16, 64, 512, 256);
  EXPECT_FALSE(overlap_context_serves(swiglu, s, overlap_context_for(swiglu, DType::kBFloat16, 64, 528, 256)));
}

TEST(OverlapCatalogue, GrowthDoublesMAndFallsBackWhenTheHeapIsShort) {
  const OverlapOpTraits& rs = find_overlap_op("gemm_rs");
  const auto cfg = [&](int64_t m, int64_t n) { return overlap_context_for(rs, DType::kBFloat16, m, n, 64); };
  const size_t plenty = size_t{1} << 40;
  EXPECT_EQ(OverlapContextCache::grown_config(rs, nullptr, cfg(100, 64), plenty, 2, 132).max_m, 100);
  const OverlapContextConfig old = cfg(1000, 1024);
  OverlapContextConfig g = OverlapContextCache::grown_config(rs, &old, cfg(1200, 512), plenty, 2, 132);
  EXPECT_EQ(g.max_m, 2000);  // at least twice the old M
  EXPECT_EQ(g.max_n, 1024);  // N never shrinks
  g = OverlapContextCache::grown_config(rs, &old, cfg(5000, 512), plenty, 2, 132);
  EXPECT_EQ(g.max_m, 5000);
  g = OverlapContextCache::grown_config(rs, &old, cfg(800, 2048), plenty, 2, 132);
  EXPECT_EQ(g.max_m, 1000);  // grows in N only
  EXPECT_EQ(g.max_n, 2048);
  // Room for exactly this call's context: the call's own sizes.
  const size_t just = rs.heap_bytes(cfg(1200, 512), 2, 132);
  g = OverlapContextCache::grown_config(rs, &old, cfg(1200, 512), just, 2, 132);
  EXPECT_EQ(g.max_m, 1200);
  EXPECT_EQ(g.max_n, 512);
}

TEST(SymmetricLayout, RegionsAlignedAndSizedOnce) {
  SymmetricLayout l;
  const auto flags = l.add<uint64_t>(3, "flags");
  const auto rows = l.add<char>(1000, "rows");
  const auto tail = l.add<uint32_t>(1, "tail", 16);
  EXPECT_EQ(flags.offset, 0u);
  EXPECT_EQ(flags.bytes(), 24u);
  EXPECT_EQ(rows.offset, 256u);
  EXPECT_EQ(tail.offset, 1264u);
  EXPECT_EQ(l.bytes(), 1280u);  // rounded to the heap's alignment
  EXPECT_EQ(SymmetricLayout().bytes(), SymmetricHeap::kDefaultAlignment);
  char base[2048];
  EXPECT_EQ(reinterpret_cast<char*>(rows.at(base)), base + 256);
  const std::string e = error_of([&] { l.add<uint64_t>(SIZE_MAX / 4, "huge"); });
  EXPECT_NE(e.find("'huge'"), std::string::npos) << e;
  EXPECT_EQ(l.bytes(), 1280u);  // unchanged by the refused region
}

TEST(SymmetricLayout, HeapBytesOfTheOpsComeFromTheirLayouts) {
  // The AllGather-GEMM's gathered A is max_m x K elements: doubling max_m adds exactly that.
  const AllGatherGemmConfig a{.max_m = 1024, .k = 512, .dtype = DType::kBFloat16};
  const AllGatherGemmConfig b{.max_m = 2048, .k = 512, .dtype = DType::kBFloat16};
  EXPECT_EQ(all_gather_gemm_heap_bytes(b, 2, 132) - all_gather_gemm_heap_bytes(a, 2, 132) >= 1024u * 512 * 2, true);
  // GemmAllReduce = GemmReduceScatter + its reduced rows and flags.
  const GemmReduceScatterConfig r{.max_m = 1024, .max_n = 1024, .dtype = DType::kBFloat16};
  EXPECT_GE(gemm_all_reduce_heap_bytes(r, 2, 132) - gemm_reduce_scatter_heap_bytes(r, 2, 132), 1024u * 1024 * 2);
  // Bad configs throw naming the field, before any allocation.
  const std::string e = error_of([] { all_gather_gemm_heap_bytes({.max_m = 0, .k = 64}, 2, 132); });
  EXPECT_NE(e.find("'config.max_m'"), std::string::npos) << e;
}
