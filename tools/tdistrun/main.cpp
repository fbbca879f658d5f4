// tdistrun: starts N local ranks of a program with the torchrun-style environment tdist reads,
// prefixes their output with the rank, and takes the whole job down as soon as one rank fails.
//
// Each rank runs in its own process group (so a rank's children are signalled with it) and
// gets PR_SET_PDEATHSIG, so the ranks die with the launcher even when it is SIGKILLed. Because
// the ranks are not in the terminal's foreground group, Ctrl-C reaches only tdistrun, which
// forwards it; for the same reason the ranks' stdin is /dev/null (reading the terminal from a
// background group would stop them).
//
// The control loop never blocks on output: lines go to a writer thread per destination, and when
// stdout or stderr stops draining the loop stops reading the ranks' pipes (so the ranks wait in
// their own writes) while --timeout, signals and failures are still handled on time. A watchdog
// process, forked before any rank, kills every rank's process group (grandchildren included) if
// the launcher itself dies without cleaning up (SIGKILL).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tdist/common/cli.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kExitCannotExec = 127;
constexpr int kExitTimeout = 124;
constexpr int kMaxRanks = 1024;
// A partial line longer than this is written out (with a newline) rather than buffered forever.
constexpr size_t kMaxPartialLine = 64 * 1024;
// Output waiting for a slow stdout/stderr beyond this: stop reading the ranks' pipes until it drains.
constexpr size_t kMaxQueuedOutput = 8u << 20;

const char* const kDescription =
    "Starts N ranks of `program` on this machine, each with RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "LOCAL_WORLD_SIZE (=N), MASTER_ADDR=127.0.0.1 and MASTER_PORT set; rank R uses GPU R.\n"
    "NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set\n"
    "unless already set, and TDIST_STORE_SECRET (a random key for the job's rendezvous store)\n"
    "unless the user set one. Output lines are prefixed with \"[rank R] \"; stdin is /dev/null.";

const char* const kEpilog =
    "When a rank exits non-zero or is killed, the others get SIGTERM (then SIGKILL after the\n"
    "grace period) and tdistrun exits with that rank's code (128+signal if it was killed).\n"
    "SIGINT, SIGTERM and SIGHUP are forwarded to every rank; a second one sends SIGKILL.\n"
    "Each rank runs in its own process group; the whole group is ended with the job.\n";

// ---------------------------------------------------------------------------------------------
// Command line

struct Options {
  int nproc = 0;
  int master_port = 0;  // 0: pick a free one
  std::optional<double> timeout_s;
  double kill_grace_s = 5.0;
  std::vector<std::string> command;
};

double parse_seconds(const std::string& flag, const std::string& text, bool allow_zero) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const bool ok = !text.empty() && end == text.c_str() + text.size() && std::isfinite(value) &&
                  (allow_zero ? value >= 0 : value > 0) && value <= 1e7;
  if (!ok)
    throw tdist::cli::UsageError(flag + " expects a " + (allow_zero ? "non-negative" : "positive") +
                                 " number of seconds, got '" + text + "'");
  return value;
}

Options parse_args(int argc, char** argv) {
  Options opt;
  tdist::cli::Parser p("tdistrun", kDescription);
  p.usage("-n N [--master-port P] [--timeout S] [--kill-grace S] [--] program [args...]");
  p.option("-n,--nproc", "N", "number of ranks (required, >= 1)", &opt.nproc, 1, kMaxRanks);
  p.option("--master-port", "P", "rendezvous port (default: a free port picked by tdistrun)", &opt.master_port, 1,
           65535);
  p.option("--timeout", "S", "terminate every rank after S seconds and exit with 124",
           [&](const std::string& v) { opt.timeout_s = parse_seconds("--timeout", v, false); });
  p.option("--kill-grace", "S", "seconds between SIGTERM and SIGKILL when stopping ranks (default 5)",
           [&](const std::string& v) { opt.kill_grace_s = parse_seconds("--kill-grace", v, true); });
  p.positional("program [args...]", "the program each rank runs, with its arguments", &opt.command,
               /*stop_at_first=*/true);
  p.epilog(kEpilog);
  p.parse(argc, argv);
  if (opt.nproc == 0) p.fail("missing -n N (the number of ranks)");
  if (opt.command.empty()) p.fail("no program given");
  return opt;
}

