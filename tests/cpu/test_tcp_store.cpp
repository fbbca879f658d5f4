// TcpStore across real processes: each rank is a forked child that builds its own store.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cpu/test_env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/runtime/tcp_store.hpp"
#include "tdist/runtime/world.hpp"  // call_compare_bound: the call comparison's store wait

namespace {

using tdist::test::free_port;
using tdist::test::ScopedEnv;

using namespace std::chrono_literals;
using tdist::Bytes;
using tdist::TcpStore;
using tdist::TcpStoreOptions;
using Clock = std::chrono::steady_clock;

TcpStoreOptions options(int port, int rank, int world_size, std::chrono::milliseconds timeout = 2s) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.rank = rank;
  o.world_size = world_size;
  o.timeout = timeout;
  return o;
}

Bytes bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
std::string text(const Bytes& b) { return std::string(b.begin(), b.end()); }

// What happened in one rank: "ok", "timeout" (tdist::TimeoutError), "error" (tdist::Error), or
// a message of the rank's own checks; with the message and how long the step took.
struct Outcome {
  std::string kind;
  std::string message;
  double seconds = 0;
};

std::string encode(const Outcome& o) { return o.kind + "\n" + std::to_string(o.seconds) + "\n" + o.message; }
Outcome decode(const std::string& s) {
  Outcome o;
  const size_t a = s.find('\n');
  const size_t b = s.find('\n', a + 1);
  if (a == std::string::npos || b == std::string::npos) return {"no report (rank exited early)", s, 0};
  o.kind = s.substr(0, a);
  o.seconds = std::stod(s.substr(a + 1, b - a - 1));
  o.message = s.substr(b + 1);
  return o;
}

// Runs `step` and classifies how it ended.
Outcome timed(const std::function<void()>& step) {
  const auto start = Clock::now();
  Outcome o{"ok", "", 0};
  try {
    step();
  } catch (const tdist::TimeoutError& e) {
    o = {"timeout", e.what(), 0};
  } catch (const tdist::Error& e) {
    o = {"error", e.what(), 0};
  } catch (const std::exception& e) {
    o = {"exception", e.what(), 0};
  }
  o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return o;
}

