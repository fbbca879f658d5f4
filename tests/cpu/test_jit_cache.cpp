// The two-level kernel cache: memory and disk hits, a fresh process reading the disk entry,
// corrupt entries recompiled, and six processes compiling one kernel into an empty cache.
#include <dirent.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cpu/temp_dir.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"

namespace jit = tdist::jit;

namespace {

using tdist::test::TempDir;

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(e->d_name);
    closedir(d);
  }
  return out;
}

jit::CompileRequest small_kernel() {
  jit::CompileRequest r;
  r.source = R"(template <int N>
__global__ void add_n(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += N;
}
)";
  r.file_name = "add_n.cu";
  r.name_expressions = {"add_n<7>"};
  r.arch = "sm_90a";
  return r;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(JitCache, MemoryThenDiskHits) {
  TempDir dir;
  jit::KernelCache cache(dir.path);
  auto t0 = std::chrono::steady_clock::now();
  auto a = jit::compile(small_kernel(), cache);
  double cold = ms_since(t0);
  EXPECT_EQ(cache.stats().misses, 1u);
  ASSERT_EQ(list_dir(dir.path + "/kernels").size(), 1u);

  t0 = std::chrono::steady_clock::now();
  auto b = jit::compile(small_kernel(), cache);
  double warm_memory = ms_since(t0);
  EXPECT_EQ(b.get(), a.get());
  EXPECT_EQ(cache.stats().memory_hits, 1u);
  EXPECT_EQ(cache.stats().misses, 1u);

  cache.clear_memory();
  t0 = std::chrono::steady_clock::now();
  auto c = jit::compile(small_kernel(), cache);
  double warm_disk = ms_since(t0);
  EXPECT_EQ(cache.stats().disk_hits, 1u);
  EXPECT_EQ(cache.stats().misses, 1u);
  EXPECT_TRUE(c->cubin == a->cubin);
  EXPECT_EQ(c->lowered_names, a->lowered_names);
  EXPECT_EQ(c->log, a->log);
  std::printf("small kernel: cold %.1f ms, warm (memory) %.2f ms, warm (disk) %.2f ms\n", cold, warm_memory, warm_disk);
}

TEST(JitCache, FreshProcessReadsDisk) {
  TempDir dir;
  {
    jit::KernelCache cache(dir.path);
    jit::compile(small_kernel(), cache);
  }
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 1;
    try {
      jit::KernelCache cache(dir.path);
      jit::compile(small_kernel(), cache);
      auto s = cache.stats();
      code = (s.disk_hits == 1 && s.misses == 0) ? 0 : 2;
    } catch (...) {
      code = 3;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: the child compiled instead of reading the disk entry";
}

TEST(JitCache, CorruptEntriesAreRecompiled) {
  TempDir dir;
  jit::KernelCache cache(dir.path);
  auto good = jit::compile(small_kernel(), cache);
  std::string path = cache.entry_path(good->key);
  std::string bytes;
  ASSERT_TRUE(jit::read_file(path, bytes));

  auto recompile_after = [&](const std::string& damaged) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << damaged;
    cache.clear_memory();
    auto before = cache.stats();
    auto k = jit::compile(small_kernel(), cache);
    auto after = cache.stats();
    EXPECT_GT(after.corrupt, before.corrupt);  // seen (before and after taking the key lock)
    EXPECT_EQ(after.misses, before.misses + 1);
    EXPECT_TRUE(k->cubin == good->cubin);
    std::string rewritten;
    EXPECT_TRUE(jit::read_file(path, rewritten));
    EXPECT_EQ(jit::sha256(rewritten), jit::sha256(bytes));  // the entry is whole again
  };
  recompile_after(bytes.substr(0, bytes.size() / 2));  // truncated
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x40;  // one byte changed inside the cubin
  recompile_after(flipped);
  recompile_after("");  // empty file
  std::string wrong_trailer = bytes;
  wrong_trailer.back() ^= 1;
  recompile_after(wrong_trailer);

  // deserialize() refuses an intact entry filed under another key.
  jit::Digest other = good->key;
  other[0] ^= 1;
  EXPECT_FALSE(jit::KernelCache::deserialize(bytes, other).has_value());
  EXPECT_TRUE(jit::KernelCache::deserialize(bytes, good->key).has_value());
}

TEST(JitCache, SixProcessesCompileOnceAndAgree) {
  TempDir dir;
  constexpr int kProcs = 6;
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int i = 0; i < kProcs; ++i) {
    outs.push_back(dir.path + "/out" + std::to_string(i));
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(go[1]);
      char c;
      (void)!read(go[0], &c, 1);  // all start together
      int code = 1;
      try {
        jit::KernelCache cache(dir.path + "/cache");
        auto k = jit::compile(small_kernel(), cache);
        std::ofstream(outs[i]) << jit::to_hex(jit::sha256(k->cubin));
        code = cache.stats().misses == 1 ? 10 : 0;  // 10: this process compiled
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", i, e.what());
        code = 1;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  close(go[0]);
  close(go[1]);  // EOF releases every child at once
  int compiled = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    int code = WEXITSTATUS(status);
    ASSERT_TRUE(code == 0 || code == 10) << "child failed with " << code;
    compiled += code == 10;
  }
  EXPECT_EQ(compiled, 1) << "the key lock lets one process compile while the others wait";
  std::string first;
  for (const auto& o : outs) {
    std::string h;
    ASSERT_TRUE(jit::read_file(o, h));
    if (first.empty()) first = h;
    EXPECT_EQ(h, first);
  }
  auto entries = list_dir(dir.path + "/cache/kernels");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_TRUE(list_dir(dir.path + "/cache/tmp").empty());
  std::string bytes;
  ASSERT_TRUE(jit::read_file(dir.path + "/cache/kernels/" + entries[0], bytes));
  jit::Digest key{};
  ASSERT_TRUE(jit::from_hex(entries[0].substr(0, 64), key));
  auto entry = jit::KernelCache::deserialize(bytes, key);
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(jit::to_hex(jit::sha256(entry->cubin)), first);
}

TEST(JitCache, ConcurrentWritersWithoutLockLeaveOneValidEntry) {
  // Even with no lock (several processes storing at once), rename keeps one whole entry.
  TempDir dir;
  jit::KernelCache seed("");
  auto k = jit::compile(small_kernel(), seed);
  std::vector<pid_t> pids;
  for (int i = 0; i < 6; ++i) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        jit::KernelCache cache(dir.path);
        for (int j = 0; j < 20; ++j) cache.store(k);
      } catch (...) {
        code = 1;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(list_dir(dir.path + "/kernels").size(), 1u);
  EXPECT_TRUE(list_dir(dir.path + "/tmp").empty());
  jit::KernelCache reader(dir.path);
  auto back = reader.lookup_disk(k->key);
  ASSERT_TRUE(back);
  EXPECT_TRUE(back->cubin == k->cubin);
}

TEST(JitCache, MemoryOnlyCacheWritesNothing) {
  jit::KernelCache cache("");
  auto a = jit::compile(small_kernel(), cache);
  auto b = jit::compile(small_kernel(), cache);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(cache.stats().misses, 1u);
}