// 32 hex characters from /dev/urandom: the job's TDIST_STORE_SECRET.
std::string random_secret() {
  unsigned char bytes[16];
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  size_t got = 0;
  while (fd >= 0 && got < sizeof(bytes)) {
    const ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (fd >= 0) ::close(fd);
  if (got != sizeof(bytes)) throw std::runtime_error("cannot read 16 bytes from /dev/urandom for TDIST_STORE_SECRET");
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

// Asks the kernel for a free port. Another process could take it before rank 0 binds it; the
// window is short, and the store's error then names the port and says to pass --master-port.
int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error(std::string("cannot find a free port (") + std::strerror(errno) + "); pass --master-port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// ---------------------------------------------------------------------------------------------
// Output

void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the reader went away: drop the output, keep managing the ranks
    done += static_cast<size_t>(n);
  }
}

// The launcher's stdout or stderr: a thread does the (blocking) writes, so that a reader that
// stops draining never stalls the control loop.
class Sink {
 public:
  explicit Sink(int fd) : fd_(fd), thread_([this] { loop(); }) { thread_.detach(); }

  void push(std::string data) {
    if (data.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    queued_ += data.size();
    queue_.push_back(std::move(data));
    cv_.notify_one();
  }
  size_t queued() {
    std::lock_guard<std::mutex> lock(mu_);
    return queued_;
  }
  // Waits until everything queued is written, or `deadline`; true if drained.
  bool drain(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return drained_.wait_until(lock, deadline, [&] { return queued_ == 0; });
  }

 private:
  void loop() {
    for (;;) {
      std::string data;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        data = std::move(queue_.front());
        queue_.pop_front();
      }
      write_all(fd_, data);
      std::lock_guard<std::mutex> lock(mu_);
      queued_ -= data.size();
      if (queued_ == 0) drained_.notify_all();
    }
  }

  int fd_;
  std::mutex mu_;
  std::condition_variable cv_, drained_;
  std::deque<std::string> queue_;
  size_t queued_ = 0;   // bytes queued or being written
  std::thread thread_;  // detached: at exit it may still be blocked in write()
};

Sink* g_sinks[3] = {nullptr, nullptr, nullptr};  // [1] stdout, [2] stderr once the launcher runs

// The launcher's own messages, through the stderr sink (or directly before it exists).
void note(const std::string& line) {
  const std::string text = "tdistrun: " + line + "\n";
  if (g_sinks[2] != nullptr)
    g_sinks[2]->push(text);
  else
    write_all(2, text);
}

// One output pipe of a rank; complete lines go out prefixed, a partial line waits for the rest.
struct Stream {
  int fd = -1;   // read end of the pipe; -1 once at EOF
  int dest = 1;  // 1: stdout, 2: stderr
  std::string prefix;
  std::string partial;

  void emit(const char* data, size_t size) {
    std::string out;
    size_t start = 0;
    for (size_t i = 0; i < size; ++i) {
      if (data[i] != '\n') continue;
      out += prefix;
      out += partial;
      out.append(data + start, i + 1 - start);
      partial.clear();
      start = i + 1;
    }
    partial.append(data + start, size - start);
    if (partial.size() > kMaxPartialLine) flush_partial(out);
    g_sinks[dest]->push(std::move(out));
  }
  void flush_partial(std::string& out) {
    if (partial.empty()) return;
    out += prefix + partial + "\n";
    partial.clear();
  }
  // Reads what is available; closes the pipe at EOF.
  void read_some() {
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n > 0) {
      emit(buf, static_cast<size_t>(n));
      return;
    }
    close_and_flush();
  }
  void close_and_flush() {
    if (fd >= 0) ::close(fd);
    fd = -1;
    std::string out;
    flush_partial(out);
    g_sinks[dest]->push(std::move(out));
  }
};

// ---------------------------------------------------------------------------------------------
// Signals: the handler only writes the signal number into a pipe that the poll loop watches.

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};

