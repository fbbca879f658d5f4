// Collectives without a GPU: the method-selection table, per-call and environment overrides,
// argument checks, and that every collective kernel instance compiles for sm_90a through NVRTC.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpu/errors.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"
#include "cpu/collective_shapes.hpp"
#include "tdist/ops/detail/collective_select.hpp"
#include "tdist/ops/collectives.hpp"

using namespace tdist;

using tdist::test::error_of;

namespace {

using test::KiB;
using test::kLimits;
using test::MiB;
using test::shape;

}  // namespace

TEST(CollectiveSelect, AllReduceTable) {
  EXPECT_EQ(select_all_reduce(shape(1 * KiB), kLimits), AllReduceMethod::kLowLatency);
  EXPECT_EQ(select_all_reduce(shape(64 * KiB), kLimits), AllReduceMethod::kLowLatency);
  // Two ranks: LL128 to 1 MB, then one-shot, which beats two-shot at every measured size.
  EXPECT_EQ(select_all_reduce(shape(64 * KiB + 16), kLimits), AllReduceMethod::kLowLatency128);
  EXPECT_EQ(select_all_reduce(shape(128 * KiB), kLimits), AllReduceMethod::kLowLatency128);
  EXPECT_EQ(select_all_reduce(shape(512 * KiB), kLimits), AllReduceMethod::kLowLatency128);
  EXPECT_EQ(select_all_reduce(shape(1 * MiB), kLimits), AllReduceMethod::kLowLatency128);
  EXPECT_EQ(select_all_reduce(shape(1 * MiB + 16), kLimits), AllReduceMethod::kOneShot);
  EXPECT_EQ(select_all_reduce(shape(128 * MiB - 16), kLimits), AllReduceMethod::kOneShot);
  EXPECT_EQ(select_all_reduce(shape(128 * MiB), kLimits), AllReduceMethod::kCe);
  // From 128 MB: the copy-engine ReduceScatter then AllGather, when the ranks' slices are whole elements.
  EXPECT_EQ(select_all_reduce(shape(256 * MiB), kLimits), AllReduceMethod::kCe);
  EXPECT_EQ(select_all_reduce(shape(512 * MiB), CollectiveLimits{1024 * MiB, 256 * KiB}), AllReduceMethod::kCe);
  EXPECT_EQ(select_all_reduce(shape(512 * MiB + 2), CollectiveLimits{1024 * MiB, 256 * KiB}),
            AllReduceMethod::kOneShot);  // 2^28 + 1 bf16 elements: odd
  // Beyond the workspace: NCCL, never an error.
  EXPECT_EQ(select_all_reduce(shape(1024 * MiB), kLimits), AllReduceMethod::kNccl);
  EXPECT_EQ(select_all_reduce(shape(256 * MiB, 4), kLimits), AllReduceMethod::kCe);
  EXPECT_EQ(select_all_reduce(shape(256 * MiB - 4, 4), kLimits),
            AllReduceMethod::kTwoShot);                               // 2^27 - 2 elements, 4 ranks
  EXPECT_TRUE(feasible(AllReduceMethod::kCe, shape(6, 3), kLimits));  // 3 bf16 elements, one per rank
  EXPECT_FALSE(feasible(AllReduceMethod::kCe, shape(8, 3), kLimits));
  EXPECT_FALSE(feasible(AllReduceMethod::kCe, shape(256 * MiB + 12), kLimits));  // beyond the workspace
  // Larger teams: narrower LL and one-shot windows.
  EXPECT_EQ(select_all_reduce(shape(64 * KiB, 8), kLimits), AllReduceMethod::kOneShot);
  EXPECT_EQ(select_all_reduce(shape(16 * KiB, 8), kLimits), AllReduceMethod::kLowLatency);
  EXPECT_EQ(select_all_reduce(shape(128 * KiB, 8), kLimits), AllReduceMethod::kTwoShot);
  EXPECT_EQ(select_all_reduce(shape(32 * KiB, 4), kLimits), AllReduceMethod::kLowLatency);
  // A single rank has nothing to exchange: NCCL's copy.
  EXPECT_EQ(select_all_reduce(shape(1 * KiB, 1), kLimits), AllReduceMethod::kNccl);
  // A small LL buffer narrows the LL window.
  EXPECT_EQ(select_all_reduce(shape(64 * KiB), CollectiveLimits{256 * MiB, 16 * KiB}), AllReduceMethod::kOneShot);
  EXPECT_EQ(select_all_reduce(shape(64 * KiB), CollectiveLimits{256 * MiB, 16 * KiB, 1 * MiB}),
            AllReduceMethod::kLowLatency128);
  // A small LL128 buffer narrows the LL128 window; larger teams (unmeasured) do not take LL128.
  EXPECT_EQ(select_all_reduce(shape(1 * MiB), CollectiveLimits{256 * MiB, 256 * KiB, 768 * KiB}),
            AllReduceMethod::kOneShot);
  EXPECT_EQ(select_all_reduce(shape(1 * MiB, 4), kLimits), AllReduceMethod::kTwoShot);
  EXPECT_TRUE(feasible(AllReduceMethod::kLowLatency128, shape(1 * MiB, 8), kLimits));
  EXPECT_FALSE(feasible(AllReduceMethod::kLowLatency128, shape(1 * MiB + 16), kLimits));
}

