// tdist-compile fills a cache for sm_90a from a manifest (and from the library's registry);
// manifest parsing; the argument packer; launch paths fail cleanly without a GPU driver.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "cpu/temp_dir.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/launch.hpp"
#include "tdist/jit/manifest.hpp"
#include "tdist/jit/registry.hpp"

namespace jit = tdist::jit;

namespace {

using tdist::test::TempDir;

std::string run(const std::string& cmd, int& code) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

const std::string kTool = std::string(TDIST_BINARY_DIR) + "/tools/tdist-compile";

void write_project(const TempDir& proj) {
  proj.write("kernels/axpy.cu", R"(#include "axpy_params.cuh"
template <int kUnroll, typename T>
__global__ void axpy(T a, const T* x, T* y, int n) {
  int i = (blockIdx.x * blockDim.x + threadIdx.x) * kUnroll;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (i + u < n) y[i + u] += a * x[i + u] * T(kScale) + T(EXTRA);
}
)");
  proj.write("include/axpy_params.cuh", "#pragma once\nconstexpr int kScale = 1;\n");
  proj.write("kernels.manifest", R"(# kernels of a user project
[kernel]
source = kernels/axpy.cu
include = include
name = axpy<4, float>
name = axpy<8, float>
define = EXTRA=0

[kernel]
source = kernels/axpy.cu
include = include
name = axpy<2, double>
define = EXTRA=1
const = int kUnused = 3
flag = -maxrregcount=64
compiler = nvcc
)");
}

}  // namespace

TEST(JitTools, ManifestParses) {
  TempDir proj;
  write_project(proj);
  auto reqs = jit::load_manifest(proj.file("kernels.manifest"));
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(reqs[0].name_expressions, (std::vector<std::string>{"axpy<4, float>", "axpy<8, float>"}));
  EXPECT_EQ(reqs[0].defines, std::vector<std::string>{"EXTRA=0"});
  EXPECT_EQ(reqs[0].include_dirs, std::vector<std::string>{proj.file("include")});
  EXPECT_EQ(reqs[0].compiler, jit::CompilerKind::kAuto);
  EXPECT_EQ(reqs[1].compiler, jit::CompilerKind::kNvcc);
  ASSERT_EQ(reqs[1].constants.size(), 1u);
  EXPECT_EQ(reqs[1].constants[0].type, "int");
  EXPECT_EQ(reqs[1].constants[0].name, "kUnused");
  EXPECT_EQ(reqs[1].constants[0].value, "3");
  EXPECT_EQ(reqs[1].flags, std::vector<std::string>{"-maxrregcount=64"});

  EXPECT_THROW(jit::parse_manifest("[kernel]\nname = x\n", "."), tdist::Error);  // no source
  EXPECT_THROW(jit::parse_manifest("source = a.cu\n", "."), tdist::Error);       // no section
  EXPECT_THROW(jit::parse_manifest("[kernel]\nsource = /nonexistent.cu\n", "."), tdist::Error);
  try {
    jit::parse_manifest("[kernel]\nbogus = 1\n", ".", "m.txt");
    FAIL();
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("m.txt:2"), std::string::npos) << e.what();
  }
}

TEST(JitTools, CompileToolFillsCacheFromManifest) {
  TempDir proj, cache_dir;
  write_project(proj);
  int code = 0;
  std::string out =
      run(kTool + " --arch sm_90a --cache-dir " + cache_dir.path + " " + proj.file("kernels.manifest"), code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("2 ok, 0 failed"), std::string::npos) << out;

  // What the library computes at run time finds the entries the tool wrote, without compiling.
  jit::KernelCache cache(cache_dir.path);
  for (auto req : jit::load_manifest(proj.file("kernels.manifest"))) {
    req.arch = "sm_90a";
    auto k = jit::compile(req, cache);
    EXPECT_FALSE(k->cubin.empty());
  }
  EXPECT_EQ(cache.stats().misses, 0u);
  EXPECT_EQ(cache.stats().disk_hits, 2u);

  // A second run compiles nothing.
  out = run(kTool + " --arch sm_90a --cache-dir " + cache_dir.path + " " + proj.file("kernels.manifest"), code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(out.find("compiled"), std::string::npos) << out;
  EXPECT_NE(out.find("cached"), std::string::npos) << out;

  // A broken kernel fails the run and says where.
  proj.write("kernels/axpy.cu", "__global__ void broken( {\n");
  out = run(kTool + " --arch sm_90a --cache-dir " + cache_dir.path + " " + proj.file("kernels.manifest"), code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("axpy.cu(1)"), std::string::npos) << out;
}

TEST(JitTools, CompileToolAllCompilesRegisteredKernels) {
  TempDir cache_dir;
  auto families = jit::registered_kernels();
  ASSERT_FALSE(families.empty());
  int code = 0;
  std::string out = run(kTool + " --arch sm_90a --all --cache-dir " + cache_dir.path, code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("registry:jit_selftest#1"), std::string::npos) << out;
  jit::KernelCache cache(cache_dir.path);
  for (const auto& fam : families)
    for (auto req : fam.requests()) {
      req.arch = "sm_90a";
      EXPECT_TRUE(cache.lookup_disk(jit::cache_key(req))) << fam.name;
    }
  out = run(kTool + " --bogus", code);
  EXPECT_EQ(code, 2);
}

TEST(JitTools, RegistryRejectsDuplicates) {
  EXPECT_TRUE(jit::register_kernels("test_family_once", [] { return std::vector<jit::CompileRequest>{}; }));
  EXPECT_THROW(jit::register_kernels("test_family_once", [] { return std::vector<jit::CompileRequest>{}; }),
               tdist::Error);
}

TEST(JitLaunch, ArgumentPackerKeepsValuesAligned) {
  struct Pod {
    double d;
    int i;
  };
  float* ptr = reinterpret_cast<float*>(0x1000);
  jit::KernelArgs a;
  a.add(ptr).add(char(7)).add(Pod{2.5, 3}).add(std::int64_t(-5)).add(short(9));
  a.add(1).add(2).add(3).add(4).add(5).add(6).add(7).add(8).add(9);  // grows the storage
  ASSERT_EQ(a.size(), 14u);
  void** p = a.data();
  EXPECT_EQ(*static_cast<float**>(p[0]), ptr);
  EXPECT_EQ(*static_cast<char*>(p[1]), 7);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p[2]) % alignof(Pod), 0u);
  EXPECT_EQ(static_cast<Pod*>(p[2])->d, 2.5);
  EXPECT_EQ(static_cast<Pod*>(p[2])->i, 3);
  EXPECT_EQ(*static_cast<std::int64_t*>(p[3]), -5);
  EXPECT_EQ(*static_cast<short*>(p[4]), 9);
  EXPECT_EQ(*static_cast<int*>(p[13]), 9);
  auto b = jit::make_args(ptr, 42);
  EXPECT_EQ(*static_cast<int*>(b.data()[1]), 42);
}

TEST(JitLaunch, NoDriverMeansCleanErrors) {
  if (jit::driver_available()) GTEST_SKIP() << "a GPU driver is present";
  jit::CompileRequest r;
  r.source = "extern \"C\" __global__ void k() {}\n";
  r.arch = "sm_90a";
  jit::KernelCache cache("");
  auto k = jit::compile(r, cache);
  EXPECT_THROW(jit::Module::load(k), tdist::Error);
  EXPECT_THROW(jit::current_device_name(), tdist::Error);
  // No explicit arch and no GPU: a clear error, not a crash.
  r.arch.clear();
  EXPECT_THROW(jit::compile(r, cache), tdist::Error);
}
