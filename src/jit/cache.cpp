// The kernel cache: in-process map, then one self-checking file per key on disk.
#include "tdist/jit/cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "detail.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/paths.hpp"

namespace tdist::jit {
namespace {

// Entry file layout (little-endian):
//   "TDISTJIT" | u32 format version | u32 zero | u64 total file size | 32-byte key |
//   u32 field count | fields: u32 tag size, tag, u64 value size, value | SHA-256 of all before.
constexpr char kMagic[8] = {'T', 'D', 'I', 'S', 'T', 'J', 'I', 'T'};
constexpr std::uint32_t kFormat = 1;
constexpr std::size_t kHeader = 8 + 4 + 4 + 8 + 32 + 4;

void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s += char(v >> (8 * i));
}
void put_u64(std::string& s, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) s += char(v >> (8 * i));
}
std::uint64_t get_uint(const std::string& s, std::size_t off, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(std::uint8_t(s[off + i])) << (8 * i);
  return v;
}

}  // namespace

namespace {

bool read_fd(int fd, std::string& out) {
  out.clear();
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(std::size_t(st.st_size));
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, std::size_t(n));
    } else if (n == 0) {
      return true;
    } else if (errno != EINTR) {
      return false;
    }
  }
}

}  // namespace

bool read_file(const std::string& path, std::string& out) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = read_fd(fd, out);
  ::close(fd);
  return ok;
}

bool read_trusted_file(const std::string& path, std::string& out) {
  // O_NOFOLLOW and fstat: what is checked is the file that is read, not what the name pointed
  // to a moment earlier.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ELOOP)
      detail::warn_untrusted_once("cache entries in " + detail::dirname(path), path + " is a symbolic link");
    return false;
  }
  struct stat st;
  std::string why;
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  if (ok && detail::trust_of(st, path, why) != detail::Trust::ok) {
    detail::warn_untrusted_once("cache entries in " + detail::dirname(path), why);
    ok = false;
  }
  ok = ok && read_fd(fd, out);
  ::close(fd);
  return ok;
}

bool trusted_folder(const std::string& root, const std::string& sub) {
  std::string why;
  // The root may be a symbolic link the user made (~/.cache -> /scratch/...); folders inside may not.
  detail::Trust t = detail::trust_path(root, /*follow=*/true, why);
  if (t == detail::Trust::ok && !sub.empty()) t = detail::trust_path(detail::join(root, sub), /*follow=*/false, why);
  if (t == detail::Trust::untrusted) detail::warn_untrusted_once("cache folder " + detail::join(root, sub), why);
  return t == detail::Trust::ok;
}