// Forks one child per entry of `ranks`; each runs its function, whose Outcome travels back
// through a pipe. Children that outlive `limit` are killed and reported.
std::vector<Outcome> run_processes(const std::vector<std::function<Outcome()>>& ranks,
                                   std::chrono::seconds limit = 20s) {
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (const auto& fn : ranks) {
    int p[2];
    EXPECT_EQ(pipe(p), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      const std::string report = encode(fn());
      size_t done = 0;
      while (done < report.size()) {
        const ssize_t n = write(p[1], report.data() + done, report.size() - done);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      _exit(0);  // skip the test framework's exit handlers in the child
    }
    close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  std::vector<std::string> reports(ranks.size());
  const auto give_up = Clock::now() + limit;
  size_t open = fds.size();
  while (open > 0 && Clock::now() < give_up) {
    std::vector<pollfd> pfds;
    for (int fd : fds) pfds.push_back({fd, POLLIN, 0});
    poll(pfds.data(), pfds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i] < 0 || !(pfds[i].revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      const ssize_t n = read(fds[i], buf, sizeof(buf));
      if (n > 0) {
        reports[i].append(buf, static_cast<size_t>(n));
      } else {
        close(fds[i]);
        fds[i] = -1;
        --open;
      }
    }
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (fds[i] >= 0) {
      ADD_FAILURE() << "process " << i << " still running after " << limit.count() << " s";
      kill(pids[i], SIGKILL);
      close(fds[i]);
    }
    waitpid(pids[i], nullptr, 0);
  }
  std::vector<Outcome> out;
  for (const auto& r : reports) out.push_back(decode(r));
  return out;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

#define EXPECT_CONTAINS(haystack, needle) EXPECT_PRED2(contains, haystack, needle)

// A check inside a child: on mismatch the step throws, so the parent sees what differed.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed in child: " + what);
}

TEST(TcpStore, OperationsAcrossFourRanks) {
  const int port = free_port();
  const int n = 4;
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back([=] {
      return timed([&] {
        TcpStore store(options(port, r, n));
        require(store.rank() == r && store.world_size() == n, "rank() and world_size()");
        store.set("key" + std::to_string(r), bytes("value" + std::to_string(r)));
        const int next = (r + 1) % n;
        require(text(store.get("key" + std::to_string(next))) == "value" + std::to_string(next), "get");
        store.wait({"key0", "key1", "key2", "key3"});
        require(store.check({"key0", "key3"}), "check of present keys");
        require(!store.check({"key0", "absent"}), "check of an absent key");
        const int64_t after = store.add("counter", r + 1);
        require(after >= r + 1 && after <= 10, "add returns the new value");
        store.barrier("after_add");
        require(text(store.get("counter")) == "10", "the counter reads back as decimal text");
        std::vector<Bytes> all = store.all_gather("ranks", Bytes(static_cast<size_t>(r + 1), uint8_t(r)));
        require(all.size() == n, "all_gather size");
        for (int i = 0; i < n; ++i)
          require(all[i] == Bytes(static_cast<size_t>(i + 1), uint8_t(i)),
                  "all_gather value of rank " + std::to_string(i));
        store.set("key0", bytes("overwritten"));  // set replaces
        store.barrier("end");
        require(text(store.get("key0")) == "overwritten", "overwritten value");
        store.barrier("end2");
      });
    });
  }
  for (const Outcome& o : run_processes(ranks)) EXPECT_EQ(o.kind, "ok") << o.message;
}

TEST(TcpStore, WrongWorldSizeIsRejectedAndTheStoreKeepsWorking) {
  const int port = free_port();
  auto legit = [=](int rank) {
    return [=] {
      return timed([&] {
        TcpStore store(options(port, rank, 2));
        std::this_thread::sleep_for(300ms);  // let the intruder try meanwhile
        store.barrier("after");
      });
    };
  };
  auto intruder = [=] {
    std::this_thread::sleep_for(100ms);
    return timed([&] { TcpStore store(options(port, 1, 3)); });
  };
  auto out = run_processes({legit(0), legit(1), intruder});
  EXPECT_EQ(out[0].kind, "ok") << out[0].message;
  EXPECT_EQ(out[1].kind, "ok") << out[1].message;
  EXPECT_EQ(out[2].kind, "error") << out[2].message;
  EXPECT_CONTAINS(out[2].message, "world size 3");
  EXPECT_CONTAINS(out[2].message, "world size 2");
  EXPECT_CONTAINS(out[2].message, "127.0.0.1:" + std::to_string(port));
  EXPECT_LT(out[2].seconds, 1.5);
}

TEST(TcpStore, DuplicateRankIsRejected) {
  const int port = free_port();
  // Two processes claim rank 1: whichever joins second is refused; the other completes.
  auto rank = [=](int r, std::chrono::milliseconds delay) {
    return [=] {
      std::this_thread::sleep_for(delay);
      return timed([&] {
        TcpStore store(options(port, r, 2));
        store.barrier("after");
        std::this_thread::sleep_for(500ms);  // stay until the duplicate has tried
      });
    };
  };
  auto out = run_processes({rank(0, 0ms), rank(1, 0ms), rank(1, 150ms)});
  EXPECT_EQ(out[0].kind, "ok") << out[0].message;
  const int refused = out[1].kind == "error" ? 1 : 2;
  const int joined = 3 - refused;
  EXPECT_EQ(out[joined].kind, "ok") << out[joined].message;
  EXPECT_EQ(out[refused].kind, "error") << out[refused].message;
  EXPECT_CONTAINS(out[refused].message, "rank 1 is already taken");
  EXPECT_LT(out[refused].seconds, 1.5);
}

TEST(TcpStore, PortInUse) {
  // Someone else listens on the port.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  Outcome o = timed([&] { TcpStore store(options(port, 0, 2)); });
  close(fd);
  EXPECT_EQ(o.kind, "error") << o.message;
  EXPECT_CONTAINS(o.message, "127.0.0.1:" + std::to_string(port));
  EXPECT_CONTAINS(o.message, "already in use");
  EXPECT_CONTAINS(o.message, "MASTER_PORT");
  EXPECT_LT(o.seconds, 1.0);
}

TEST(TcpStore, UnreachableMasterTimesOut) {
  const int port = free_port();  // nobody listens there
  Outcome o = timed([&] { TcpStore store(options(port, 1, 2, 1s)); });
  EXPECT_EQ(o.kind, "timeout") << o.message;
  EXPECT_CONTAINS(o.message, "could not reach the master at 127.0.0.1:" + std::to_string(port));
  EXPECT_CONTAINS(o.message, "MASTER_ADDR/MASTER_PORT");
  EXPECT_CONTAINS(o.message, "tcp_store.cpp:");
  EXPECT_GE(o.seconds, 0.8);
  EXPECT_LT(o.seconds, 2.5);
}

TEST(TcpStore, LateRankIsWaitedFor) {
  // Rank 1 starts 500 ms after rank 0: rank 1 retries connecting, rank 0 waits at the join.
  const int port = free_port();
  auto out = run_processes({[=] {
                              return timed([&] {
                                TcpStore s(options(port, 0, 2));
                                s.barrier("b");
                              });
                            },
                            [=] {
                              std::this_thread::sleep_for(500ms);
                              return timed([&] {
                                TcpStore s(options(port, 1, 2));
                                s.barrier("b");
                              });
                            }});
  for (const Outcome& o : out) EXPECT_EQ(o.kind, "ok") << o.message;
}

TEST(TcpStore, RanksThatNeverJoinAreNamed) {
  const int port = free_port();
  // World of 4, but rank 2 is never started.
  std::vector<std::function<Outcome()>> ranks;
  for (int r : {0, 1, 3}) ranks.push_back([=] { return timed([&] { TcpStore s(options(port, r, 4, 1s)); }); });
  for (const Outcome& o : run_processes(ranks)) {
    EXPECT_EQ(o.kind, "timeout") << o.message;
    EXPECT_CONTAINS(o.message, "ranks that never joined: 2 ");
    EXPECT_GE(o.seconds, 0.8);
    EXPECT_LT(o.seconds, 3.5);
  }
}

TEST(TcpStore, MissingRankInBarrierIsNamed) {
  const int port = free_port();
  const int n = 4;
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back([=] {
      TcpStore store(options(port, r, n, 1500ms));
      if (r == 2) {  // alive and connected, but never reaches the barrier
        std::this_thread::sleep_for(2500ms);
        return Outcome{"ok", "", 0};
      }
      return timed([&] { store.barrier("step1"); });
    });
  }
  auto out = run_processes(ranks);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(out[r].kind, "timeout") << out[r].message;
    EXPECT_CONTAINS(out[r].message, "barrier('step1') timed out after 1500 ms; ranks that never arrived: 2");
    EXPECT_GE(out[r].seconds, 1.3);
    EXPECT_LT(out[r].seconds, 3.5);
  }
}

