// Compiling for sm_90a without a GPU, through NVRTC and nvcc: CUBIN output, lowered names,
// constants, compile errors that point at the user's file and line, spill detection, NCCL
// routing, and what does (and does not) change the cache key.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cpu/temp_dir.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/paths.hpp"

namespace jit = tdist::jit;

namespace {

using tdist::test::TempDir;

const char* kTemplateKernel = R"(#include "param.cuh"
template <int N, typename T>
__global__ void scale(T* out, const T* in, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * T(N * kParam);
}
)";

jit::CompileRequest base_request(const TempDir& inc) {
  jit::CompileRequest r;
  r.source = kTemplateKernel;
  r.file_name = "scale.cu";
  r.name_expressions = {"scale<4, float>"};
  r.include_dirs = {inc.path};
  r.arch = "sm_90a";
  r.compiler = jit::CompilerKind::kNvrtc;
  return r;
}

bool is_elf(const std::string& b) {
  return b.size() > 4 && b.compare(0, 4,
                                   "\x7f"
                                   "ELF") == 0;
}

}  // namespace

TEST(JitCompile, NvrtcProducesCubinForSm90aWithoutGpu) {
  TempDir inc, cache_dir;
  inc.write("param.cuh", "#pragma once\nconstexpr int kParam = 2;\n");
  jit::KernelCache cache(cache_dir.path);
  auto k = jit::compile(base_request(inc), cache);
  EXPECT_TRUE(is_elf(k->cubin));
  EXPECT_EQ(k->arch, "sm_90a");
  EXPECT_EQ(k->lowered_name("scale<4, float>"), "_Z5scaleILi4EfEvPT0_PKS0_i");
  EXPECT_EQ(k->compiler.rfind("nvrtc", 0), 0u) << k->compiler;
  EXPECT_NE(k->log.find("ptxas info"), std::string::npos) << k->log;
  EXPECT_THROW(k->lowered_name("scale<8, float>"), tdist::Error);
}

TEST(JitCompile, NvccProducesTheSameSymbols) {
  TempDir inc, cache_dir;
  inc.write("param.cuh", "#pragma once\nconstexpr int kParam = 2;\n");
  jit::KernelCache cache(cache_dir.path);
  auto req = base_request(inc);
  req.name_expressions = {"scale<4, float>", "scale<16, double>"};
  auto a = jit::compile(req, cache);
  req.compiler = jit::CompilerKind::kNvcc;
  auto b = jit::compile(req, cache);
  EXPECT_TRUE(is_elf(b->cubin));
  EXPECT_EQ(b->compiler.rfind("nvcc", 0), 0u) << b->compiler;
  EXPECT_NE(a->key, b->key);
  EXPECT_EQ(a->lowered_names, b->lowered_names);
}

TEST(JitCompile, CompilerChosenByEnvironment) {
  TempDir inc;
  inc.write("param.cuh", "#pragma once\nconstexpr int kParam = 2;\n");
  auto req = base_request(inc);
  req.compiler = jit::CompilerKind::kAuto;
  jit::Digest nvrtc_key = jit::cache_key(req);
  setenv("TDIST_JIT_COMPILER", "nvcc", 1);
  jit::Digest nvcc_key = jit::cache_key(req);
  unsetenv("TDIST_JIT_COMPILER");
  EXPECT_NE(nvrtc_key, nvcc_key);
  req.compiler = jit::CompilerKind::kNvcc;
  EXPECT_EQ(jit::cache_key(req), nvcc_key);
  EXPECT_EQ(jit::parse_compiler_kind("NVCC"), jit::CompilerKind::kNvcc);
  EXPECT_THROW(jit::parse_compiler_kind("clang"), tdist::Error);
}

TEST(JitCompile, ConstantsAndDefinesSpecialise) {
  TempDir cache_dir;
  jit::KernelCache cache(cache_dir.path);
  jit::CompileRequest r;
  r.source = "extern \"C\" __global__ void k(int* p) { p[0] = kBlockM + EXTRA; }\n";
  r.file_name = "spec.cu";
  r.arch = "sm_90a";
  r.constants = {{"int", "kBlockM", "128"}};
  r.defines = {"EXTRA=3"};
  auto k = jit::compile(r, cache);
  EXPECT_TRUE(is_elf(k->cubin));
  r.constants[0].value = "256";
  EXPECT_NE(jit::compile(r, cache)->key, k->key);
}