TEST(CollectiveSelect, AllGatherTable) {
  EXPECT_EQ(select_all_gather(shape(2 * KiB), kLimits), AllGatherMethod::kLowLatency);
  EXPECT_EQ(select_all_gather(shape(64 * KiB), kLimits), AllGatherMethod::kLowLatency);
  EXPECT_EQ(select_all_gather(shape(512 * KiB), kLimits), AllGatherMethod::kLowLatency);  // 256 KB per rank
  EXPECT_EQ(select_all_gather(shape(1 * MiB), kLimits), AllGatherMethod::kSm);
  // Ordinary buffers: ce_push staged through the workspace from 64 MB while the workspace holds it.
  EXPECT_EQ(select_all_gather(shape(32 * MiB), kLimits), AllGatherMethod::kSm);
  EXPECT_EQ(select_all_gather(shape(64 * MiB), kLimits), AllGatherMethod::kCePush);
  EXPECT_EQ(select_all_gather(shape(256 * MiB), kLimits), AllGatherMethod::kCePush);
  EXPECT_EQ(select_all_gather(shape(256 * MiB + 16), kLimits), AllGatherMethod::kSm);  // beyond the workspace
  EXPECT_EQ(select_all_gather(shape(64 * MiB, 2, false, true), kLimits), AllGatherMethod::kSmPush);
  // A symmetric output: the SM push below 128 MB, the copy engine from there.
  EXPECT_EQ(select_all_gather(shape(128 * MiB - 16, 2, false, true), kLimits), AllGatherMethod::kSmPush);
  EXPECT_EQ(select_all_gather(shape(128 * MiB, 2, false, true), kLimits), AllGatherMethod::kCePush);
  EXPECT_EQ(select_all_gather(shape(32 * MiB, 2, false, true), kLimits), AllGatherMethod::kSmPush);
  EXPECT_EQ(select_all_gather(shape(1 * MiB, 2, false, true), kLimits), AllGatherMethod::kSmPush);
  EXPECT_EQ(select_all_gather(shape(512 * KiB, 2, false, true), kLimits), AllGatherMethod::kLowLatency);
  EXPECT_EQ(select_all_gather(shape(2048 * MiB, 2, false, true), kLimits), AllGatherMethod::kCePush);
  EXPECT_EQ(select_all_gather(shape(256 * MiB, 2, false, true), kLimits), AllGatherMethod::kCePush);
  EXPECT_EQ(select_all_gather(shape(256 * MiB, 2, true, false), kLimits), AllGatherMethod::kCePull);
  EXPECT_EQ(select_all_gather(shape(16 * MiB, 2, true, true), kLimits), AllGatherMethod::kSmPush);
  EXPECT_EQ(select_all_gather(shape(16 * MiB, 2, true, false), kLimits), AllGatherMethod::kSm);
  EXPECT_EQ(select_all_gather(shape(32 * MiB, 2, true, false), kLimits), AllGatherMethod::kCePull);
  EXPECT_EQ(select_all_gather(shape(512 * MiB, 2), kLimits), AllGatherMethod::kSm);     // 256 MB per rank: fits
  EXPECT_EQ(select_all_gather(shape(1024 * MiB, 2), kLimits), AllGatherMethod::kNccl);  // 512 MB per rank: does not
  EXPECT_EQ(select_all_gather(shape(2048 * MiB, 2), kLimits), AllGatherMethod::kNccl);
  EXPECT_EQ(select_all_gather(shape(2048 * MiB, 2, true, false), kLimits), AllGatherMethod::kCePull);
}

