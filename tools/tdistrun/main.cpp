// tdistrun: starts N local ranks of a program with the torchrun-style environment tdist reads,
// prefixes their output with the rank, and takes the whole job down as soon as one rank fails.
//
// Each rank runs in its own process group (so a rank's children are signalled with it) and
// gets PR_SET_PDEATHSIG, so the ranks die with the launcher even when it is SIGKILLed. Because
// the ranks are not in the terminal's foreground group, Ctrl-C reaches only tdistrun, which
// forwards it; for the same reason the ranks' stdin is /dev/null (reading the terminal from a
// background group would stop them).
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
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kExitUsage = 2;
constexpr int kExitCannotExec = 127;
constexpr int kExitTimeout = 124;
constexpr int kMaxRanks = 1024;
// A partial line longer than this is written out (with a newline) rather than buffered forever.
constexpr size_t kMaxPartialLine = 64 * 1024;

const char* const kUsage =
    "usage: tdistrun -n N [--master-port P] [--timeout S] [--kill-grace S] [--] program [args...]\n"
    "\n"
    "Starts N ranks of `program` on this machine, each with RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "LOCAL_WORLD_SIZE (=N), MASTER_ADDR=127.0.0.1 and MASTER_PORT set; rank R uses GPU R.\n"
    "NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set\n"
    "unless already set. Output lines are prefixed with \"[rank R] \"; stdin is /dev/null.\n"
    "\n"
    "  -n, --nproc N      number of ranks (required, >= 1)\n"
    "  --master-port P    rendezvous port (default: a free port picked by tdistrun)\n"
    "  --timeout S        terminate every rank after S seconds and exit with 124\n"
    "  --kill-grace S     seconds between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
    "  -h, --help         show this help\n"
    "\n"
    "When a rank exits non-zero or is killed, the others get SIGTERM (then SIGKILL after the\n"
    "grace period) and tdistrun exits with that rank's code (128+signal if it was killed).\n"
    "SIGINT, SIGTERM and SIGHUP are forwarded to every rank; a second one sends SIGKILL.\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "tdistrun: %s\nRun 'tdistrun --help' for usage.\n", message.c_str());
  std::exit(kExitUsage);
}

// ---------------------------------------------------------------------------------------------
// Command line

struct Options {
  int nproc = 0;
  int master_port = 0;                  // 0: pick a free one
  std::optional<double> timeout_s;
  double kill_grace_s = 5.0;
  std::vector<std::string> command;
};

int parse_int_option(const std::string& flag, const std::string& text, int lo, int hi) {
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || value < lo || value > hi)
    usage_error(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got '" + text + "'");
  return value;
}

double parse_seconds_option(const std::string& flag, const std::string& text, bool allow_zero) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const bool ok = !text.empty() && end == text.c_str() + text.size() && std::isfinite(value) &&
                  (allow_zero ? value >= 0 : value > 0) && value <= 1e7;
  if (!ok)
    usage_error(flag + " expects a " + (allow_zero ? "non-negative" : "positive") +
                " number of seconds, got '" + text + "'");
  return value;
}

Options parse_args(int argc, char** argv) {
  Options opt;
  int i = 1;
  // Value of an option given as "--flag value" or "--flag=value".
  auto value_of = [&](const std::string& arg, const std::string& flag) -> std::optional<std::string> {
    if (arg == flag) {
      if (i + 1 >= argc) usage_error(flag + " needs a value");
      return std::string(argv[++i]);
    }
    if (arg.rfind(flag + "=", 0) == 0) return arg.substr(flag.size() + 1);
    return std::nullopt;
  };
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (arg.empty() || arg[0] != '-') break;  // the program
    if (auto v = value_of(arg, "-n")) {
      opt.nproc = parse_int_option("-n", *v, 1, kMaxRanks);
    } else if (arg.size() > 2 && arg.rfind("-n", 0) == 0 && arg[2] != '-') {
      opt.nproc = parse_int_option("-n", arg.substr(2), 1, kMaxRanks);  // -n4
    } else if (auto v = value_of(arg, "--nproc")) {
      opt.nproc = parse_int_option("--nproc", *v, 1, kMaxRanks);
    } else if (auto v = value_of(arg, "--master-port")) {
      opt.master_port = parse_int_option("--master-port", *v, 1, 65535);
    } else if (auto v = value_of(arg, "--timeout")) {
      opt.timeout_s = parse_seconds_option("--timeout", *v, false);
    } else if (auto v = value_of(arg, "--kill-grace")) {
      opt.kill_grace_s = parse_seconds_option("--kill-grace", *v, true);
    } else {
      usage_error("unknown option '" + arg + "'");
    }
  }
  for (; i < argc; ++i) opt.command.emplace_back(argv[i]);
  if (opt.nproc == 0) usage_error("missing -n N (the number of ranks)");
  if (opt.command.empty()) usage_error("no program given");
  return opt;
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
    std::fprintf(stderr, "tdistrun: cannot find a free port (%s); pass --master-port\n",
                 std::strerror(errno));
    std::exit(1);
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