void install_signal_handlers() {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (int sig : kForwardedSignals) ::sigaction(sig, &sa, nullptr);
  ::sigaction(SIGCHLD, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill the launcher mid-job
}

// ---------------------------------------------------------------------------------------------
// Ranks

struct Rank {
  int index = 0;
  pid_t pid = -1;  // also its process group id
  bool running = false;
  Stream out, err;
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

class Launcher {
 public:
  explicit Launcher(Options opt) : opt_(std::move(opt)) {}

  int run() {
    start_watchdog();
    install_signal_handlers();
    for (int fd : {1, 2}) g_sinks[fd] = new Sink(fd);  // never freed: its thread may outlive main
    if (std::getenv("TDIST_STORE_SECRET") == nullptr) secret_ = random_secret();
    const int port = opt_.master_port ? opt_.master_port : pick_free_port();
    if (opt_.timeout_s)
      timeout_at_ =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*opt_.timeout_s));
    ranks_.resize(static_cast<size_t>(opt_.nproc));
    for (int r = 0; r < opt_.nproc && !exit_code_; ++r) start_rank(r, port);
    supervise();
    stop_watchdog();
    return exit_code_.value_or(0);
  }

  // Whether the job ended by a timeout or a signal (then output is not waited for long).
  bool interrupted() const { return timed_out_ || forwarded_signals_ > 0; }

 private:
  // The watchdog: a process of its own group that outlives a SIGKILLed launcher. It reads each
  // rank's process-group id from a pipe; at end of file without the all-clear (a zero), the
  // launcher died without stopping the job, and it SIGKILLs every group, grandchildren included
  // (PR_SET_PDEATHSIG reaches the ranks only).
  void start_watchdog() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::close(fds[1]);
      ::setpgid(0, 0);  // a kill of the launcher's group (a CI timeout) leaves it to clean up
      for (int sig : kForwardedSignals) ::signal(sig, SIG_IGN);
      const int devnull = ::open("/dev/null", O_RDWR);
      for (int fd : {0, 1, 2})
        if (devnull >= 0) ::dup2(devnull, fd);
      static pid_t groups[kMaxRanks];
      int n = 0;
      bool all_clear = false;
      for (;;) {
        pid_t group = 0;
        const ssize_t got = ::read(fds[0], &group, sizeof(group));
        if (got < 0 && errno == EINTR) continue;
        if (got != static_cast<ssize_t>(sizeof(group))) break;
        if (group == 0) {
          all_clear = true;
          break;
        }
        if (n < kMaxRanks) groups[n++] = group;
      }
      if (!all_clear)
        for (int i = 0; i < n; ++i) ::killpg(groups[i], SIGKILL);
      ::_exit(0);
    }
    ::close(fds[0]);
    watchdog_fd_ = fds[1];
    watchdog_pid_ = pid;
  }

  void tell_watchdog(pid_t group) {
    if (watchdog_fd_ < 0) return;
    ssize_t n;
    do n = ::write(watchdog_fd_, &group, sizeof(group));
    while (n < 0 && errno == EINTR);
  }

  // Every group has been signalled by now: the all-clear, then the watchdog exits.
  void stop_watchdog() {
    tell_watchdog(0);
    ::close(watchdog_fd_);
    watchdog_fd_ = -1;
    int status;
    while (::waitpid(watchdog_pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }

  std::vector<std::string> rank_environment(int rank, int port) const {
    std::vector<std::pair<std::string, std::string>> launch_vars = {
        {"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(opt_.nproc)},
        {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(opt_.nproc)},
        {"MASTER_ADDR", "127.0.0.1"},         {"MASTER_PORT", std::to_string(port)}};
    // One random key per job for the rendezvous store, unless the user chose one.
    if (!secret_.empty()) launch_vars.emplace_back("TDIST_STORE_SECRET", secret_);
    // NVLink multicast stays off on shared hosts unless the user chose otherwise.
    const std::pair<const char*, const char*> safety_defaults[] = {
        {"NCCL_NVLS_ENABLE", "0"}, {"NVSHMEM_DISABLE_NVLS", "1"}, {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"}};
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      bool overridden = false;
      for (const auto& [var, value] : launch_vars) overridden = overridden || var == name;
      if (!overridden) env.push_back(entry);
    }
    for (const auto& [var, value] : launch_vars) env.push_back(var + "=" + value);
    for (const auto& [var, value] : safety_defaults)
      if (std::getenv(var) == nullptr) env.push_back(std::string(var) + "=" + value);
    return env;
  }

  void start_rank(int r, int port) {
    Rank& rank = ranks_[r];
    rank.index = r;
    std::vector<std::string> env = rank_environment(r, port);
    std::vector<char*> envp, argv;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    for (auto& s : opt_.command) argv.push_back(s.data());
    argv.push_back(nullptr);

    int out_pipe[2], err_pipe[2], exec_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0 || ::pipe2(exec_pipe, O_CLOEXEC) != 0) {
      note(std::string("pipe2 failed: ") + std::strerror(errno));
      fail(1);
      return;
    }
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    const pid_t launcher_pid = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(1);  // the launcher died before prctl took effect
      for (int sig : kForwardedSignals) ::signal(sig, SIG_DFL);
      ::signal(SIGCHLD, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(out_pipe[1], 1);
      ::dup2(err_pipe[1], 2);
      ::execvpe(argv[0], argv.data(), envp.data());
      const int err = errno;
      [[maybe_unused]] ssize_t n = ::write(exec_pipe[1], &err, sizeof(err));
      ::_exit(kExitCannotExec);
    }
    const int fork_errno = errno;
    if (devnull >= 0) ::close(devnull);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    ::close(exec_pipe[1]);
    if (pid < 0) {
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
      ::close(exec_pipe[0]);
      note("cannot start rank " + std::to_string(r) + ": fork failed: " + std::strerror(fork_errno));
      fail(1);
      return;
    }
    ::setpgid(pid, pid);  // also in the parent, so that killpg works even before the child runs
    tell_watchdog(pid);
    rank.pid = pid;
    rank.running = true;
    rank.out = Stream{out_pipe[0], 1, "[rank " + std::to_string(r) + "] ", {}};
    rank.err = Stream{err_pipe[0], 2, "[rank " + std::to_string(r) + "] ", {}};

    // The exec pipe closes on a successful exec; otherwise it carries exec's errno.
    int exec_errno = 0;
    ssize_t n;
    do n = ::read(exec_pipe[0], &exec_errno, sizeof(exec_errno));
    while (n < 0 && errno == EINTR);
    ::close(exec_pipe[0]);
    if (n == sizeof(exec_errno)) {
      note("rank " + std::to_string(r) + ": cannot execute '" + argv[0] + "': " + std::strerror(exec_errno));
      fail(kExitCannotExec);
    }
  }

  // Records the job's exit code (the first failure wins) and starts stopping every rank.
  void fail(int code) {
    if (!exit_code_) exit_code_ = code;
    begin_shutdown(SIGTERM);
  }

  void begin_shutdown(int sig) {
    if (kill_at_) return;
    signal_all(sig);
    kill_at_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt_.kill_grace_s));
  }

  // Signals every rank's whole process group. Finished ranks are included: children they left
  // behind in their group must not outlive the job.
  void signal_all(int sig) {
    for (const Rank& r : ranks_)
      if (r.pid > 0) ::killpg(r.pid, sig);
  }

  void reap() {
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (Rank& r : ranks_) {
        if (r.pid != pid) continue;
        r.running = false;
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        // Ranks stopped by the shutdown are not news; the first failure is.
        if (failed && !kill_at_) {
          note("rank " + std::to_string(r.index) + " " + describe_status(status) + "; stopping the other ranks");
          fail(exit_code_of(status));
        }
      }
    }
  }

  void on_signal_received(int sig) {
    if (sig == SIGCHLD) return;  // reap() runs after every wake-up anyway
    if (forwarded_signals_++ == 0) {
      note("received " + sigabbrev(sig) + "; forwarding it to every rank");
      if (!exit_code_) exit_code_ = 128 + sig;
      if (kill_at_)
        signal_all(sig);  // already stopping: forward it all the same
      else
        begin_shutdown(sig);
    } else {
      note("received " + sigabbrev(sig) + " again; killing every rank");
      signal_all(SIGKILL);
    }
  }

  static std::string sigabbrev(int sig) {
    const char* name = ::sigabbrev_np(sig);
    return name ? std::string("SIG") + name : "signal " + std::to_string(sig);
  }

  bool any_running() const {
    for (const Rank& r : ranks_)
      if (r.running) return true;
    return false;
  }

  // Waits for every rank while copying their output and watching the signal pipe and timers.
  void supervise() {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    while (any_running()) {
      fds.clear();
      streams.clear();
      fds.push_back({g_signal_pipe[0], POLLIN, 0});
      // While stdout/stderr do not drain, the ranks' pipes are left unread (the ranks then wait in
      // their writes); timers and signals are handled all the same.
      const bool throttled = g_sinks[1]->queued() + g_sinks[2]->queued() > kMaxQueuedOutput;
      for (Rank& r : ranks_)
        if (!throttled)
          for (Stream* s : {&r.out, &r.err})
            if (s->fd >= 0) {
              fds.push_back({s->fd, POLLIN, 0});
              streams.push_back(s);
            }
      std::optional<Clock::time_point> next;
      if (timeout_at_ && !timed_out_) next = timeout_at_;
      if (kill_at_ && !killed_) next = next ? std::min(*next, *kill_at_) : *kill_at_;
      int wait_ms = -1;
      if (next) {
        auto left = std::chrono::ceil<std::chrono::milliseconds>(*next - Clock::now()).count();
        wait_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
      }
      if (throttled) wait_ms = wait_ms < 0 ? 20 : std::min(wait_ms, 20);
      if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
        note(std::string("poll failed: ") + std::strerror(errno));
        fail(1);
      }
      if (fds[0].revents & POLLIN) {
        unsigned char sigs[64];
        ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof(sigs));
        for (ssize_t i = 0; i < n; ++i) on_signal_received(sigs[i]);
      }
      for (size_t i = 0; i < streams.size(); ++i)
        if (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) streams[i]->read_some();
      reap();
      check_timers();
    }
    signal_all(SIGKILL);  // whatever the ranks left behind in their groups
    drain_output();
  }

  void check_timers() {
    const auto now = Clock::now();
    if (timeout_at_ && !timed_out_ && now >= *timeout_at_) {
      timed_out_ = true;
      note("timeout: ranks still running after " + seconds(*opt_.timeout_s) + " s; stopping them");
      if (!exit_code_) exit_code_ = kExitTimeout;
      begin_shutdown(SIGTERM);
    }
    if (kill_at_ && !killed_ && now >= *kill_at_) {
      killed_ = true;
      for (const Rank& r : ranks_)
        if (r.running)
          note("rank " + std::to_string(r.index) + " still running " + seconds(opt_.kill_grace_s) +
               " s after SIGTERM; sending SIGKILL");
      signal_all(SIGKILL);
    }
  }

  // Copies what the ranks wrote before exiting. A writer that escaped its process group could
  // keep a pipe open forever, so this is bounded.
  void drain_output() {
    const auto give_up_at = Clock::now() + std::chrono::seconds(2);
    for (Rank& r : ranks_) {
      for (Stream* s : {&r.out, &r.err}) {
        while (s->fd >= 0) {
          pollfd p{s->fd, POLLIN, 0};
          auto left = std::chrono::ceil<std::chrono::milliseconds>(give_up_at - Clock::now()).count();
          if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) == 0) {
            s->close_and_flush();
            break;
          }
          s->read_some();
        }
      }
    }
  }

  Options opt_;
  std::string secret_;  // TDIST_STORE_SECRET given to the ranks; empty: the user's passes through
  int watchdog_fd_ = -1;
  pid_t watchdog_pid_ = -1;
  std::vector<Rank> ranks_;
  std::optional<int> exit_code_;
  std::optional<Clock::time_point> timeout_at_;
  std::optional<Clock::time_point> kill_at_;  // set once stopping began: SIGKILL at this time
  bool timed_out_ = false;
  bool killed_ = false;
  int forwarded_signals_ = 0;
};

// Waits for the writer threads to pass on what was queued: as long as they make progress, or a
// second after a timeout or signal (a reader that stopped must not hold the launcher).
void flush_sinks(bool interrupted) {
  for (int fd : {1, 2}) {
    Sink* sink = g_sinks[fd];
    if (sink == nullptr) continue;
    size_t last = SIZE_MAX;
    while (!sink->drain(Clock::now() + std::chrono::seconds(1))) {
      const size_t now = sink->queued();
      if (interrupted || now >= last) break;
      last = now;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);
  return tdist::cli::run_main("tdistrun", [&] {
    Launcher launcher(opt);
    int code = 0;
    try {
      code = launcher.run();
    } catch (...) {
      flush_sinks(true);
      throw;
    }
    flush_sinks(launcher.interrupted());
    return code;
  });
}