TEST(CollectiveSelect, ReduceScatterTable) {
  // Two ranks: LL up to 512 KB of input (256 KB per rank: the default LL buffer), where NCCL beat the
  // fused kernel; fused above.
  EXPECT_EQ(select_reduce_scatter(shape(1 * KiB), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(4), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(256 * KiB), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(512 * KiB), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(512 * KiB, 2, true, true), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(512 * KiB + 16), kLimits), ReduceScatterMethod::kFused);
  EXPECT_EQ(select_reduce_scatter(shape(1 * MiB), kLimits), ReduceScatterMethod::kFused);
  EXPECT_EQ(select_reduce_scatter(shape(128 * MiB), kLimits), ReduceScatterMethod::kFused);
  EXPECT_EQ(select_reduce_scatter(shape(512 * MiB), kLimits), ReduceScatterMethod::kNccl);
  EXPECT_EQ(select_reduce_scatter(shape(512 * MiB, 2, true), kLimits), ReduceScatterMethod::kFused);
  // From 256 MB the pipelined copy-engine method, where the workspace holds the input.
  EXPECT_EQ(select_reduce_scatter(shape(256 * MiB), kLimits), ReduceScatterMethod::kCe);
  const CollectiveLimits big{2048 * MiB, 256 * KiB, 1 * MiB};
  EXPECT_EQ(select_reduce_scatter(shape(512 * MiB), big), ReduceScatterMethod::kCe);
  EXPECT_EQ(select_reduce_scatter(shape(1024 * MiB, 2, true, true), big), ReduceScatterMethod::kCe);
  EXPECT_EQ(select_reduce_scatter(shape(128 * MiB), big), ReduceScatterMethod::kFused);
  // Larger teams (unmeasured): 256 KB at 3-4 ranks, 128 KB at 5-8; then the choice without LL.
  EXPECT_EQ(select_reduce_scatter(shape(256 * KiB, 4), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(384 * KiB, 3), kLimits), ReduceScatterMethod::kNccl);
  EXPECT_EQ(select_reduce_scatter(shape(512 * KiB, 4), kLimits), ReduceScatterMethod::kFused);
  EXPECT_EQ(select_reduce_scatter(shape(128 * KiB, 8), kLimits), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(256 * KiB, 8), kLimits), ReduceScatterMethod::kNccl);
  EXPECT_EQ(select_reduce_scatter(shape(1 * MiB, 8), kLimits), ReduceScatterMethod::kFused);
  // A single rank has nothing to exchange: NCCL's copy.
  EXPECT_EQ(select_reduce_scatter(shape(1 * KiB, 1), kLimits), ReduceScatterMethod::kNccl);
  // An LL buffer too small for the per-rank slice: the choice without LL (NCCL below 512 KB).
  const CollectiveLimits small_ll{256 * MiB, 16 * KiB};
  EXPECT_EQ(select_reduce_scatter(shape(32 * KiB), small_ll), ReduceScatterMethod::kLowLatency);  // 16 KB per rank
  EXPECT_EQ(select_reduce_scatter(shape(32 * KiB + 16), small_ll), ReduceScatterMethod::kNccl);
  EXPECT_EQ(select_reduce_scatter(shape(256 * KiB), small_ll), ReduceScatterMethod::kNccl);
  EXPECT_EQ(select_reduce_scatter(shape(64 * KiB, 4), small_ll), ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(select_reduce_scatter(shape(128 * KiB, 4), small_ll), ReduceScatterMethod::kNccl);
  // Feasibility of ll: the per-rank slice against the LL buffer.
  EXPECT_TRUE(feasible(ReduceScatterMethod::kLowLatency, shape(512 * KiB), kLimits));
  EXPECT_FALSE(feasible(ReduceScatterMethod::kLowLatency, shape(512 * KiB + 16), kLimits));
  EXPECT_TRUE(feasible(ReduceScatterMethod::kLowLatency, shape(1 * MiB, 4), kLimits));
  EXPECT_FALSE(feasible(ReduceScatterMethod::kLowLatency, shape(2 * MiB, 4), kLimits));
}

