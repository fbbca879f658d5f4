// The CPU tests' check of a registered kernel family's device code without a GPU: every program of
// the family compiles for sm_90a through NVRTC, lowers every name expression and spills nothing.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "cpu/temp_dir.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/registry.hpp"

namespace tdist::test {

// Compiles every program of family `family` (into a fresh cache), checks it as above, then calls
// more(request, compiled) for the caller's own checks; returns how many programs there were.
template <typename More>
int compile_family_for_sm90a(const std::string& family, More&& more) {
  TempDir cache;
  jit::KernelCache kernels(cache.path);
  int programs = 0;
  for (const auto& f : jit::registered_kernels()) {
    if (f.name != family) continue;
    for (jit::CompileRequest r : f.requests()) {
      SCOPED_TRACE(r.file_name);
      ++programs;
      r.arch = "sm_90a";
      r.compiler = jit::CompilerKind::kNvrtc;
      const auto compiled = jit::compile(r, kernels);
      EXPECT_FALSE(compiled->cubin.empty());
      if (compiled->cubin.empty()) continue;
      for (const auto& name : r.name_expressions) EXPECT_FALSE(compiled->lowered_name(name).empty()) << name;
      EXPECT_EQ(compiled->spill_stores + compiled->spill_loads, 0) << compiled->log;
      more(r, *compiled);
    }
  }
  return programs;
}

inline int compile_family_for_sm90a(const std::string& family) {
  return compile_family_for_sm90a(family, [](const jit::CompileRequest&, const jit::CompiledKernel&) {});
}

}  // namespace tdist::test