TEST(TcpStore, RanksAtAnotherBarrierAreNamedWithTheirBarrier) {
  const int port = free_port();
  const int n = 3;
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back([=] {
      TcpStore store(options(port, r, n, 1500ms));
      if (r == 2) return timed([&] { store.barrier("step2"); });  // one step ahead of the others
      return timed([&] { store.barrier("step1"); });
    });
  }
  auto out = run_processes(ranks);
  for (int r : {0, 1}) {
    EXPECT_EQ(out[r].kind, "timeout") << out[r].message;
    EXPECT_CONTAINS(out[r].message, "ranks that never arrived: 2; rank 2 last entered barrier('step2')");
  }
  EXPECT_EQ(out[2].kind, "timeout") << out[2].message;
  EXPECT_CONTAINS(out[2].message, "ranks that never arrived: 0-1; rank 0 last entered barrier('step1'), "
                                  "rank 1 last entered barrier('step1')");
}

TEST(TcpStore, AllGatherTimeoutNamesMissingRanks) {
  const int port = free_port();
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back([=] {
      TcpStore store(options(port, r, 4, 1s));
      if (r >= 2) {
        std::this_thread::sleep_for(1500ms);
        return Outcome{"ok", "", 0};
      }
      return timed([&] { store.all_gather("ag", Bytes{1}); });
    });
  }
  auto out = run_processes(ranks);
  for (int r : {0, 1}) {
    EXPECT_EQ(out[r].kind, "timeout") << out[r].message;
    EXPECT_CONTAINS(out[r].message, "all_gather('ag') timed out after 1000 ms; ranks that never arrived: 2-3");
  }
}

