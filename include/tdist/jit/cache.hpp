// Two-level cache of compiled kernels: an in-process map, then a folder on disk.
//
// Disk layout under the cache root (copyable between machines; nothing in it names a path):
//   kernels/<key>.tdk     one entry per key: header, fields, SHA-256 trailer over the whole file
//   tmp/                  files being written; each is fsynced, then renamed into kernels/
//   locks/<key>.lock      flock files, so that processes compiling the same key compile it once
//   autotune/             autotuner winners (autotune.hpp)
//   identity/             content digests of compiler libraries, by file stamp (compiler.cpp)
// An entry that fails its length, magic, key or trailer check is ignored and rewritten.
//
// Trust: the trailer proves an entry intact, not who wrote it, and anyone can compute a key. So
// the cache reads only entries owned by this (effective) user and writable by nobody else, in
// folders of which the same holds (kernels/, tmp/, locks/ are created 0700; entries 0600). Any
// other entry or folder is ignored, never loaded, with one warning on stderr. A folder shared
// between users (TDIST_CACHE_DIR on a group-writable path) therefore works as no disk cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "tdist/jit/compiler.hpp"
#include "tdist/jit/hash.hpp"

namespace tdist::jit {

class KernelCache {
 public:
  // `dir` empty: memory only.
  explicit KernelCache(std::string dir);
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

  // Process-wide cache at default_cache_dir() (read on first use); TDIST_JIT_DISABLE_DISK_CACHE=1
  // keeps it in memory only.
  static KernelCache& global();

  const std::string& dir() const { return dir_; }

  // Memory, then disk (a disk hit is kept in memory). nullptr on a miss or a corrupt entry.
  std::shared_ptr<const CompiledKernel> lookup(const Digest& key);
  std::shared_ptr<const CompiledKernel> lookup_memory(const Digest& key);
  std::shared_ptr<const CompiledKernel> lookup_disk(const Digest& key);
  // Into memory and, atomically, onto disk.
  void store(const std::shared_ptr<const CompiledKernel>& kernel);
  void clear_memory();

  // Path of the entry for `key` (it may not exist).
  std::string entry_path(const Digest& key) const;

  // Serialised entry format (also used by tests to corrupt entries on purpose).
  static std::string serialize(const CompiledKernel& k);
  // nullopt when the bytes are not a complete, intact entry for `key`.
  static std::optional<CompiledKernel> deserialize(const std::string& bytes, const Digest& key);

  // Exclusive inter-process lock on one key, held while compiling it; waits up to `timeout_s`
  // then proceeds unlocked (a stuck peer must not hang us). No-op for a memory-only cache.
  class KeyLock {
   public:
    KeyLock(const KernelCache& cache, const Digest& key, double timeout_s = 900.0);
    ~KeyLock();
    KeyLock(const KeyLock&) = delete;
    KeyLock& operator=(const KeyLock&) = delete;
    bool locked() const { return fd_ >= 0; }

   private:
    int fd_ = -1;
  };

  struct Stats {
    std::uint64_t memory_hits = 0, disk_hits = 0, misses = 0, corrupt = 0, stores = 0;
    std::uint64_t untrusted = 0;  // entries present but ignored: another owner, or writable by others
  };
  Stats stats() const;
  // Counts a compile done for this cache (compile() calls it).
  void count_miss() { misses_++; }

 private:
  std::string dir_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const CompiledKernel>> memory_;
  std::atomic<std::uint64_t> memory_hits_{0}, disk_hits_{0}, misses_{0}, corrupt_{0}, stores_{0}, untrusted_{0};
};

// Writes `data` to `path` atomically: a temporary file in `tmp_dir` (same file system), fsync,
// rename over `path`, fsync of the folder. Creates missing folders. Throws tdist::Error.
void write_file_atomic(const std::string& path, const std::string& data, const std::string& tmp_dir);
// Whole file into `out`; false if it cannot be read.
bool read_file(const std::string& path, std::string& out);
// Like read_file, but only a regular file (not a symbolic link) owned by this user and not
// writable by group or others; any other is refused with a one-time warning on stderr.
bool read_trusted_file(const std::string& path, std::string& out);
// True when root (followed if a link) and root/sub (`sub` may be empty; not a link) are this
// user's and writable by nobody else; false, with a one-time warning, when one is not; false
// silently when one does not exist.
bool trusted_folder(const std::string& root, const std::string& sub);

}  // namespace tdist::jit
