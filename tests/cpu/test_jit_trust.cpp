// The JIT cache trusts only itself: entries and folders of another user, or writable by other
// users, are never loaded; the last-resort folder in /tmp is refused unless it is this user's and
// private; nvcc's environment flags and NVRTC's content enter the key.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "cpu/temp_dir.hpp"
#include "cpu/test_env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/compiler.hpp"
#include "tdist/jit/paths.hpp"

namespace jit = tdist::jit;
using tdist::test::TempDir;

namespace {

constexpr uid_t kOtherUid = 12345;  // a user this test pretends is someone else

jit::CompileRequest small_kernel(const std::string& flavour = "") {
  jit::CompileRequest r;
  r.source = "__global__ void planted_probe(float* x) { x[threadIdx.x] += 1.0f; }\n" + flavour;
  r.file_name = "planted_probe.cu";
  r.name_expressions = {"planted_probe"};
  r.arch = "sm_90a";
  return r;
}

using tdist::test::ScopedEnv;

// A kernel compiled into `dir`, then a planted entry under its key: valid, intact, but not the
// compiler's output (its log says so).
std::shared_ptr<const jit::CompiledKernel> compile_and_plant(const std::string& dir) {
  jit::KernelCache cache(dir);
  auto real = jit::compile(small_kernel(), cache);
  jit::CompiledKernel planted = *real;
  planted.log = "PLANTED";
  const std::string path = cache.entry_path(real->key);
  std::filesystem::remove(path);
  jit::write_file_atomic(path, jit::KernelCache::serialize(planted), dir + "/tmp");
  return real;
}

// Looks the key up in a fresh cache over `dir`: what a later process would load.
std::shared_ptr<const jit::CompiledKernel> fresh_lookup(const std::string& dir, const jit::Digest& key,
                                                        jit::KernelCache::Stats* stats = nullptr) {
  jit::KernelCache cache(dir);
  auto k = cache.lookup_disk(key);
  if (stats) *stats = cache.stats();
  return k;
}

}  // namespace

TEST(JitTrust, OwnPrivateEntryIsLoaded) {
  // The control: a planted entry this user wrote, in private folders, is loaded (the cache cannot
  // tell it from its own), so the tests below fail only because of ownership and modes.
  TempDir dir;
  auto real = compile_and_plant(dir.path);
  auto k = fresh_lookup(dir.path, real->key);
  ASSERT_TRUE(k != nullptr);
  EXPECT_EQ(k->log, "PLANTED");
}

TEST(JitTrust, EntryOfAnotherUserIsIgnored) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another uid (chown)";
  TempDir dir;
  auto real = compile_and_plant(dir.path);
  const std::string path = jit::KernelCache(dir.path).entry_path(real->key);
  ASSERT_EQ(::chown(path.c_str(), kOtherUid, kOtherUid), 0);
  jit::KernelCache::Stats stats;
  EXPECT_TRUE(fresh_lookup(dir.path, real->key, &stats) == nullptr);
  EXPECT_EQ(stats.untrusted, 1u);
  EXPECT_EQ(stats.disk_hits, 0u);

  // compile() recompiles instead and replaces the entry with its own.
  jit::KernelCache cache(dir.path);
  auto again = jit::compile(small_kernel(), cache);
  EXPECT_NE(again->log, "PLANTED");
  EXPECT_EQ(cache.stats().misses, 1u);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, ::geteuid());
}

TEST(JitTrust, EntryWritableByOthersIsIgnored) {
  for (mode_t mode : {0666, 0620, 0602}) {
    TempDir dir;
    auto real = compile_and_plant(dir.path);
    const std::string path = jit::KernelCache(dir.path).entry_path(real->key);
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
    jit::KernelCache::Stats stats;
    EXPECT_TRUE(fresh_lookup(dir.path, real->key, &stats) == nullptr) << std::oct << mode;
    EXPECT_EQ(stats.untrusted, 1u) << std::oct << mode;
  }
}