TEST(TcpStore, AllGatherWithItsOwnTimeoutGivesUpThenAndNamesIt) {
  // The store's timeout is 30 s; the all_gather's own 1 s bounds it, and its error says 1000 ms.
  const int port = free_port();
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back([=] {
      TcpStore store(options(port, r, 2, 30s));
      if (r == 1) {
        std::this_thread::sleep_for(2500ms);
        return Outcome{"ok", "", 0};
      }
      return timed([&] { store.all_gather("short", Bytes{1}, 1s); });
    });
  }
  auto out = run_processes(ranks);
  EXPECT_EQ(out[0].kind, "timeout") << out[0].message;
  EXPECT_CONTAINS(out[0].message, "all_gather('short') timed out after 1000 ms; ranks that never arrived: 1");
  EXPECT_GE(out[0].seconds, 0.9);
  EXPECT_LT(out[0].seconds, 2.4);  // well before rank 1 would have come, and 29 s before the store's timeout
}

TEST(TcpStore, AllGatherWithItsOwnTimeoutReturnsWhenAllArrive) {
  const int port = free_port();
  const int n = 3;
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back([=] {
      TcpStore store(options(port, r, n, 30s));
      return timed([&] {
        if (r == 2) std::this_thread::sleep_for(300ms);  // late, but within the bound
        const auto all = store.all_gather("t", bytes("v" + std::to_string(r)), 5s);
        require(all.size() == size_t(n), "all_gather returned " + std::to_string(all.size()) + " values");
        for (int i = 0; i < n; ++i) require(text(all[i]) == "v" + std::to_string(i), "value of rank " + std::to_string(i));
        const Outcome bad = timed([&] { store.all_gather("t2", Bytes{}, 0ms); });
        require(bad.kind == "error" && contains(bad.message, "'timeout'"), "a zero timeout: " + bad.message);
      });
    });
  }
  for (const Outcome& o : run_processes(ranks)) EXPECT_EQ(o.kind, "ok") << o.message;
}

// World's call comparison over the store (World::compare_call, which needs a GPU to build a World):
// each rank all-gathers its call under the bound of call_compare_bound; a rank that skipped the call
// (here: it waits in the next store collective, as a rank running a call it had seen before would
// wait in its next comparison) makes the comparing rank give up at the device wait timeout, not at the
// host timeout, with the message World raises.
TEST(TcpStore, CallComparisonGivesUpAtTheWaitTimeoutNotTheHostTimeout) {
  const int port = free_port();
  const auto bound = tdist::call_compare_bound(60s, 1.0);
  ASSERT_EQ(bound.timeout, 1s);
  const std::string call = "all_reduce(count=1000, f32, method auto)";
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back([=] {
      TcpStore store(options(port, r, 2, 60s));
      if (r == 1) {  // ran the op without comparing, then waits at its next comparison
        timed([&] { store.all_gather("call/2", Bytes{}, 2s); });
        return Outcome{"ok", "", 0};
      }
      Outcome o = timed([&] { store.all_gather("call/1", bytes(call), bound.timeout); });
      if (o.kind == "timeout")
        o.message = tdist::call_compare_timeout_message(o.message, call, bound, tdist::CallCheckMode::kFirst);
      return o;
    });
  }
  auto out = run_processes(ranks);
  EXPECT_EQ(out[0].kind, "timeout") << out[0].message;
  EXPECT_GE(out[0].seconds, 0.9);
  EXPECT_LT(out[0].seconds, 1.9);
  const std::string& m = out[0].message;
  EXPECT_CONTAINS(m, "this rank compared its call " + call);
  EXPECT_CONTAINS(m, "did not arrive within 1000 ms (the device wait timeout, TDIST_WAIT_TIMEOUT_S)");
  EXPECT_CONTAINS(m, "ranks that never arrived: 1; rank 1 last entered all_gather('call/2')");
  EXPECT_CONTAINS(m, "Under TDIST_CHECK_CALLS=first");
}

