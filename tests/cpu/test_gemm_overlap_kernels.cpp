// The overlap ops' device code without a GPU: every registered program (flag wait, fp32 reduction,
// the persistent GEMM with the AllGather wait hooks and the chunk publish hooks, each shipped tile,
// and the MoE AllGather's grouped GEMM with its source-wait hooks) compiles for sm_90a through NVRTC, and the hooks
// cost the GEMM nothing ptxas reports: no spills, no stack frame, no wgmma serialisation (a call such as the wait's
// timeout diagnostic in the kernel would cause one).
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "cpu/jit_programs.hpp"

namespace jit = tdist::jit;
using tdist::test::compile_family_for_sm90a;

namespace {

// What ptxas says of a hooked GEMM instance: no wgmma serialisation, no stack frame.
void expect_hooks_cost_nothing(const jit::CompiledKernel& compiled) {
  const std::string& log = compiled.log;
  EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << "wgmma serialised:\n" << log;
  const std::regex stack(R"((\d+) bytes stack frame)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), stack); it != std::sregex_iterator(); ++it)
    EXPECT_EQ((*it)[1].str(), "0") << "stack frame (local memory):\n" << log;
}

}  // namespace

TEST(GemmOverlapKernels, RegisteredProgramsCompileCleanForSm90a) {
  int hooked = 0;
  const int programs =
      compile_family_for_sm90a("gemm_overlap", [&](const jit::CompileRequest& r, const jit::CompiledKernel& compiled) {
        if (r.file_name.find("Hooks") == std::string::npos) return;  // the hooked GEMM instances only, below
        ++hooked;
        expect_hooks_cost_nothing(compiled);
      });
  EXPECT_GE(programs, 3);
  EXPECT_GE(hooked, 2);
}

// The fused MoE AllGather's gathered-A grouped GEMM with the source-wait hooks: every tile of
// BLOCK_M 128, bf16 / fp16 (also with the 2-CTA cluster) and FP8.
TEST(GemmOverlapKernels, MoeFusedGemmCompilesCleanForSm90a) {
  int fp8 = 0, pairs = 0;
  const int programs = compile_family_for_sm90a(
      "moe_fused_gemm", [&](const jit::CompileRequest& r, const jit::CompiledKernel& compiled) {
        EXPECT_NE(r.file_name.find("grouped_gather"), std::string::npos) << r.file_name;
        EXPECT_NE(r.file_name.find("MoeGatherWaitHooks"), std::string::npos) << r.file_name;
        fp8 += r.file_name.find("_fp8_") != std::string::npos;
        pairs += r.file_name.find("_c2_") != std::string::npos;
        expect_hooks_cost_nothing(compiled);
      });
  EXPECT_EQ(programs, 10);  // the shipped tiles of BLOCK_M 128: four bf16 / fp16 and their clusters, two FP8
  EXPECT_EQ(fp8, 2);
  EXPECT_EQ(pairs, 4);
}