TEST(JitTrust, SymlinkedEntryIsIgnored) {
  TempDir dir, elsewhere;
  auto real = compile_and_plant(dir.path);
  const std::string path = jit::KernelCache(dir.path).entry_path(real->key);
  std::filesystem::rename(path, elsewhere.file("entry.tdk"));
  std::filesystem::create_symlink(elsewhere.file("entry.tdk"), path);
  EXPECT_TRUE(fresh_lookup(dir.path, real->key) == nullptr);
}

TEST(JitTrust, FoldersWritableByOthersOrForeignAreIgnored) {
  for (const char* sub : {"", "kernels"}) {
    TempDir dir;
    auto real = compile_and_plant(dir.path);
    const std::string folder = std::string(dir.path) + (*sub ? "/" : "") + sub;
    ASSERT_EQ(::chmod(folder.c_str(), 0777), 0);
    EXPECT_TRUE(fresh_lookup(dir.path, real->key) == nullptr) << folder;
    if (::geteuid() != 0) continue;
    ASSERT_EQ(::chmod(folder.c_str(), 0700), 0);
    ASSERT_TRUE(fresh_lookup(dir.path, real->key) != nullptr) << folder;  // trusted again
    ASSERT_EQ(::chown(folder.c_str(), kOtherUid, kOtherUid), 0);
    EXPECT_TRUE(fresh_lookup(dir.path, real->key) == nullptr) << folder;
  }
}

TEST(JitTrust, NewFoldersAndEntriesArePrivate) {
  TempDir dir;
  const std::string root = dir.path + "/cache";
  jit::KernelCache cache(root);
  auto k = jit::compile(small_kernel(), cache);
  for (const std::string p : {root, root + "/kernels", root + "/tmp", cache.entry_path(k->key)}) {
    struct stat st;
    ASSERT_EQ(::stat(p.c_str(), &st), 0) << p;
    EXPECT_EQ(st.st_mode & 077, 0u) << p << " mode " << std::oct << (st.st_mode & 0777);
  }
}

