// tdist-compile: fills a tdist JIT cache ahead of time, for a named GPU architecture, on a
// machine with or without a GPU.
//
//   tdist-compile --arch sm_90a [--cache-dir DIR] [--all] [--jobs N] [--list] [MANIFEST...]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/manifest.hpp"
#include "tdist/jit/paths.hpp"
#include "tdist/jit/registry.hpp"

namespace {

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: tdist-compile --arch ARCH [--cache-dir DIR] [--all] [--jobs N] [--list] [MANIFEST...]\n"
               "  --arch ARCH       target, e.g. sm_90a (default: the current GPU's)\n"
               "  --cache-dir DIR   cache to fill (default: TDIST_CACHE_DIR or ~/.cache/tdist)\n"
               "  --all             every kernel the library registers\n"
               "  --jobs N          parallel compiles (default: number of CPUs)\n"
               "  --list            print what would be compiled, compile nothing\n"
               "  MANIFEST          kernel manifest files (format: include/tdist/jit/manifest.hpp)\n");
}

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
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "tdist-compile: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--arch") arch = value();
    else if (a.rfind("--arch=", 0) == 0) arch = a.substr(7);
    else if (a == "--cache-dir") cache_dir = value();
    else if (a.rfind("--cache-dir=", 0) == 0) cache_dir = a.substr(12);
    else if (a == "--all") all = true;
    else if (a == "--list") list = true;
    else if (a == "--jobs" || a == "-j") jobs = unsigned(std::max(1, std::atoi(value().c_str())));
    else if (a == "-h" || a == "--help") { usage(stdout); return 0; }
    else if (!a.empty() && a[0] == '-') { std::fprintf(stderr, "tdist-compile: unknown option %s\n", a.c_str()); usage(stderr); return 2; }
    else manifests.push_back(a);
  }
  if (!all && manifests.empty()) {
    usage(stderr);
    return 2;
  }
  try {
    arch = tdist::jit::normalize_arch(arch.empty() ? tdist::jit::current_arch() : arch);
    std::vector<Item> items;
    if (all)
      for (const auto& fam : tdist::jit::registered_kernels()) {
        int k = 0;
        for (auto& r : fam.requests()) items.push_back({"registry:" + fam.name + "#" + std::to_string(++k), std::move(r)});
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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-compile: %s\n", e.what());
    return 1;
  }
}
