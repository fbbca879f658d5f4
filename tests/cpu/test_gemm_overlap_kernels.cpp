// The overlap ops' device code without a GPU: every registered program (flag wait, fp32 reduction,
// and the persistent GEMM with the AllGather wait hooks and the chunk publish hooks, each shipped
// tile) compiles for sm_90a through NVRTC, and the hooks cost the GEMM nothing ptxas reports: no
// spills, no stack frame, no wgmma serialisation (a call such as the wait's timeout diagnostic in
// the kernel would cause one).
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "cpu/jit_programs.hpp"

namespace jit = tdist::jit;
using tdist::test::compile_family_for_sm90a;

TEST(GemmOverlapKernels, RegisteredProgramsCompileCleanForSm90a) {
  int hooked = 0;
  const int programs = compile_family_for_sm90a(
      "gemm_overlap", [&](const jit::CompileRequest& r, const jit::CompiledKernel& compiled) {
        if (r.file_name.find("Hooks") == std::string::npos) return;  // the hooked GEMM instances only, below
        ++hooked;
        const std::string& log = compiled.log;
        EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << "wgmma serialised:\n" << log;
        const std::regex stack(R"((\d+) bytes stack frame)");
        for (auto it = std::sregex_iterator(log.begin(), log.end(), stack); it != std::sregex_iterator(); ++it)
          EXPECT_EQ((*it)[1].str(), "0") << "stack frame (local memory):\n" << log;
      });
  EXPECT_GE(programs, 3);
  EXPECT_GE(hooked, 2);
}