// One output pipe of a rank; complete lines go out prefixed, a partial line waits for the rest.
struct Stream {
  int fd = -1;     // read end of the pipe; -1 once at EOF
  int dest = 1;    // 1: stdout, 2: stderr
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
    if (!out.empty()) write_all(dest, out);
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
    write_all(dest, out);
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
    std::perror("tdistrun: pipe2");
    std::exit(1);
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

int exit_code_of(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

class Launcher {
 public:
  explicit Launcher(Options opt) : opt_(std::move(opt)) {}

  int run() {
    install_signal_handlers();
    const int port = opt_.master_port ? opt_.master_port : pick_free_port();
    if (opt_.timeout_s)
      timeout_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(*opt_.timeout_s));
    ranks_.resize(static_cast<size_t>(opt_.nproc));
    for (int r = 0; r < opt_.nproc && !exit_code_; ++r) start_rank(r, port);
    supervise();
    return exit_code_.value_or(0);
  }

 private:
  std::vector<std::string> rank_environment(int rank, int port) const {
    const std::vector<std::pair<std::string, std::string>> launch_vars = {
        {"RANK", std::to_string(rank)},           {"WORLD_SIZE", std::to_string(opt_.nproc)},
        {"LOCAL_RANK", std::to_string(rank)},     {"LOCAL_WORLD_SIZE", std::to_string(opt_.nproc)},
        {"MASTER_ADDR", "127.0.0.1"},             {"MASTER_PORT", std::to_string(port)}};
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
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0 ||
        ::pipe2(exec_pipe, O_CLOEXEC) != 0) {
      std::fprintf(stderr, "tdistrun: pipe2 failed: %s\n", std::strerror(errno));
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
      std::fprintf(stderr, "tdistrun: cannot start rank %d: fork failed: %s\n", r, std::strerror(fork_errno));
      fail(1);
      return;
    }
    ::setpgid(pid, pid);  // also in the parent, so that killpg works even before the child runs
    rank.pid = pid;
    rank.running = true;
    rank.out = Stream{out_pipe[0], 1, "[rank " + std::to_string(r) + "] ", {}};
    rank.err = Stream{err_pipe[0], 2, "[rank " + std::to_string(r) + "] ", {}};

    // The exec pipe closes on a successful exec; otherwise it carries exec's errno.
    int exec_errno = 0;
    ssize_t n;
    do n = ::read(exec_pipe[0], &exec_errno, sizeof(exec_errno)); while (n < 0 && errno == EINTR);
    ::close(exec_pipe[0]);
    if (n == sizeof(exec_errno)) {
      std::fprintf(stderr, "tdistrun: rank %d: cannot execute '%s': %s\n", r, argv[0],
                   std::strerror(exec_errno));
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
    kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(opt_.kill_grace_s));
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
          std::fprintf(stderr, "tdistrun: rank %d %s; stopping the other ranks\n", r.index,
                       describe_status(status).c_str());
          fail(exit_code_of(status));
        }
      }
    }
  }

  void on_signal_received(int sig) {
    if (sig == SIGCHLD) return;  // reap() runs after every wake-up anyway
    if (forwarded_signals_++ == 0) {
      std::fprintf(stderr, "tdistrun: received %s; forwarding it to every rank\n", sigabbrev(sig).c_str());
      if (!exit_code_) exit_code_ = 128 + sig;
      if (kill_at_) signal_all(sig);  // already stopping: forward it all the same
      else begin_shutdown(sig);
    } else {
      std::fprintf(stderr, "tdistrun: received %s again; killing every rank\n", sigabbrev(sig).c_str());
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
      for (Rank& r : ranks_)
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
      if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
        std::fprintf(stderr, "tdistrun: poll failed: %s\n", std::strerror(errno));
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
      std::fprintf(stderr, "tdistrun: timeout: ranks still running after %g s; stopping them\n",
                   *opt_.timeout_s);
      if (!exit_code_) exit_code_ = kExitTimeout;
      begin_shutdown(SIGTERM);
    }
    if (kill_at_ && !killed_ && now >= *kill_at_) {
      killed_ = true;
      for (const Rank& r : ranks_)
        if (r.running)
          std::fprintf(stderr, "tdistrun: rank %d still running %g s after SIGTERM; sending SIGKILL\n",
                       r.index, opt_.kill_grace_s);
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
  std::vector<Rank> ranks_;
  std::optional<int> exit_code_;
  std::optional<Clock::time_point> timeout_at_;
  std::optional<Clock::time_point> kill_at_;  // set once stopping began: SIGKILL at this time
  bool timed_out_ = false;
  bool killed_ = false;
  int forwarded_signals_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse_args(argc, argv);
  return Launcher(std::move(opt)).run();
}