TEST(CollectiveSelect, OverridesAndEnvironment) {
  // Per call wins over the environment; the environment wins over auto.
  EXPECT_EQ(resolve_all_reduce(AllReduceMethod::kNccl, "one_shot", shape(1 * KiB), kLimits), AllReduceMethod::kNccl);
  EXPECT_EQ(resolve_all_reduce(AllReduceMethod::kAuto, "two_shot", shape(1 * KiB), kLimits), AllReduceMethod::kTwoShot);
  EXPECT_EQ(resolve_all_reduce(AllReduceMethod::kAuto, "NCCL", shape(1 * KiB), kLimits), AllReduceMethod::kNccl);
  EXPECT_EQ(resolve_all_reduce(AllReduceMethod::kAuto, "", shape(1 * KiB), kLimits), AllReduceMethod::kLowLatency);
  EXPECT_EQ(resolve_all_reduce(AllReduceMethod::kAuto, nullptr, shape(2 * MiB), kLimits), AllReduceMethod::kOneShot);
  EXPECT_EQ(resolve_all_reduce(AllReduceMethod::kAuto, "LL128", shape(4 * KiB), kLimits),
            AllReduceMethod::kLowLatency128);
  EXPECT_EQ(resolve_all_gather(AllGatherMethod::kAuto, "ce_push", shape(1 * MiB), kLimits), AllGatherMethod::kCePush);
  EXPECT_EQ(resolve_reduce_scatter(ReduceScatterMethod::kAuto, "ce", shape(1 * MiB), kLimits),
            ReduceScatterMethod::kCe);
  EXPECT_EQ(resolve_reduce_scatter(ReduceScatterMethod::kAuto, "LL", shape(4 * KiB), kLimits),
            ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(resolve_reduce_scatter(ReduceScatterMethod::kAuto, "nccl", shape(4 * KiB), kLimits),
            ReduceScatterMethod::kNccl);
  EXPECT_EQ(resolve_reduce_scatter(ReduceScatterMethod::kLowLatency, "fused", shape(4 * KiB), kLimits),
            ReduceScatterMethod::kLowLatency);
  EXPECT_EQ(resolve_reduce_scatter(ReduceScatterMethod::kAuto, nullptr, shape(4 * KiB), kLimits),
            ReduceScatterMethod::kLowLatency);
  // Bad names name the variable.
  EXPECT_NE(error_of([] {
              resolve_all_reduce(AllReduceMethod::kAuto, "three_shot", shape(1 * KiB), kLimits);
            }).find("TDIST_ALLREDUCE_METHOD"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_all_gather_method("bogus"); }).find("method"), std::string::npos);
  EXPECT_NE(error_of([] {
              parse_reduce_scatter_method("x", "TDIST_REDUCESCATTER_METHOD");
            }).find("TDIST_REDUCESCATTER_METHOD"),
            std::string::npos);
  // Infeasible explicit methods fail with the reason, naming the argument or the variable.
  const std::string e1 =
      error_of([] { resolve_all_reduce(AllReduceMethod::kLowLatency, nullptr, shape(1 * MiB), kLimits); });
  EXPECT_NE(e1.find("'method'"), std::string::npos) << e1;
  EXPECT_NE(e1.find("low-latency"), std::string::npos) << e1;
  const std::string e1b =
      error_of([] { resolve_all_reduce(AllReduceMethod::kLowLatency128, nullptr, shape(2 * MiB), kLimits); });
  EXPECT_NE(e1b.find("'method'"), std::string::npos) << e1b;
  EXPECT_NE(e1b.find("ll128_bytes"), std::string::npos) << e1b;
  const std::string e2 =
      error_of([] { resolve_all_reduce(AllReduceMethod::kAuto, "one_shot", shape(1024 * MiB), kLimits); });
  EXPECT_NE(e2.find("TDIST_ALLREDUCE_METHOD"), std::string::npos) << e2;
  EXPECT_NE(e2.find("workspace"), std::string::npos) << e2;
  EXPECT_NE(error_of([] { resolve_all_gather(AllGatherMethod::kCePush, nullptr, shape(1024 * MiB), kLimits); }), "");
  // ll ReduceScatter beyond the LL buffer (per-rank slice over ll_bytes): the argument or the variable.
  const std::string e3 =
      error_of([] { resolve_reduce_scatter(ReduceScatterMethod::kLowLatency, nullptr, shape(2 * MiB), kLimits); });
  EXPECT_NE(e3.find("'method'"), std::string::npos) << e3;
  EXPECT_NE(e3.find("low-latency"), std::string::npos) << e3;
  EXPECT_NE(e3.find("ll_bytes"), std::string::npos) << e3;
  const std::string e4 =
      error_of([] { resolve_reduce_scatter(ReduceScatterMethod::kAuto, "ll", shape(2 * MiB), kLimits); });
  EXPECT_NE(e4.find("TDIST_REDUCESCATTER_METHOD"), std::string::npos) << e4;
  EXPECT_EQ(resolve_all_gather(AllGatherMethod::kCePush, nullptr, shape(1024 * MiB, 2, false, true), kLimits),
            AllGatherMethod::kCePush);
  const std::string e6 =
      error_of([] { resolve_all_gather(AllGatherMethod::kSmPush, nullptr, shape(64 * MiB, 2, true, false), kLimits); });
  EXPECT_NE(e6.find("'method'"), std::string::npos) << e6;
  EXPECT_NE(e6.find("'out' must be a symmetric buffer"), std::string::npos) << e6;
  EXPECT_TRUE(feasible(AllGatherMethod::kSmPush, shape(64 * MiB, 2, false, true), kLimits));
  const std::string e5 =
      error_of([] { resolve_all_reduce(AllReduceMethod::kCe, nullptr, shape(6 * KiB + 2), kLimits); });
  EXPECT_NE(e5.find("'method'"), std::string::npos) << e5;
  EXPECT_NE(e5.find("do not split evenly over 2 ranks"), std::string::npos) << e5;
  // Round trips of every name.
  for (auto m :
       {AllReduceMethod::kAuto, AllReduceMethod::kOneShot, AllReduceMethod::kTwoShot, AllReduceMethod::kLowLatency,
        AllReduceMethod::kLowLatency128, AllReduceMethod::kNccl, AllReduceMethod::kCe})
    EXPECT_EQ(parse_all_reduce_method(to_string(m)), m);
  for (auto m : {AllGatherMethod::kAuto, AllGatherMethod::kSm, AllGatherMethod::kSmPush, AllGatherMethod::kCePush,
                 AllGatherMethod::kCePull, AllGatherMethod::kLowLatency, AllGatherMethod::kNccl})
    EXPECT_EQ(parse_all_gather_method(to_string(m)), m);
  for (auto m : {ReduceScatterMethod::kAuto, ReduceScatterMethod::kFused, ReduceScatterMethod::kCe,
                 ReduceScatterMethod::kLowLatency, ReduceScatterMethod::kNccl})
    EXPECT_EQ(parse_reduce_scatter_method(to_string(m)), m);
}