TEST(JitCompile, ErrorNamesUserFileAndLine) {
  TempDir src_dir, cache_dir;
  jit::KernelCache cache(cache_dir.path);
  src_dir.write("bad_kernel.cu",
                "// line 1\n"
                "__global__ void k(int* p) {\n"
                "  int x = 1;\n"
                "  p[0] = undefined_symbol + x;\n"  // line 4
                "}\n");
  for (auto kind : {jit::CompilerKind::kNvrtc, jit::CompilerKind::kNvcc}) {
    auto r = jit::CompileRequest::from_file(src_dir.file("bad_kernel.cu"));
    r.arch = "sm_90a";
    r.compiler = kind;
    r.constants = {{"int", "kShiftsNoLines", "1"}};  // a prelude must not move line numbers
    try {
      jit::compile(r, cache);
      FAIL() << "expected a compile error";
    } catch (const tdist::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("bad_kernel.cu(4)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("undefined_symbol"), std::string::npos) << msg;
      EXPECT_NE(msg.find(src_dir.file("bad_kernel.cu")), std::string::npos) << msg;
    }
  }
}

TEST(JitCompile, SpillsDetectedAndFailWhenAsked) {
  TempDir cache_dir;
  jit::KernelCache cache(cache_dir.path);
  jit::CompileRequest r;
  // 96 live values against a 32-register budget (1024 threads x 2 blocks per SM) must spill.
  r.source = R"(extern "C" __global__ void __launch_bounds__(1024, 2) spill(const float* in, float* out, int n) {
  float v[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) v[i] = in[threadIdx.x + i * n];
  float s = 0.f;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int i = 0; i < 96; ++i) s += v[i] * v[(i * 7 + r) % 96 + (n & 0)];
  out[threadIdx.x] = s;
}
)";
  r.file_name = "spill.cu";
  r.arch = "sm_90a";
  unsetenv("TDIST_JIT_FAIL_ON_SPILLS");
  auto k = jit::compile(r, cache);
  EXPECT_GT(k->spill_stores, 0) << k->log;
  EXPECT_GT(k->spill_loads, 0) << k->log;

  setenv("TDIST_JIT_FAIL_ON_SPILLS", "1", 1);
  // From the cache too: the spill counts travel with the entry.
  cache.clear_memory();
  try {
    jit::compile(r, cache);
    ADD_FAILURE() << "expected a spill error";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("spill"), std::string::npos) << e.what();
  }
  unsetenv("TDIST_JIT_FAIL_ON_SPILLS");

  std::int64_t st = 0, ld = 0;
  jit::parse_spills(
      "ptxas . 8 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads\n"
      "ptxas . 0 bytes stack frame, 4 bytes spill stores, 0 bytes spill loads\n",
      st, ld);
  EXPECT_EQ(st, 16);
  EXPECT_EQ(ld, 20);
}

TEST(JitCompile, NcclHeadersRouteToNvcc) {
  if (jit::nccl_include_dir().empty()) GTEST_SKIP() << "no NCCL headers";
  jit::CompileRequest r;
  r.source = "#include <nccl_device.h>\nextern \"C\" __global__ void k(int* p) { p[0] = NCCL_MAJOR; }\n";
  r.file_name = "uses_nccl.cu";
  r.arch = "sm_90a";
  r.compiler = jit::CompilerKind::kNvrtc;
  EXPECT_THROW(jit::cache_key(r), tdist::Error);
  r.compiler = jit::CompilerKind::kAuto;
  TempDir cache_dir;
  jit::KernelCache cache(cache_dir.path);
  auto k = jit::compile(r, cache);
  EXPECT_EQ(k->compiler.rfind("nvcc", 0), 0u) << k->compiler;
  EXPECT_TRUE(is_elf(k->cubin));
}

TEST(JitCompile, ArchNormalisation) {
  EXPECT_EQ(jit::normalize_arch("sm_90a"), "sm_90a");
  EXPECT_EQ(jit::normalize_arch("90a"), "sm_90a");
  EXPECT_EQ(jit::normalize_arch("sm100a"), "sm_100a");
  EXPECT_EQ(jit::normalize_arch("sm_80"), "sm_80");
  EXPECT_THROW(jit::normalize_arch("compute_90a"), tdist::Error);
  EXPECT_THROW(jit::normalize_arch("sm_9"), tdist::Error);
  EXPECT_THROW(jit::normalize_arch("hopper"), tdist::Error);
}

TEST(JitCompile, FlagsRejectIncludeAndArch) {
  TempDir inc;
  inc.write("param.cuh", "constexpr int kParam = 2;\n");
  auto r = base_request(inc);
  r.flags = {"-I/somewhere"};
  EXPECT_THROW(jit::cache_key(r), tdist::Error);
  r.flags = {"-arch=sm_80"};
  EXPECT_THROW(jit::cache_key(r), tdist::Error);
}

// ---- the cache key