TEST(TcpStore, DeadRankMakesOthersFailFast) {
  const int port = free_port();
  const int n = 4;
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back([=] {
      if (r == 3) {
        new TcpStore(options(port, r, n, 10s));
        std::this_thread::sleep_for(200ms);  // the others are in the barrier by now
        _exit(0);                            // dies without a clean shutdown
      }
      Outcome in_barrier, later;
      Outcome whole = timed([&] {
        TcpStore store(options(port, r, n, 10s));
        in_barrier = timed([&] { store.barrier("never"); });
        later = timed([&] { store.get("absent"); });
        std::this_thread::sleep_for(300ms);  // rank 0 serves until the others are done too
      });
      if (whole.kind != "ok") return whole;
      // Every later wait fails at once too.
      if (later.kind != "error" || !contains(later.message, "rank 3 died") || later.seconds > 1)
        return Outcome{"bad later wait", later.kind + ": " + later.message, later.seconds};
      return in_barrier;
    });
  }
  auto out = run_processes(ranks);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].kind, "error") << out[r].message;
    EXPECT_CONTAINS(out[r].message, "rank 3 died");
    EXPECT_CONTAINS(out[r].message, "without a clean shutdown");
    EXPECT_LT(out[r].seconds, 3.0);  // the timeout is 10 s
  }
}

TEST(TcpStore, RankZeroDeathMakesClientsFailFast) {
  const int port = free_port();
  const int n = 3;
  std::vector<std::function<Outcome()>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back([=] {
      if (r == 0) {
        new TcpStore(options(port, r, n, 10s));
        std::this_thread::sleep_for(300ms);
        _exit(0);
      }
      return timed([&] {
        TcpStore store(options(port, r, n, 10s));
        store.get("never-set");
      });
    });
  }
  auto out = run_processes(ranks);
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(out[r].kind, "error") << out[r].message;
    EXPECT_CONTAINS(out[r].message, "rank 0's store at 127.0.0.1:" + std::to_string(port) + " is gone");
    EXPECT_LT(out[r].seconds, 3.0);
  }
}

TEST(TcpStore, CleanExitIsNotADeath) {
  // Rank 1 leaves cleanly before rank 0 finishes; rank 0 keeps working and is not told of a death.
  const int port = free_port();
  auto out = run_processes({[=] {
                              return timed([&] {
                                TcpStore store(options(port, 0, 2));
                                store.barrier("b");
                                std::this_thread::sleep_for(300ms);
                                require(text(store.get("from1")) == "bye", "value left by rank 1");
                                store.set("x", bytes("y"));
                                require(text(store.get("x")) == "y", "rank 0 still works alone");
                              });
                            },
                            [=] {
                              return timed([&] {
                                TcpStore store(options(port, 1, 2));
                                store.set("from1", bytes("bye"));
                                store.barrier("b");
                              });
                            }});
  for (const Outcome& o : out) EXPECT_EQ(o.kind, "ok") << o.message;
}