TEST(JitTrust, TmpFallbackMustBeOwnAndPrivate) {
  TempDir tmp;
  ScopedEnv a("TDIST_CACHE_DIR", std::nullopt), b("XDG_CACHE_HOME", std::nullopt), c("HOME", std::nullopt),
      d("TMPDIR", tmp.path);
  const std::string expected = tmp.path + "/tdist-cache-" + std::to_string(::geteuid());
  ASSERT_EQ(jit::default_cache_dir(), expected);
  struct stat st;
  ASSERT_EQ(::lstat(expected.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  auto refused = [&](const char* why) {
    try {
      jit::default_cache_dir();
      ADD_FAILURE() << "accepted a fallback folder that " << why;
    } catch (const tdist::Error& e) {
      EXPECT_NE(std::string(e.what()).find("TDIST_CACHE_DIR"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  ASSERT_EQ(::chmod(expected.c_str(), 0755), 0);
  refused("others can enter");
  ASSERT_EQ(::chmod(expected.c_str(), 0700), 0);
  EXPECT_EQ(jit::default_cache_dir(), expected);
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(expected.c_str(), kOtherUid, kOtherUid), 0);
    refused("belongs to another user");
  }
  std::filesystem::remove_all(expected);
  std::filesystem::create_directory(tmp.path + "/elsewhere");
  std::filesystem::create_directory_symlink(tmp.path + "/elsewhere", expected);
  refused("is a symbolic link");

  // With HOME set, the per-user folder is used and /tmp is never considered.
  ScopedEnv home("HOME", tmp.path + "/home");
  EXPECT_EQ(jit::default_cache_dir(), tmp.path + "/home/.cache/tdist");
}

TEST(JitTrust, NvccEnvironmentFlagsEnterTheKey) {
  jit::CompileRequest r = small_kernel();
  r.compiler = jit::CompilerKind::kNvcc;
  ScopedEnv a("NVCC_APPEND_FLAGS", std::nullopt), p("NVCC_PREPEND_FLAGS", std::nullopt), c("NVCC_CCBIN", std::nullopt);
  const jit::Digest base = jit::cache_key(r);
  EXPECT_EQ(jit::cache_key(r), base);
  {
    ScopedEnv set("NVCC_APPEND_FLAGS", "-DPLANTED=1");
    const jit::Digest appended = jit::cache_key(r);
    EXPECT_NE(appended, base);
    ScopedEnv other("NVCC_APPEND_FLAGS", "-DPLANTED=2");
    EXPECT_NE(jit::cache_key(r), appended);
  }
  {
    ScopedEnv set("NVCC_PREPEND_FLAGS", "-DPLANTED=1");
    EXPECT_NE(jit::cache_key(r), base);
  }
  {
    ScopedEnv set("NVCC_CCBIN", "g++");
    EXPECT_NE(jit::cache_key(r), base);
  }
  EXPECT_EQ(jit::cache_key(r), base);

  // NVRTC does not read them: its keys stay put.
  r.compiler = jit::CompilerKind::kNvrtc;
  const jit::Digest nvrtc = jit::cache_key(r);
  ScopedEnv set("NVCC_APPEND_FLAGS", "-DPLANTED=1");
  EXPECT_EQ(jit::cache_key(r), nvrtc);
}

TEST(JitTrust, NvrtcIdentifiedByContent) {
  const std::string id = jit::compiler_identity(jit::CompilerKind::kNvrtc);
  // "nvrtc 13.0 libnvrtc.so.13:<sha256> libnvrtc-builtins.so.13.0:<sha256>"
  const auto colon = id.find(':');
  ASSERT_NE(colon, std::string::npos) << id;
  const std::string hash = id.substr(colon + 1, 64);
  EXPECT_EQ(hash.size(), 64u) << id;
  EXPECT_EQ(hash.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
}

// Run by NvrtcDigestMemoIsTrustedOnlyWhenOwn in a fresh process: prints NVRTC's identity.
TEST(JitTrustChild, DISABLED_PrintNvrtcIdentity) {
  std::printf("identity=%s\n", jit::compiler_identity(jit::CompilerKind::kNvrtc).c_str());
}

namespace {

// NVRTC's identity as a fresh process with TDIST_CACHE_DIR=`cache` computes it.
std::string identity_in_fresh_process(const std::string& cache) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "";
  self[n] = '\0';
  const std::string cmd = "TDIST_CACHE_DIR='" + cache + "' '" + self +
                          "' --gtest_filter=JitTrustChild.DISABLED_PrintNvrtcIdentity --gtest_also_run_disabled_tests";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    ::pclose(p);
  }
  const auto at = out.find("identity=");
  return at == std::string::npos ? "" : out.substr(at + 9, out.find('\n', at) - at - 9);
}

}  // namespace

TEST(JitTrust, NvrtcDigestMemoIsTrustedOnlyWhenOwn) {
  TempDir cache;
  const std::string first = identity_in_fresh_process(cache.path);  // hashes, and remembers
  ASSERT_NE(first.find("libnvrtc"), std::string::npos) << first;
  ASSERT_FALSE(std::filesystem::is_empty(cache.path + "/identity"));
  EXPECT_EQ(identity_in_fresh_process(cache.path), first);  // from the memo

  // Forged memos: every digest replaced by zeros. Another user's are ignored.
  const std::string zeros(64, '0');
  for (const auto& e : std::filesystem::directory_iterator(cache.path + "/identity")) {
    std::string text;
    ASSERT_TRUE(jit::read_file(e.path(), text));
    text = text.substr(0, text.size() - 64) + zeros;
    std::filesystem::remove(e.path());
    jit::write_file_atomic(e.path(), text, cache.path + "/tmp");
    if (::geteuid() == 0)
      ASSERT_EQ(::chown(e.path().c_str(), kOtherUid, kOtherUid), 0);
    else
      ASSERT_EQ(::chmod(e.path().c_str(), 0666), 0);
  }
  const std::string again = identity_in_fresh_process(cache.path);
  EXPECT_EQ(again, first);
  EXPECT_EQ(again.find(zeros), std::string::npos);
}
