// tdist-compile: fills a tdist JIT cache ahead of time, for a named GPU architecture, on a
// machine with or without a GPU.
//
//   tdist-compile --arch sm_90a [--cache-dir DIR] [--all] [--jobs N] [--list] [MANIFEST...]
//
// Exit codes: 0 every kernel compiled (or was cached), 1 some failed, 2 bad command line.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tdist/common/cli.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/manifest.hpp"
#include "tdist/jit/paths.hpp"
#include "tdist/jit/registry.hpp"

namespace {

struct Item {
  std::string origin;  // "manifest.txt#2" or "registry:name#1"
  tdist::jit::CompileRequest req;
};

}  // namespace

int main(int argc, char** argv) {
  std::string arch, cache_dir;
  bool all = false, list = false;
  unsigned jobs = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::string> manifests;
  tdist::cli::Parser p("tdist-compile",
                       "Fills a tdist JIT cache ahead of time, for a named GPU architecture, on a machine with or\n"
                       "without a GPU.");
  p.usage("[--arch ARCH] [--cache-dir DIR] [--all] [--jobs N] [--list] [MANIFEST...]");
  p.option("--arch", "ARCH", "target, e.g. sm_90a (default: the current GPU's)", &arch);
  p.option("--cache-dir", "DIR", "cache to fill (default: TDIST_CACHE_DIR or ~/.cache/tdist)", &cache_dir);
  p.flag("--all", "every kernel the library registers", &all);
  p.option("-j,--jobs", "N", "parallel compiles (default: number of CPUs)", &jobs, 1, 4096);
  p.flag("--list", "print what would be compiled, compile nothing", &list);
  p.positional("MANIFEST...", "kernel manifest files (format: include/tdist/jit/manifest.hpp)", &manifests);
  p.parse(argc, argv);
  if (!all && manifests.empty()) p.fail("nothing to compile: give --all or MANIFEST files");
  return tdist::cli::run_main("tdist-compile", [&]() -> int {
    arch = tdist::jit::normalize_arch(arch.empty() ? tdist::jit::current_arch() : arch);
    std::vector<Item> items;
    if (all)
      for (const auto& fam : tdist::jit::registered_kernels()) {
        int k = 0;
        for (auto& r : fam.requests())
          items.push_back({"registry:" + fam.name + "#" + std::to_string(++k), std::move(r)});
      }
    for (const auto& m : manifests) {
      int k = 0;
      for (auto& r : tdist::jit::load_manifest(m)) items.push_back({m + "#" + std::to_string(++k), std::move(r)});
    }
    for (auto& it : items) it.req.arch = arch;
    if (cache_dir.empty()) cache_dir = tdist::jit::default_cache_dir();
    tdist::jit::KernelCache cache(cache_dir);
    std::printf("tdist-compile: %zu kernel(s) for %s into %s\n", items.size(), arch.c_str(), cache_dir.c_str());
    if (list) {
      for (const auto& it : items) {
        std::printf("  %s  %s", it.origin.c_str(), it.req.file_name.c_str());
        for (const auto& n : it.req.name_expressions) std::printf("  [%s]", n.c_str());
        std::printf("\n");
      }
      return 0;
    }
    std::atomic<std::size_t> next{0};
    std::atomic<int> failed{0};
    std::mutex out_mu;
    auto worker = [&] {
      for (std::size_t i; (i = next++) < items.size();) {
        auto t0 = std::chrono::steady_clock::now();
        std::string line;
        try {
          auto before = cache.stats().misses;
          auto k = tdist::jit::compile(items[i].req, cache);
          double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          bool compiled = cache.stats().misses != before;
          char buf[256];
          std::snprintf(buf, sizeof buf, "  %-8s %s  %8.1f ms  ", compiled ? "compiled" : "cached",
                        tdist::jit::to_hex(k->key).substr(0, 16).c_str(), ms);
          line = buf + items[i].origin + " (" + k->file_name + ")";
        } catch (const std::exception& e) {
          failed++;
          line = "  FAILED   " + items[i].origin + ": " + e.what();
        }
        std::lock_guard<std::mutex> lock(out_mu);
        std::printf("%s\n", line.c_str());
        std::fflush(stdout);
      }
    };
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < std::min<std::size_t>(jobs, items.size()); ++t) threads.emplace_back(worker);
    for (auto& t : threads) t.join();
    std::printf("tdist-compile: %zu ok, %d failed\n", items.size() - std::size_t(failed.load()), failed.load());
    return failed ? 1 : 0;
  });
}
