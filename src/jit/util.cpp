// Environment, file and process helpers of the JIT.
#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "detail.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/paths.hpp"

extern char** environ;

namespace tdist::jit::detail {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

bool env_flag(const char* name) { return tdist::env::flag(name, false); }

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string dirname(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string basename(const std::string& path) {
  auto pos = path.find_last_of('/');
  return pos == std::string::npos ? path : path.substr(pos + 1);
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (!b.empty() && b[0] == '/') return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_dir(path)) return;
  std::string parent = dirname(path);
  if (parent != path && parent != "." && parent != "/") make_dirs(parent);
  // Private: the cache must not be writable, nor its entries listable, by other users.
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST)
    TDIST_FAIL("cannot create folder '", path, "': ", std::strerror(errno));
}

Trust trust_of(const struct ::stat& st, const std::string& path, std::string& why) {
  const uid_t me = ::geteuid();
  if (st.st_uid != me) {
    why =
        path + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " + std::to_string(me) + ")";
    return Trust::untrusted;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    why = path + " has mode " + mode + ": writable by other users";
    return Trust::untrusted;
  }
  return Trust::ok;
}

Trust trust_path(const std::string& path, bool follow, std::string& why) {
  struct ::stat st;
  if ((follow ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st)) != 0) {
    why = path + ": " + std::strerror(errno);
    return errno == ENOENT ? Trust::missing : Trust::untrusted;
  }
  if (S_ISLNK(st.st_mode)) {
    why = path + " is a symbolic link inside the cache";
    return Trust::untrusted;
  }
  return trust_of(st, path, why);
}

void warn_untrusted_once(const std::string& what, const std::string& why) {
  static std::mutex mu;
  static std::set<std::string> warned;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned.insert(what).second) return;
  }
  std::cerr << "[tdist.jit] warning: ignoring " << what << ": " << why
            << " (the cache loads only files this user wrote; further ones are ignored silently)" << std::endl;
}

std::string make_temp_dir(const std::string& prefix) {
  std::string base = env("TMPDIR");
  if (base.empty() || !is_dir(base)) base = "/tmp";
  std::string templ = join(base, prefix + "XXXXXX");
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) TDIST_FAIL("mkdtemp('", templ, "') failed: ", std::strerror(errno));
  return std::string(buf.data());
}

void remove_tree(const std::string& path) {
  if (path.empty()) return;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      std::string child = join(path, name);
      struct stat st;
      if (::lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
        remove_tree(child);
      else
        ::unlink(child.c_str());
    }
    ::closedir(d);
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

bool file_digest(const std::string& path, Digest& out) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  using Stamp = std::tuple<dev_t, ino_t, off_t, long, long, long, long>;
  Stamp stamp{st.st_dev,          st.st_ino,         st.st_size,        st.st_mtim.tv_sec,
              st.st_mtim.tv_nsec, st.st_ctim.tv_sec, st.st_ctim.tv_nsec};
  static std::mutex mu;
  static std::map<std::string, std::pair<Stamp, Digest>> memo;
  // File times tick with the kernel's coarse clock (milliseconds), so two writes of the same
  // size in a row can leave the same stamp: trust stamps only of files unchanged for a while.
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  bool settled = now.tv_sec - std::max(st.st_mtim.tv_sec, st.st_ctim.tv_sec) >= 2;
  if (settled) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = memo.find(path);
    if (it != memo.end() && it->second.first == stamp) {
      out = it->second.second;
      return true;
    }
  }
  std::string data;
  if (!tdist::jit::read_file(path, data)) return false;
  out = sha256(data);
  if (!settled) return true;
  std::lock_guard<std::mutex> lock(mu);
  memo[path] = {stamp, out};
  return true;
}

ProcessResult run_process(const std::vector<std::string>& argv) {
  ProcessResult r;
  if (argv.empty()) return r;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return r;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    r.output = std::string("cannot start '") + argv[0] + "': " + std::strerror(rc);
    return r;
  }
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      r.output.append(buf, std::size_t(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status))
    r.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    r.exit_code = 128 + WTERMSIG(status);
  return r;
}

std::string find_tool(const std::string& name) {
  std::vector<std::string> dirs;
  std::string nvcc = nvcc_path();
  if (nvcc.find('/') != std::string::npos) dirs.push_back(dirname(nvcc));
  std::string home = cuda_home();
  if (!home.empty()) dirs.push_back(join(home, "bin"));
  std::string path = env("PATH");
  for (std::size_t start = 0; start <= path.size();) {
    auto end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    if (end > start) dirs.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  for (const auto& d : dirs) {
    std::string p = join(d, name);
    if (::access(p.c_str(), X_OK) == 0 && file_exists(p)) return p;
  }
  return "";
}

void verbose(const std::string& line) {
  if (env_flag("TDIST_JIT_VERBOSE")) std::cerr << "[tdist.jit] " << line << std::endl;
}

}  // namespace tdist::jit::detail