TEST(TcpStore, RankZeroWaitsForOthersBeforeStopping) {
  // Rank 0 is done first; rank 1 still uses the store afterwards.
  const int port = free_port();
  auto out = run_processes({[=] {
                              return timed([&] {
                                TcpStore store(options(port, 0, 2));
                                store.set("k", bytes("v"));
                              });
                            },
                            [=] {
                              return timed([&] {
                                TcpStore store(options(port, 1, 2));
                                std::this_thread::sleep_for(300ms);
                                require(text(store.get("k")) == "v", "value from rank 0");
                              });
                            }});
  for (const Outcome& o : out) EXPECT_EQ(o.kind, "ok") << o.message;
}

TEST(TcpStore, SingleRankWaitTimeoutNamesMissingKeys) {
  TcpStore store(options(free_port(), 0, 1, 500ms));
  store.set("a", bytes("1"));
  Outcome o = timed([&] { store.wait({"a", "b", "c"}); });
  EXPECT_EQ(o.kind, "timeout") << o.message;
  EXPECT_CONTAINS(o.message, "wait timed out after 500 ms; missing keys: 'b', 'c'");
  EXPECT_GE(o.seconds, 0.45);
  EXPECT_LT(o.seconds, 2.0);
  o = timed([&] { store.get("nope"); });
  EXPECT_EQ(o.kind, "timeout");
  EXPECT_CONTAINS(o.message, "get('nope') timed out after 500 ms; missing key: 'nope'");
  // The store still works after a timeout.
  EXPECT_EQ(text(store.get("a")), "1");
  store.wait({});
}

TEST(TcpStore, MisuseErrors) {
  TcpStore store(options(free_port(), 0, 1, 1s));
  store.all_gather("t", Bytes{1});
  Outcome o = timed([&] { store.all_gather("t", Bytes{1}); });
  EXPECT_EQ(o.kind, "error");
  EXPECT_CONTAINS(o.message, "all_gather('t'): this tag was used before");
  store.barrier("t");  // another kind of collective, another namespace
  o = timed([&] { store.barrier("t"); });
  EXPECT_CONTAINS(o.message, "barrier('t'): this tag was used before");

  store.set("text", bytes("abc"));
  o = timed([&] { store.add("text", 1); });
  EXPECT_EQ(o.kind, "error");
  EXPECT_CONTAINS(o.message, "not a decimal integer");
  EXPECT_EQ(store.add("n", -5), -5);
  EXPECT_EQ(store.add("n", 7), 2);
  EXPECT_EQ(store.add("n", 0), 2);
  store.set("big", bytes("9223372036854775807"));
  o = timed([&] { store.add("big", 1); });
  EXPECT_CONTAINS(o.message, "overflows");
}

TEST(TcpStore, InvalidOptions) {
  auto expect_bad = [](TcpStoreOptions o, const std::string& fragment) {
    Outcome out = timed([&] { TcpStore store(o); });
    EXPECT_EQ(out.kind, "error");
    EXPECT_CONTAINS(out.message, fragment);
  };
  expect_bad(options(1234, 2, 2), "invalid argument 'options.rank'");
  expect_bad(options(1234, -1, 2), "invalid argument 'options.rank'");
  expect_bad(options(1234, 0, 0), "invalid argument 'options.world_size'");
  expect_bad(options(0, 0, 1), "invalid argument 'options.port'");
  expect_bad(options(70000, 0, 1), "invalid argument 'options.port'");
  expect_bad(options(1234, 0, 1, 0ms), "invalid argument 'options.timeout'");
  TcpStoreOptions no_host = options(1234, 0, 1);
  no_host.host = "";
  expect_bad(no_host, "invalid argument 'options.host'");
  // An unknown host fails at once; when the resolver itself is unreachable it is retried like
  // an unreachable master, so both outcomes are accepted.
  TcpStoreOptions bad_host = options(1234, 1, 2, 1s);
  bad_host.host = "no-such-host.invalid";
  Outcome o = timed([&] { TcpStore store(bad_host); });
  EXPECT_TRUE(contains(o.message, "cannot resolve the master host 'no-such-host.invalid'") ||
              contains(o.message, "could not reach the master at no-such-host.invalid:1234"))
      << o.message;
}