TEST(CollectiveSelect, DTypes) {
  EXPECT_EQ(parse_dtype("bf16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("FP16"), DType::kFloat16);
  EXPECT_EQ(parse_dtype("float32"), DType::kFloat32);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_NE(error_of([] { parse_dtype("int8"); }).find("'dtype'"), std::string::npos);
  EXPECT_NE(error_of([] { check_dtype(static_cast<DType>(7)); }).find("'dtype'"), std::string::npos);
  EXPECT_NO_THROW(check_dtype(DType::kFloat16));
}

TEST(CollectiveSelect, ArgumentChecks) {
  EXPECT_NE(error_of([] { check_count("all_reduce", 0); }).find("'count'"), std::string::npos);
  EXPECT_NO_THROW(check_count("all_reduce", 1));
  alignas(16) static char buf[4096];
  EXPECT_NE(error_of([] { check_buffers("all_reduce", nullptr, 16, buf, 16, buf); }).find("'in'"), std::string::npos);
  EXPECT_NE(error_of([] { check_buffers("all_reduce", buf, 16, nullptr, 16, nullptr); }).find("'out'"),
            std::string::npos);
  EXPECT_NO_THROW(check_buffers("all_reduce", buf, 64, buf, 64, buf));            // in place
  EXPECT_NO_THROW(check_buffers("all_reduce", buf, 64, buf + 64, 64, buf + 64));  // disjoint
  EXPECT_NE(error_of([] { check_buffers("all_reduce", buf, 64, buf + 32, 64, buf + 32); }).find("overlaps"),
            std::string::npos);
  // all_gather in place: in = out + rank * bytes.
  EXPECT_NO_THROW(check_buffers("all_gather", buf + 64, 64, buf, 128, buf + 64));
  EXPECT_NE(error_of([] { check_buffers("all_gather", buf + 32, 64, buf, 128, buf + 64); }), "");
  // An output too short for world_size x count running into a separate input is an overlap, named 'out'.
  EXPECT_NE(error_of([] { check_buffers("all_gather", buf + 96, 64, buf, 128, buf + 64); }).find("'out'"),
            std::string::npos);
  EXPECT_EQ(reduce_scatter_recv_count(12, 4), 3u);
  EXPECT_NE(error_of([] { reduce_scatter_recv_count(10, 4); }).find("'count'"), std::string::npos);
  // Zero-copy buffers lie wholly inside the heap or wholly outside.
  EXPECT_TRUE(check_symmetric_range("in", buf + 100, 100, buf, 1024));
  EXPECT_FALSE(check_symmetric_range("in", buf + 2048, 100, buf, 1024));
  EXPECT_NE(error_of([] { check_symmetric_range("out", buf + 1000, 100, buf, 1024); }).find("'out'"),
            std::string::npos);
  EXPECT_NE(error_of([] { check_symmetric_range("in", buf + 1000, 100, buf + 1024, 1024); }).find("'in'"),
            std::string::npos);
}

TEST(CollectiveSelect, NcclSymmetricKernelsAvoidedForUnalignedSymmetricBuffers) {
  // Both buffers in the heap's window and a per-rank size (or pointer) off 16 bytes: NCCL's symmetric
  // AllGather / ReduceScatter kernels are kept out by staging one side through ordinary memory.
  CollectiveShape s = shape(2 * 2002, 2, true, true);
  s.aligned16 = false;
  EXPECT_TRUE(nccl_avoid_symmetric_kernels(s));
  s.aligned16 = true;
  EXPECT_FALSE(nccl_avoid_symmetric_kernels(s));
  s.aligned16 = false;
  s.in_symmetric = false;  // one buffer outside the window: NCCL's regular kernels already
  EXPECT_FALSE(nccl_avoid_symmetric_kernels(s));
  s.in_symmetric = true;
  s.out_symmetric = false;
  EXPECT_FALSE(nccl_avoid_symmetric_kernels(s));
}

TEST(CollectiveKernels, EveryInstanceCompilesForSm90a) {
  bool registered = false;
  for (const auto& family : jit::registered_kernels()) registered |= family.name == "collectives";
  EXPECT_TRUE(registered) << "the collectives family is not registered for tdist-compile --all";
  jit::KernelCache cache("");  // memory only: compile every instance for real
  const auto reqs = collective_compile_requests();
  size_t instances = 0;
  for (auto req : reqs) {
    req.arch = "sm_90a";
    req.compiler = jit::CompilerKind::kNvrtc;
    std::shared_ptr<const jit::CompiledKernel> k;
    ASSERT_NO_THROW(k = jit::compile(req, cache)) << req.file_name;
    for (const auto& name : req.name_expressions) {
      EXPECT_FALSE(k->lowered_name(name).empty()) << name;
      ++instances;
    }
    EXPECT_EQ(k->spill_stores, 0) << req.file_name << "\n" << k->log;
    EXPECT_EQ(k->spill_loads, 0) << req.file_name << "\n" << k->log;
  }
  // 3 dtypes x (rs_fused, rs_ce_pipelined, ar_one_shot, ar_two_shot, ll_all_reduce, ll_reduce_scatter,
  // ll128_all_reduce) + ag_sm, ag_push, ll_all_gather, barrier.
  EXPECT_EQ(instances, 25u);
}
