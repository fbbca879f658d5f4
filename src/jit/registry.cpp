// Registry of library kernels for ahead-of-time compilation.
#include "tdist/jit/registry.hpp"

#include <algorithm>
#include <map>
#include <mutex>

#include "tdist/common/error.hpp"

namespace tdist::jit {
namespace {

// Function-local statics: registration runs during static initialisation of other files.
std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, std::function<std::vector<CompileRequest>()>>& registry() {
  static std::map<std::string, std::function<std::vector<CompileRequest>()>> r;
  return r;
}

}  // namespace

bool register_kernels(std::string name, std::function<std::vector<CompileRequest>()> requests) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  TDIST_CHECK_ARG(!name.empty() && requests, "name", "a kernel family needs a name and a request list");
  TDIST_CHECK_ARG(registry().emplace(name, std::move(requests)).second, "name", "kernel family '", name,
                  "' is registered twice");
  return true;
}

std::vector<RegisteredKernels> registered_kernels() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<RegisteredKernels> out;
  for (const auto& [name, fn] : registry()) out.push_back({name, fn});
  return out;
}

}  // namespace tdist::jit
