// The tdistrun launcher, run as a real binary on small shell commands.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tdist/runtime/launch_env.hpp"
#include "tdist/runtime/tcp_store.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// tools/CMakeLists.txt builds every tool in the tools/ build folder.
const std::string kTdistrun = std::string(TDIST_BINARY_DIR) + "/tools/tdistrun";

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}
#define EXPECT_CONTAINS(haystack, needle) EXPECT_PRED2(contains, haystack, needle)
#define EXPECT_NOT_CONTAINS(haystack, needle) EXPECT_FALSE(contains(haystack, needle)) << haystack

// True while `pid` exists and is not a zombie.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno != ESRCH;
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

bool wait_until(const std::function<bool()>& cond, std::chrono::milliseconds limit) {
  const auto give_up = Clock::now() + limit;
  while (Clock::now() < give_up) {
    if (cond()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return cond();
}

struct Result {
  int exit_code = -1;  // 128+signal when tdistrun itself was killed
  std::string out, err;
  double seconds = 0;
};

class Tdistrun : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(access(kTdistrun.c_str(), X_OK), 0)
        << kTdistrun << " is missing: build the 'tdistrun' target before running this test";
    char tmpl[] = "/tmp/tdistrun_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  pid_t read_pid(const std::string& name) const {
    std::string text;
    if (!wait_until([&] { return !(text = read_file(path(name))).empty() && text.back() == '\n'; }, 5s)) return -1;
    return static_cast<pid_t>(std::stol(text));
  }

  // Runs tdistrun with `args`; `env` adds NAME=VALUE entries; `during` runs while it does.
  Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
             const std::function<void(pid_t)>& during = {}, std::chrono::seconds limit = 25s) {
    const std::string out_path = path("launcher.out"), err_path = path("launcher.err");
    const auto start = Clock::now();
    const pid_t pid = fork();
    if (pid == 0) {
      const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(out, 1);
      dup2(err, 2);
      for (const auto& e : env) putenv(strdup(e.c_str()));
      std::vector<char*> argv{const_cast<char*>(kTdistrun.c_str())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(99);
    }
    if (during) during(pid);
    int status = 0;
    const bool ended = wait_until([&] { return waitpid(pid, &status, WNOHANG) == pid; }, limit);
    if (!ended) {
      ADD_FAILURE() << "tdistrun still running after " << limit.count() << " s";
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
    Result r;
    r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = read_file(out_path);
    r.err = read_file(err_path);
    return r;
  }

  fs::path dir_;
};

TEST_F(Tdistrun, Help) {
  Result r = run({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_CONTAINS(r.out, "usage: tdistrun -n N");
}

TEST_F(Tdistrun, BadArguments) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"true"}, "missing -n N"},
      {{"-n", "0", "true"}, "-n expects an integer in [1, 1024], got '0'"},
      {{"-n", "two", "true"}, "got 'two'"},
      {{"-n", "2x", "true"}, "got '2x'"},
      {{"-n"}, "-n needs a value"},
      {{"--bogus", "-n", "2", "true"}, "unknown option '--bogus'"},
      {{"-n", "2"}, "no program given"},
      {{"-n", "2", "--"}, "no program given"},
      {{"-n", "2", "--master-port", "70000", "true"}, "--master-port expects an integer in [1, 65535]"},
      {{"-n", "2", "--timeout", "-1", "true"}, "--timeout expects a positive number of seconds"},
  };
  for (const auto& c : cases) {
    Result r = run(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.message;
    EXPECT_CONTAINS(r.err, c.message);
    EXPECT_CONTAINS(r.err, "tdistrun --help");
  }
}

