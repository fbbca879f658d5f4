// The overlap ops' device code without a GPU: every registered program (flag wait, fp32 reduction,
// and the persistent GEMM with the AllGather wait hooks and the chunk publish hooks, each shipped
// tile) compiles for sm_90a through NVRTC, and the hooks cost the GEMM nothing ptxas reports: no
// spills, no stack frame, no wgmma serialisation (a call such as the wait's timeout diagnostic in
// the kernel would cause one).
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "cpu/temp_dir.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"

namespace jit = tdist::jit;
using tdist::test::TempDir;

TEST(GemmOverlapKernels, RegisteredProgramsCompileCleanForSm90a) {
  TempDir cache;
  jit::KernelCache kernels(cache.path);
  int programs = 0, hooked = 0;
  for (const auto& family : jit::registered_kernels()) {
    if (family.name != "gemm_overlap") continue;
    for (jit::CompileRequest r : family.requests()) {
      SCOPED_TRACE(r.file_name);
      ++programs;
      r.arch = "sm_90a";
      r.compiler = jit::CompilerKind::kNvrtc;
      const auto compiled = jit::compile(r, kernels);
      ASSERT_FALSE(compiled->cubin.empty());
      for (const auto& name : r.name_expressions) EXPECT_FALSE(compiled->lowered_name(name).empty()) << name;
      EXPECT_EQ(compiled->spill_stores + compiled->spill_loads, 0) << compiled->log;
      if (r.file_name.find("Hooks") == std::string::npos) continue;  // the hooked GEMM instances only, below
      ++hooked;
      const std::string& log = compiled->log;
      EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << "wgmma serialised:\n" << log;
      const std::regex stack(R"((\d+) bytes stack frame)");
      for (auto it = std::sregex_iterator(log.begin(), log.end(), stack); it != std::sregex_iterator(); ++it)
        EXPECT_EQ((*it)[1].str(), "0") << "stack frame (local memory):\n" << log;
    }
  }
  EXPECT_GE(programs, 3);
  EXPECT_GE(hooked, 2);
}