TEST(JitKey, ChangesWithEveryCoveredInput) {
  TempDir inc;
  inc.write("param.cuh", "#pragma once\n#include \"nested/deep.cuh\"\nconstexpr int kParam = 2;\n");
  inc.write("nested/deep.cuh", "#pragma once\n// v1\n");
  auto r = base_request(inc);
  const jit::Digest k0 = jit::cache_key(r);
  EXPECT_EQ(jit::cache_key(r), k0);  // deterministic

  auto changed = [&](auto mutate) {
    auto c = r;
    mutate(c);
    return jit::cache_key(c) != k0;
  };
  EXPECT_TRUE(changed([](auto& c) { c.source += "// trailing comment\n"; }));
  EXPECT_TRUE(changed([](auto& c) { c.flags.push_back("-maxrregcount=64"); }));
  EXPECT_TRUE(changed([](auto& c) { c.defines.push_back("FOO=1"); }));
  EXPECT_TRUE(changed([](auto& c) { c.name_expressions = {"scale<8, float>"}; }));
  EXPECT_TRUE(changed([](auto& c) { c.name_expressions.push_back("scale<4, double>"); }));
  EXPECT_TRUE(changed([](auto& c) { c.arch = "sm_80"; }));
  EXPECT_TRUE(changed([](auto& c) { c.arch = "sm_90"; }));
  EXPECT_TRUE(changed([](auto& c) { c.constants.push_back({"int", "kX", "1"}); }));
  EXPECT_TRUE(changed([](auto& c) { c.file_name = "other_name.cu"; }));
  EXPECT_TRUE(changed([](auto& c) { c.compiler = jit::CompilerKind::kNvcc; }));

  // A transitively included header's content.
  inc.write("nested/deep.cuh", "#pragma once\n// v2\n");
  const jit::Digest k1 = jit::cache_key(r);
  EXPECT_NE(k1, k0);
  // Back to the old content: back to the old key.
  inc.write("nested/deep.cuh", "#pragma once\n// v1\n");
  EXPECT_EQ(jit::cache_key(r), k0);
  // Lineinfo from the environment.
  setenv("TDIST_JIT_LINEINFO", "1", 1);
  EXPECT_NE(jit::cache_key(r), k0);
  unsetenv("TDIST_JIT_LINEINFO");
}

TEST(JitKey, UnaffectedByUnrelatedFilesAndPaths) {
  TempDir inc, inc2;
  inc.write("param.cuh", "#pragma once\nconstexpr int kParam = 2;\n");
  inc.write("unrelated.cuh", "// not included\n");
  auto r = base_request(inc);
  const jit::Digest k0 = jit::cache_key(r);
  inc.write("unrelated.cuh", "// changed, still not included\n");
  inc.write("new_file.cuh", "// new\n");
  EXPECT_EQ(jit::cache_key(r), k0);
  // Same header content under another path (another machine's layout): same key.
  inc2.write("param.cuh", "#pragma once\nconstexpr int kParam = 2;\n");
  r.include_dirs = {inc2.path};
  EXPECT_EQ(jit::cache_key(r), k0);
}

TEST(JitKey, TdistHeadersAreFoundAndHashed) {
  std::string dir = jit::tdist_include_dir();
  ASSERT_FALSE(dir.empty());
  EXPECT_TRUE(std::ifstream(dir + "/tdist/jit/compiler.hpp").good()) << dir;

  // TDIST_INCLUDE_DIR overrides where tdist's headers come from; their content is in the key.
  TempDir fake;
  fake.write("tdist/jit/compiler.hpp", "");
  fake.write("tdist/fake_device.cuh", "#pragma once\nconstexpr int kV = 1;\n");
  jit::CompileRequest r;
  r.source = "#include <tdist/fake_device.cuh>\nextern \"C\" __global__ void k(int* p) { p[0] = kV; }\n";
  r.file_name = "uses_tdist.cu";
  r.arch = "sm_90a";
  setenv("TDIST_INCLUDE_DIR", fake.path.c_str(), 1);
  jit::Digest k1 = jit::cache_key(r);
  TempDir cache_dir;
  jit::KernelCache cache(cache_dir.path);
  EXPECT_EQ(jit::compile(r, cache)->key, k1);
  fake.write("tdist/fake_device.cuh", "#pragma once\nconstexpr int kV = 2;\n");
  jit::Digest k2 = jit::cache_key(r);
  unsetenv("TDIST_INCLUDE_DIR");
  EXPECT_NE(k1, k2);
}

TEST(JitCompile, DumpWritesSourceCubinPtxAndLog) {
  TempDir dump, cache_dir;
  jit::KernelCache cache(cache_dir.path);
  jit::CompileRequest r;
  r.source = "extern \"C\" __global__ void dumped(int* p) { p[threadIdx.x] = 1; }\n";
  r.file_name = "dumped.cu";
  r.arch = "sm_90a";
  setenv("TDIST_JIT_DUMP", dump.path.c_str(), 1);
  auto k = jit::compile(r, cache);
  unsetenv("TDIST_JIT_DUMP");
  std::string base = dump.file("dumped." + jit::to_hex(k->key).substr(0, 16));
  std::string cubin, ptx, log;
  ASSERT_TRUE(jit::read_file(base + ".cubin", cubin));
  EXPECT_TRUE(cubin == k->cubin);
  ASSERT_TRUE(jit::read_file(base + ".ptx", ptx));
  EXPECT_NE(ptx.find(".entry dumped"), std::string::npos);
  ASSERT_TRUE(jit::read_file(base + ".log", log));
  EXPECT_NE(log.find("ptxas info"), std::string::npos);
  EXPECT_TRUE(std::ifstream(base + ".cu").good());
}