void write_file_atomic(const std::string& path, const std::string& data, const std::string& tmp_dir) {
  detail::make_dirs(tmp_dir);
  detail::make_dirs(detail::dirname(path));
  std::string templ = detail::join(tmp_dir, detail::basename(path) + ".XXXXXX");
  std::vector<char> name(templ.begin(), templ.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0) TDIST_FAIL("cannot create a temporary file '", templ, "': ", std::strerror(errno));
  std::string tmp(name.data());
  auto fail = [&](const char* what) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    TDIST_FAIL(what, " '", tmp, "' failed: ", std::strerror(err));
  };
  std::size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write");
    }
    done += std::size_t(n);
  }
  ::fchmod(fd, 0600);  // mkstemp makes it so already; said here because the cache relies on it
  if (::fsync(fd) != 0) fail("fsync");
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    TDIST_FAIL("rename '", tmp, "' -> '", path, "' failed: ", std::strerror(err));
  }
  // The rename itself is durable only once the folder is synced.
  int dfd = ::open(detail::dirname(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

KernelCache::KernelCache(std::string dir) : dir_(std::move(dir)) {}

KernelCache& KernelCache::global() {
  static KernelCache cache(detail::env_flag("TDIST_JIT_DISABLE_DISK_CACHE") ? std::string() : default_cache_dir());
  return cache;
}

std::string KernelCache::entry_path(const Digest& key) const {
  return detail::join(dir_, "kernels/" + to_hex(key) + ".tdk");
}

std::string KernelCache::serialize(const CompiledKernel& k) {
  std::vector<std::pair<std::string, const std::string*>> fields = {
      {"arch", &k.arch}, {"compiler", &k.compiler}, {"file_name", &k.file_name}, {"cubin", &k.cubin}, {"log", &k.log}};
  for (const auto& [expr, sym] : k.lowered_names) {
    fields.push_back({"expr", &expr});
    fields.push_back({"sym", &sym});
  }
  std::string s(kMagic, sizeof kMagic);
  put_u32(s, kFormat);
  put_u32(s, 0);
  std::size_t size_at = s.size();
  put_u64(s, 0);  // total size, patched below
  s.append(reinterpret_cast<const char*>(k.key.data()), k.key.size());
  put_u32(s, std::uint32_t(fields.size()));
  for (const auto& [tag, value] : fields) {
    put_u32(s, std::uint32_t(tag.size()));
    s += tag;
    put_u64(s, value->size());
    s += *value;
  }
  std::uint64_t total = s.size() + 32;
  for (int i = 0; i < 8; ++i) s[size_at + i] = char(total >> (8 * i));
  Digest trailer = sha256(s);
  s.append(reinterpret_cast<const char*>(trailer.data()), trailer.size());
  return s;
}

std::optional<CompiledKernel> KernelCache::deserialize(const std::string& b, const Digest& key) {
  if (b.size() < kHeader + 32 || std::memcmp(b.data(), kMagic, sizeof kMagic) != 0) return std::nullopt;
  if (get_uint(b, 8, 4) != kFormat || get_uint(b, 16, 8) != b.size()) return std::nullopt;
  Digest trailer;
  std::memcpy(trailer.data(), b.data() + b.size() - 32, 32);
  if (sha256(std::string_view(b.data(), b.size() - 32)) != trailer) return std::nullopt;
  CompiledKernel k;
  std::memcpy(k.key.data(), b.data() + 24, 32);
  if (k.key != key) return std::nullopt;
  std::size_t nfields = get_uint(b, 56, 4);
  std::size_t pos = kHeader, end = b.size() - 32;
  std::string pending_expr;
  bool have_expr = false;
  for (std::size_t f = 0; f < nfields; ++f) {
    if (end - pos < 4) return std::nullopt;
    std::size_t tlen = get_uint(b, pos, 4);
    pos += 4;
    if (end - pos < tlen + 8) return std::nullopt;
    std::string tag = b.substr(pos, tlen);
    pos += tlen;
    std::uint64_t vlen = get_uint(b, pos, 8);
    pos += 8;
    if (end - pos < vlen) return std::nullopt;
    std::string value = b.substr(pos, vlen);
    pos += vlen;
    if (tag == "arch")
      k.arch = std::move(value);
    else if (tag == "compiler")
      k.compiler = std::move(value);
    else if (tag == "file_name")
      k.file_name = std::move(value);
    else if (tag == "cubin")
      k.cubin = std::move(value);
    else if (tag == "log")
      k.log = std::move(value);
    else if (tag == "expr") {
      pending_expr = std::move(value);
      have_expr = true;
    } else if (tag == "sym") {
      if (!have_expr) return std::nullopt;
      k.lowered_names.emplace_back(std::move(pending_expr), std::move(value));
      have_expr = false;
    }
  }
  if (pos != end || have_expr || !detail::looks_like_elf(k.cubin)) return std::nullopt;
  parse_spills(k.log, k.spill_stores, k.spill_loads);
  return k;
}

std::shared_ptr<const CompiledKernel> KernelCache::lookup_memory(const Digest& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = memory_.find(to_hex(key));
  if (it == memory_.end()) return nullptr;
  memory_hits_++;
  return it->second;
}

std::shared_ptr<const CompiledKernel> KernelCache::lookup_disk(const Digest& key) {
  if (dir_.empty()) return nullptr;
  // An entry's checksum proves it intact, not who wrote it: only files and folders of this user
  // that no other user can write are read at all.
  if (!trusted_folder(dir_, "kernels")) return nullptr;
  std::string bytes;
  if (!read_trusted_file(entry_path(key), bytes)) {
    if (::access(entry_path(key).c_str(), F_OK) == 0) untrusted_++;
    return nullptr;
  }
  auto k = deserialize(bytes, key);
  if (!k) {
    corrupt_++;
    detail::verbose("ignoring corrupt cache entry " + entry_path(key));
    return nullptr;
  }
  auto ptr = std::make_shared<const CompiledKernel>(std::move(*k));
  disk_hits_++;
  std::lock_guard<std::mutex> lock(mu_);
  memory_[to_hex(key)] = ptr;
  return ptr;
}

std::shared_ptr<const CompiledKernel> KernelCache::lookup(const Digest& key) {
  if (auto k = lookup_memory(key)) return k;
  return lookup_disk(key);
}

void KernelCache::store(const std::shared_ptr<const CompiledKernel>& kernel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    memory_[to_hex(kernel->key)] = kernel;
  }
  stores_++;
  if (dir_.empty()) return;
  try {
    detail::make_dirs(detail::join(dir_, "kernels"));
    detail::make_dirs(detail::join(dir_, "tmp"));
    // Another user able to write these folders could swap the file between write and rename.
    if (!trusted_folder(dir_, "kernels") || !trusted_folder(dir_, "tmp")) return;
    write_file_atomic(entry_path(kernel->key), serialize(*kernel), detail::join(dir_, "tmp"));
  } catch (const Error& e) {
    // The kernel is compiled and in memory; a cache that cannot be written (read-only, full)
    // only costs a recompile in the next process.
    std::cerr << "[tdist.jit] warning: cannot write the cache entry: " << e.what() << std::endl;
  }
}

void KernelCache::clear_memory() {
  std::lock_guard<std::mutex> lock(mu_);
  memory_.clear();
}

KernelCache::Stats KernelCache::stats() const {
  Stats s;
  s.memory_hits = memory_hits_;
  s.disk_hits = disk_hits_;
  s.misses = misses_;
  s.corrupt = corrupt_;
  s.untrusted = untrusted_;
  s.stores = stores_;
  return s;
}

KernelCache::KeyLock::KeyLock(const KernelCache& cache, const Digest& key, double timeout_s) {
  if (cache.dir().empty()) return;
  std::string dir = detail::join(cache.dir(), "locks");
  try {
    detail::make_dirs(dir);
  } catch (const Error&) {
    return;  // a read-only cache still works, unlocked
  }
  // A lock another user can hold would stall every compile: lock only in a private folder.
  if (!trusted_folder(cache.dir(), "locks")) return;
  std::string path = detail::join(dir, to_hex(key) + ".lock");
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0) return;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto sleep = std::chrono::milliseconds(2);
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) break;
    if (std::chrono::steady_clock::now() > deadline) {
      detail::verbose("lock " + path + " still held after timeout; compiling without it");
      break;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

KernelCache::KeyLock::~KeyLock() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
}

}  // namespace tdist::jit
