// tdist::NvtxRange and TDIST_NVTX_RANGE (include/tdist/common/nvtx.hpp): without a profiler a range
// opens and closes and records nothing; with one (a tool defined here, handed to NVTX's loader as a
// static injection in a child process) each range is one push with its message and one pop, nested in
// order; with TDIST_NVTX=0 the header compiles without NVTX's and the macro does not evaluate its
// arguments.
#include "tdist/common/nvtx.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "cpu/temp_dir.hpp"

#if !TDIST_NVTX
#error "tests/cpu/test_nvtx.cpp expects the build's default, TDIST_NVTX=ON"
#endif

namespace {

// The tool: NVTX's loader calls fake_init at its first call when InitializeInjectionNvtx2_fnptr
// (NVTX's weak, zero-initialised static-injection hook) points to it by then.
std::vector<std::string> g_events;
int g_domain_tag = 0;  // the tool's domain handle points here

nvtxDomainHandle_t NVTX_API fake_domain_create(const char* name) {
  g_events.push_back(std::string("domain ") + name);
  return reinterpret_cast<nvtxDomainHandle_t>(&g_domain_tag);
}

int NVTX_API fake_push(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* attr) {
  if (domain != reinterpret_cast<nvtxDomainHandle_t>(&g_domain_tag)) g_events.push_back("push in a foreign domain");
  if (attr->messageType != NVTX_MESSAGE_TYPE_ASCII) g_events.push_back("push without an ASCII message");
  g_events.push_back(std::string("push ") + attr->message.ascii);
  return 0;
}

int NVTX_API fake_pop(nvtxDomainHandle_t domain) {
  g_events.push_back(domain == reinterpret_cast<nvtxDomainHandle_t>(&g_domain_tag) ? "pop" : "pop in a foreign domain");
  return 0;
}

int NVTX_API fake_init(NvtxGetExportTableFunc_t get_export_table) {
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (callbacks == nullptr || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size)) return 0;
  if (size <= NVTX_CBID_CORE2_DomainCreateA) return 0;
  *table[NVTX_CBID_CORE2_DomainCreateA] = reinterpret_cast<NvtxFunctionPointer>(&fake_domain_create);
  *table[NVTX_CBID_CORE2_DomainRangePushEx] = reinterpret_cast<NvtxFunctionPointer>(&fake_push);
  *table[NVTX_CBID_CORE2_DomainRangePop] = reinterpret_cast<NvtxFunctionPointer>(&fake_pop);
  return 1;
}

void open_nested_ranges(int* evaluated) {
  TDIST_NVTX_RANGE("tdist::Gemm::run", "m=", 3, " n=", 5, " ", "bf16", (++*evaluated, ""));
  const tdist::NvtxRange inner("tdist::inner");
  EXPECT_EQ(inner.recorded(), tdist::nvtx_recording());
}

TEST(Nvtx, RangesOpenAndCloseWithoutAProfiler) {
  unsetenv("NVTX_INJECTION64_PATH");  // a profiler running the suite does not count
  ASSERT_EQ(InitializeInjectionNvtx2_fnptr, nullptr);
  EXPECT_FALSE(tdist::nvtx_recording());
  int evaluated = 0;
  for (int i = 0; i < 3; ++i) open_nested_ranges(&evaluated);
  EXPECT_EQ(evaluated, 3);  // compiled in: the arguments are evaluated, the message is not built
  const tdist::NvtxRange range("tdist::all_reduce", "count=", 1024);
  EXPECT_FALSE(range.recorded());
  EXPECT_TRUE(g_events.empty()) << g_events.front();
}

// In a fresh process: attaches the tool, opens two nested ranges, exits 0 when the tool saw them.
[[noreturn]] void profile_nested_ranges() {
  unsetenv("NVTX_INJECTION64_PATH");
  InitializeInjectionNvtx2_fnptr = &fake_init;
  int evaluated = 0;
  open_nested_ranges(&evaluated);
  const std::vector<std::string> want = {"domain tdist", "push tdist::Gemm::run m=3 n=5 bf16", "push tdist::inner",
                                         "pop", "pop"};
  const bool ok = g_events == want && tdist::nvtx_recording() && evaluated == 1;
  if (!ok)
    for (const auto& e : g_events) std::fprintf(stderr, "event: %s\n", e.c_str());
  std::exit(ok ? 0 : 1);
}

// Each range reaches the tool as one push naming the op and its details, popped in nesting order.
TEST(Nvtx, ProfilerSeesOnePushAndPopPerRange) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: NVTX not initialised yet
  EXPECT_EXIT(profile_nested_ranges(), ::testing::ExitedWithCode(0), "");
}

// TDIST_NVTX=0: the header needs no NVTX (nor CUDA) include path, declares the same names, and the
// macro's arguments are never evaluated.
TEST(Nvtx, CompiledOutWithTdistNvtxOff) {
  tdist::test::TempDir dir;
  dir.write("off.cpp", R"(
#include "tdist/common/nvtx.hpp"
#ifdef NVTX_VERSION
#error "TDIST_NVTX=0 still includes NVTX"
#endif
#if TDIST_NVTX
#error "TDIST_NVTX=0 was overridden"
#endif
int evaluated = 0;
int side_effect() { return ++evaluated; }  // not static: compiled out, nothing calls it
int main() {
  TDIST_NVTX_RANGE("tdist::x", "m=", side_effect());
  const tdist::NvtxRange range("tdist::y", 4, " ", 2.5);
  return (evaluated == 0 && !range.recorded() && !tdist::nvtx_recording()) ? 0 : 3;
}
)");
  const std::string cmd = std::string("'") + TDIST_CXX_COMPILER +
                          "' -std=c++20 -Wall -Wextra -Werror -DTDIST_NVTX=0 -I'" + TDIST_SOURCE_DIR + "/include' '" +
                          dir.file("off.cpp") + "' -o '" + dir.file("off") + "' 2>'" + dir.file("log") + "'";
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << cmd << " failed:\n"
                                                     << [&] {
                                                          std::string log, line;
                                                          std::ifstream in(dir.file("log"));
                                                          while (std::getline(in, line)) log += line + "\n";
                                                          return log;
                                                        }();
  const int run = std::system(("'" + dir.file("off") + "'").c_str());
  EXPECT_TRUE(WIFEXITED(run) && WEXITSTATUS(run) == 0) << "the TDIST_NVTX=0 program exited " << run;
}

}  // namespace