int count_entries(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// The entries of `dir` once they equal `expected`, or after 2 s: a joined thread's entry in
// /proc/self/task can outlive pthread_join briefly (the kernel wakes the joiner before it reaps the
// task), so a single count right after a join races.
int settled_count(const char* dir, int expected) {
  int n = count_entries(dir);
  for (int i = 0; i < 200 && n != expected; ++i) {
    std::this_thread::sleep_for(10ms);
    n = count_entries(dir);
  }
  return n;
}

TEST(TcpStore, NoLeakedDescriptorsOrThreads) {
  const int fds_before = count_entries("/proc/self/fd");
  const int threads_before = settled_count("/proc/self/task", 1);  // gtest's main thread alone
  for (int i = 0; i < 3; ++i) {
    TcpStore store(options(free_port(), 0, 1));
    store.set("k", bytes("v"));
    store.barrier("b");
  }
  EXPECT_EQ(count_entries("/proc/self/fd"), fds_before);
  EXPECT_EQ(settled_count("/proc/self/task", threads_before), threads_before);
}

TEST(TcpStore, DefaultTimeoutFromEnvironment) {
  const char* old = std::getenv("TDIST_HOST_TIMEOUT_S");
  const std::string saved = old ? old : "";
  unsetenv("TDIST_HOST_TIMEOUT_S");
  EXPECT_EQ(TcpStoreOptions::default_timeout(), 300s);
  setenv("TDIST_HOST_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(TcpStoreOptions::default_timeout(), 2500ms);
  setenv("TDIST_HOST_TIMEOUT_S", "60", 1);
  EXPECT_EQ(TcpStoreOptions().timeout, 60s);
  setenv("TDIST_HOST_TIMEOUT_S", "", 1);  // empty means unset, as for every TDIST_* setting
  EXPECT_EQ(TcpStoreOptions::default_timeout(), 300s);
  // Decimal only, bounded to (0.001 s, 1 day): hex, exponents, signs and 115 days are refused.
  for (const char* bad :
       {"abc", "0", "-1", "5s", " 5", "nan", "inf", "1e300", "1e-9", "0x10", "+5", "0.0001", "9936000", "2.", ".5x"}) {
    setenv("TDIST_HOST_TIMEOUT_S", bad, 1);
    Outcome o = timed([] { TcpStoreOptions::default_timeout(); });
    EXPECT_EQ(o.kind, "error") << bad;
    EXPECT_CONTAINS(o.message, std::string("TDIST_HOST_TIMEOUT_S='") + bad + "'");
  }
  if (old)
    setenv("TDIST_HOST_TIMEOUT_S", saved.c_str(), 1);
  else
    unsetenv("TDIST_HOST_TIMEOUT_S");
}

TEST(TcpStore, StrangerOnThePortDoesNotDisturb) {
  // A client that is not a tdist store client (sends junk) is dropped; real ranks carry on.
  const int port = free_port();
  auto out = run_processes({[=] {
                              return timed([&] {
                                TcpStore store(options(port, 0, 2));
                                std::this_thread::sleep_for(300ms);
                                store.barrier("b");
                              });
                            },
                            [=] {
                              std::this_thread::sleep_for(100ms);
                              int fd = socket(AF_INET, SOCK_STREAM, 0);
                              sockaddr_in a{};
                              a.sin_family = AF_INET;
                              a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                              a.sin_port = htons(static_cast<uint16_t>(port));
                              if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
                                const char junk[] = "GET / HTTP/1.0\r\n\r\n";
                                (void)!write(fd, junk, sizeof(junk));
                              }
                              std::this_thread::sleep_for(100ms);
                              close(fd);
                              return Outcome{"ok", "", 0};
                            },
                            [=] {
                              return timed([&] {
                                TcpStore store(options(port, 1, 2));
                                store.barrier("b");
                              });
                            }});
  for (const Outcome& o : out) EXPECT_EQ(o.kind, "ok") << o.message;
}

}  // namespace