TEST_F(Tdistrun, SetsTheEnvironmentOfEveryRank) {
  const std::string print =
      "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
      "$NCCL_NVLS_ENABLE $NVSHMEM_DISABLE_NVLS $TORCH_SYMM_MEM_DISABLE_MULTICAST $KEPT\"";
  // Stale launch variables are replaced; the user's own variables are kept.
  Result r =
      run({"-n", "3", "--master-port", "23456", "--", "sh", "-c", print}, {"RANK=7", "WORLD_SIZE=9", "KEPT=yes"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string R = std::to_string(rank);
    EXPECT_CONTAINS(r.out, "[rank " + R + "] " + R + " 3 " + R + " 3 127.0.0.1 23456 0 1 1 yes\n");
  }
  // A multicast setting chosen by the user is left alone.
  r = run({"-n", "1", "sh", "-c", "echo $NCCL_NVLS_ENABLE"}, {"NCCL_NVLS_ENABLE=1"});
  EXPECT_EQ(r.out, "[rank 0] 1\n");
}

TEST_F(Tdistrun, PicksOneFreePortForAllRanks) {
  Result r = run({"-n", "2", "sh", "-c", "echo port $MASTER_PORT"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const size_t at0 = r.out.find("[rank 0] port ");
  const size_t at1 = r.out.find("[rank 1] port ");
  ASSERT_NE(at0, std::string::npos) << r.out;
  ASSERT_NE(at1, std::string::npos) << r.out;
  const int port0 = std::stoi(r.out.substr(at0 + 14));
  const int port1 = std::stoi(r.out.substr(at1 + 14));
  EXPECT_EQ(port0, port1);
  EXPECT_GE(port0, 1);
  EXPECT_LE(port0, 65535);
}

TEST_F(Tdistrun, PrefixesOutputLines) {
  Result r = run({"-n", "2", "sh", "-c", "echo out$RANK; echo err$RANK >&2; echo two$RANK; printf partial$RANK"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const std::string R : {"0", "1"}) {
    EXPECT_CONTAINS(r.out, "[rank " + R + "] out" + R + "\n");
    EXPECT_CONTAINS(r.out, "[rank " + R + "] two" + R + "\n");
    EXPECT_CONTAINS(r.out, "[rank " + R + "] partial" + R + "\n");  // flushed at exit
    EXPECT_CONTAINS(r.err, "[rank " + R + "] err" + R + "\n");
  }
  EXPECT_NOT_CONTAINS(r.out, "err");
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
}

TEST_F(Tdistrun, SuccessExitsZeroQuietly) {
  Result r = run({"-n", "4", "true"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(r.out, "");
}

TEST_F(Tdistrun, FailingRankStopsTheOthers) {
  // Rank 0 records its pid and sleeps; rank 1 fails once rank 0 is up.
  const std::string script = "if [ $RANK = 0 ]; then echo $$ > " + path("pid0.tmp") + "; mv " + path("pid0.tmp") + " " +
                             path("pid0") + "; exec sleep 60; fi; while [ ! -f " + path("pid0") +
                             " ]; do sleep 0.05; done; exit 3";
  Result r = run({"-n", "2", "sh", "-c", script});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_CONTAINS(r.err, "tdistrun: rank 1 exited with code 3");
  EXPECT_LT(r.seconds, 4.0);  // rank 0 is stopped, not waited for
  const pid_t pid0 = read_pid("pid0");
  ASSERT_GT(pid0, 0);
  EXPECT_FALSE(process_alive(pid0));
}

TEST_F(Tdistrun, RankKilledBySignal) {
  const std::string script = "if [ $RANK = 0 ]; then exec sleep 60; fi; kill -KILL $$";
  Result r = run({"-n", "2", "sh", "-c", script});
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_CONTAINS(r.err, "tdistrun: rank 1 killed by signal 9");
  EXPECT_LT(r.seconds, 4.0);
}

TEST_F(Tdistrun, ProgramThatCannotStart) {
  Result r = run({"-n", "2", "/nonexistent/program", "arg"});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_CONTAINS(r.err, "cannot execute '/nonexistent/program': No such file or directory");
  r = run({"-n", "2", "no-such-program-in-path-xyz"});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_CONTAINS(r.err, "cannot execute 'no-such-program-in-path-xyz'");
  // Not executable.
  const std::string file = path("plain.txt");
  std::ofstream(file) << "hello\n";
  r = run({"-n", "1", file});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_CONTAINS(r.err, "Permission denied");
}

TEST_F(Tdistrun, ForwardsSigterm) {
  // Each rank handles SIGTERM by printing and exiting 0.
  const std::string script =
      "trap 'echo got TERM; exit 0' TERM; touch " + path("ready") + "$RANK; while :; do sleep 0.05; done";
  Result r = run({"-n", "2", "sh", "-c", script}, {}, [&](pid_t launcher) {
    ASSERT_TRUE(wait_until([&] { return fs::exists(path("ready0")) && fs::exists(path("ready1")); }, 5s));
    kill(launcher, SIGTERM);
  });
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_CONTAINS(r.err, "received SIGTERM");
  EXPECT_CONTAINS(r.out, "[rank 0] got TERM\n");
  EXPECT_CONTAINS(r.out, "[rank 1] got TERM\n");
  EXPECT_LT(r.seconds, 6.0);
}

TEST_F(Tdistrun, ForwardsSigint) {
  Result r = run({"-n", "2", "sh", "-c", "touch " + path("ready") + "$RANK; exec sleep 60"}, {}, [&](pid_t launcher) {
    ASSERT_TRUE(wait_until([&] { return fs::exists(path("ready0")) && fs::exists(path("ready1")); }, 5s));
    std::this_thread::sleep_for(100ms);  // let the ranks reach exec
    kill(launcher, SIGINT);
  });
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.err;
  EXPECT_LT(r.seconds, 6.0);
}

TEST_F(Tdistrun, Timeout) {
  Result r = run({"--timeout", "1", "-n", "2", "sleep", "60"});
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_CONTAINS(r.err, "tdistrun: timeout");
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 4.0);
}

TEST_F(Tdistrun, SigkillAfterGracePeriod) {
  // Rank 0 ignores SIGTERM; rank 1 fails once rank 0 is up.
  const std::string script = "if [ $RANK = 0 ]; then trap '' TERM; echo $$ > " + path("pid0.tmp") + "; mv " +
                             path("pid0.tmp") + " " + path("pid0") + "; exec sleep 60; fi; while [ ! -f " +
                             path("pid0") + " ]; do sleep 0.05; done; exit 1";
  Result r = run({"--kill-grace", "0.5", "-n", "2", "sh", "-c", script});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_CONTAINS(r.err, "rank 0 still running 0.5 s after SIGTERM; sending SIGKILL");
  EXPECT_GE(r.seconds, 0.5);
  EXPECT_LT(r.seconds, 4.0);
  const pid_t pid0 = read_pid("pid0");
  ASSERT_GT(pid0, 0);
  EXPECT_FALSE(process_alive(pid0));
}

TEST_F(Tdistrun, KillsLeftoverChildrenOfARank) {
  // A rank leaves a background child in its process group and exits 0; it must not survive.
  const std::string script =
      "sleep 60 & echo $! > " + path("child.tmp") + "; mv " + path("child.tmp") + " " + path("child") + "; exit 0";
  Result r = run({"-n", "1", "sh", "-c", script});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 4.0);
  const pid_t child = read_pid("child");
  ASSERT_GT(child, 0);
  EXPECT_TRUE(wait_until([&] { return !process_alive(child); }, 2s));
}

TEST_F(Tdistrun, RanksDieWithTheLauncher) {
  std::vector<pid_t> ranks;
  Result r = run({"-n", "2", "sh", "-c",
                  "echo $$ > " + path("pid") + "$RANK.tmp; mv " + path("pid") + "$RANK.tmp " + path("pid") +
                      "$RANK; exec sleep 60"},
                 {}, [&](pid_t launcher) {
                   for (const char* name : {"pid0", "pid1"}) ranks.push_back(read_pid(name));
                   kill(launcher, SIGKILL);  // no chance to clean up: PR_SET_PDEATHSIG must
                 });
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  ASSERT_EQ(ranks.size(), 2u);
  for (pid_t pid : ranks) {
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(wait_until([&] { return !process_alive(pid); }, 3s)) << "rank pid " << pid << " survived";
  }
}

TEST_F(Tdistrun, GrandchildrenDieWithAKilledLauncher) {
  // A rank starts a background child in its group, then waits; the launcher is SIGKILLed. The rank
  // dies of PR_SET_PDEATHSIG; its child only through the launcher's watchdog.
  const std::string script = "sleep 60 & echo $! > " + path("child.tmp") + "; mv " + path("child.tmp") + " " +
                             path("child") + "; exec sleep 60";
  pid_t child = -1;
  Result r = run({"-n", "1", "sh", "-c", script}, {}, [&](pid_t launcher) {
    child = read_pid("child");
    kill(launcher, SIGKILL);
  });
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  ASSERT_GT(child, 0);
  EXPECT_TRUE(wait_until([&] { return !process_alive(child); }, 3s)) << "grandchild " << child << " survived";
}

TEST_F(Tdistrun, TimeoutHoldsWhileOutputIsBlocked) {
  // stdout is a pipe nobody reads: the ranks fill it, and the launcher must still stop them on time.
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const auto start = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    const int err = open(path("launcher.err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(err, 2);
    close(out[0]);
    execl(kTdistrun.c_str(), kTdistrun.c_str(), "--timeout", "2", "--kill-grace", "1", "-n", "2", "sh", "-c",
          "yes 'a line of output that nobody reads'", static_cast<char*>(nullptr));
    _exit(99);
  }
  close(out[1]);
  int status = 0;
  const bool ended = wait_until([&] { return waitpid(pid, &status, WNOHANG) == pid; }, 15s);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!ended) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  close(out[0]);
  ASSERT_TRUE(ended) << "tdistrun still running 15 s after a 2 s timeout";
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 124) << read_file(path("launcher.err"));
  EXPECT_LT(seconds, 6.0);
  EXPECT_CONTAINS(read_file(path("launcher.err")), "tdistrun: timeout");
}

TEST_F(Tdistrun, ExportsOneRandomStoreSecretPerJob) {
  const std::string print = "echo secret=$TDIST_STORE_SECRET";
  auto secrets = [&](const Result& r) {
    std::vector<std::string> found;
    std::istringstream lines(r.out);
    for (std::string line; std::getline(lines, line);)
      if (auto at = line.find("secret="); at != std::string::npos) found.push_back(line.substr(at + 7));
    return found;
  };
  Result a = run({"-n", "3", "sh", "-c", print});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const auto sa = secrets(a);
  ASSERT_EQ(sa.size(), 3u) << a.out;
  EXPECT_EQ(sa[0].size(), 32u);
  EXPECT_EQ(sa[0].find_first_not_of("0123456789abcdef"), std::string::npos) << sa[0];
  for (const auto& x : sa) EXPECT_EQ(x, sa[0]);
  Result b = run({"-n", "1", "sh", "-c", print});
  ASSERT_EQ(secrets(b).size(), 1u);
  EXPECT_NE(secrets(b)[0], sa[0]);  // a new one per job
  Result c = run({"-n", "2", "sh", "-c", print}, {"TDIST_STORE_SECRET=mine"});
  for (const auto& x : secrets(c)) EXPECT_EQ(x, "mine");
}

TEST_F(Tdistrun, VersionAndValueForms) {
  Result v = run({"--version"});
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_EQ(v.out.rfind("tdistrun ", 0), 0u) << v.out;
  Result r = run({"--nproc=2", "--timeout=30", "sh", "-c", "echo rank=$RANK"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "[rank 1] rank=1");
  Result bad = run({"-n", "2", "--kill-grace=x", "true"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_CONTAINS(bad.err, "tdistrun: error: --kill-grace expects a non-negative number of seconds, got 'x'");
}

// The body of every rank in RanksRendezvousThroughTheStore: the test binary runs itself under
// tdistrun with this test selected. Disabled so that it does not run on its own.
TEST(TdistrunRank, DISABLED_Rendezvous) {
  const tdist::LaunchEnv env = tdist::launch_env_from_process();
  ASSERT_EQ(env.launcher, "torchrun");
  tdist::TcpStoreOptions options;
  options.host = env.master_addr;
  options.port = env.master_port;
  options.rank = env.rank;
  options.world_size = env.world_size;
  options.timeout = 10s;
  tdist::TcpStore store(options);
  const std::vector<tdist::Bytes> ranks = store.all_gather("ranks", tdist::Bytes{uint8_t(env.rank)});
  ASSERT_EQ(static_cast<int>(ranks.size()), env.world_size);
  for (int r = 0; r < env.world_size; ++r) ASSERT_EQ(ranks[r], tdist::Bytes{uint8_t(r)});
  store.barrier("done");
  std::printf("rendezvous ok: rank %d of %d, local rank %d of %d\n", env.rank, env.world_size, env.local_rank,
              env.local_world_size);
}

TEST_F(Tdistrun, RanksRendezvousThroughTheStore) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(n, 0);
  self[n] = '\0';
  Result r = run({"-n", "3", "--timeout", "20", "--", self, "--gtest_filter=TdistrunRank.DISABLED_Rendezvous",
                  "--gtest_also_run_disabled_tests"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string R = std::to_string(rank);
    EXPECT_CONTAINS(r.out, "[rank " + R + "] rendezvous ok: rank " + R + " of 3, local rank " + R + " of 3\n");
  }
}

}  // namespace
