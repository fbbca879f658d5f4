// The TCP store admits only its job and survives hostile clients: joins without the job's secret
// are refused and read nothing; idle sockets, huge frame headers, oversized requests and replies
// cost the server bounded memory and never its thread; rank 0 listens only where it is asked to.
// Raw clients speak the wire format of src/runtime/tcp_store_wire.hpp, written out here.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cpu/test_env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/runtime/tcp_store.hpp"

namespace {

using tdist::test::free_port;
using tdist::test::ScopedEnv;

using namespace std::chrono_literals;
using tdist::Bytes;
using tdist::TcpStore;
using tdist::TcpStoreOptions;
using Clock = std::chrono::steady_clock;

TcpStoreOptions options(int port, int rank, int world_size, const std::string& secret,
                        std::chrono::milliseconds timeout = 5s) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.rank = rank;
  o.world_size = world_size;
  o.timeout = timeout;
  o.secret = secret;
  o.bind = "";
  return o;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---- a raw client

int connect_raw(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  for (int i = 0; i < 500; ++i) {
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    close(fd);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    std::this_thread::sleep_for(10ms);
  }
  close(fd);
  ADD_FAILURE() << "cannot connect to port " << port;
  return -1;
}

struct Frame {
  Bytes b = Bytes(4, 0);
  Frame& u8(uint8_t v) {
    b.push_back(v);
    return *this;
  }
  Frame& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
    return *this;
  }
  Frame& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(uint8_t(v >> (8 * i)));
    return *this;
  }
  Frame& str(const std::string& s) {
    u32(uint32_t(s.size()));
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Bytes done() {
    const uint32_t len = uint32_t(b.size() - 4);
    for (int i = 0; i < 4; ++i) b[i] = uint8_t(len >> (8 * i));
    return b;
  }
};
constexpr uint32_t kMagic = 0x54445354, kVersion = 2;
enum : uint8_t { kJoin = 1, kJoinBarrier, kSet, kWait, kCheck, kAdd, kShutdown };

// Joins with an empty secret (the store under test is made with one).
Bytes join_frame(int rank, int world) {
  return Frame().u8(kJoin).u32(kMagic).u32(kVersion).u32(uint32_t(rank)).u32(uint32_t(world)).str("").done();
}

bool send_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = send(fd, p, size, MSG_NOSIGNAL);
    if (n <= 0) return false;
    p += n;
    size -= size_t(n);
  }
  return true;
}
bool send_all(int fd, const Bytes& b) { return send_all(fd, b.data(), b.size()); }

// One reply payload (status byte first); nullopt when the connection closed or `limit` passed.
std::optional<Bytes> read_reply(int fd, std::chrono::milliseconds limit = 5s) {
  const auto deadline = Clock::now() + limit;
  Bytes got;
  size_t want = 4;
  bool header = true;
  while (got.size() < want) {
    pollfd p{fd, POLLIN, 0};
    const int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (left <= 0 || poll(&p, 1, left) != 1) return std::nullopt;
    uint8_t buf[65536];
    const ssize_t n = recv(fd, buf, std::min(sizeof(buf), want - got.size()), 0);
    if (n <= 0) return std::nullopt;
    got.insert(got.end(), buf, buf + n);
    if (header && got.size() == 4) {
      want = 4 + (uint32_t(got[0]) | uint32_t(got[1]) << 8 | uint32_t(got[2]) << 16 | uint32_t(got[3]) << 24);
      header = false;
    }
  }
  return Bytes(got.begin() + 4, got.end());
}

std::string reply_text(const Bytes& r) {  // an error reply's message
  if (r.size() < 5) return "";
  return std::string(r.begin() + 5, r.end());
}

// True once the server has closed `fd` (EOF or reset) within `limit`.
bool closed_by_server(int fd, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) == 1) {
      uint8_t buf[4096];
      const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN)) return true;
    }
  }
  return false;
}

long rss_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

// Rank 0 of a world of `world`, built in a thread (its constructor waits for the others).
struct RankZero {
  std::unique_ptr<TcpStore> store;
  std::string error;
  std::thread thread;
  explicit RankZero(const TcpStoreOptions& o) {
    thread = std::thread([this, o] {
      try {
        store = std::make_unique<TcpStore>(o);
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
  }
  void joined() {
    if (thread.joinable()) thread.join();
  }
  ~RankZero() { joined(); }
};

// Sets (or unsets) an environment variable for one scope.

}  // namespace

TEST(StoreTrust, JoinWithoutTheSecretIsRefused) {
  const int port = free_port();
  RankZero zero(options(port, 0, 2, "secret:job-a"));
  for (const std::string wrong : {"", "secret:job-b", "secret:job-a "}) {
    const auto t0 = Clock::now();
    try {
      TcpStore intruder(options(port, 1, 2, wrong));
      ADD_FAILURE() << "a process with secret '" << wrong << "' joined";
    } catch (const tdist::TimeoutError& e) {
      ADD_FAILURE() << "refusal came as a timeout: " << e.what();
    } catch (const tdist::Error& e) {
      EXPECT_NE(std::string(e.what()).find("does not belong to the job"), std::string::npos) << e.what();
    }
    EXPECT_LT(seconds_since(t0), 2.0);
  }
  // The real rank 1 still joins, and the job works.
  TcpStore one(options(port, 1, 2, "secret:job-a"));
  zero.joined();
  ASSERT_TRUE(zero.store) << zero.error;
  zero.store->set("tdist/nccl_unique_id", Bytes{1, 2, 3});
  EXPECT_EQ(one.get("tdist/nccl_unique_id"), (Bytes{1, 2, 3}));
}

TEST(StoreTrust, IntruderReadsNothing) {
  const int port = free_port();
  TcpStoreOptions o = options(port, 0, 1, "secret:job-a");
  TcpStore zero(o);
  zero.set("tdist/nccl_unique_id", Bytes{0xAB, 0xCD, 0xEF, 0x42});
  int fd = connect_raw(port);
  ASSERT_TRUE(send_all(fd, join_frame(0, 1)));  // no secret; and rank 0 is taken anyway
  // Send a read right behind the join, as an intruder would.
  ASSERT_TRUE(send_all(fd, Frame().u8(kWait).u64(1000).u8(1).u32(1).str("tdist/nccl_unique_id").done()));
  auto reply = read_reply(fd);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ((*reply)[0], 1) << "expected an error reply";
  EXPECT_NE(reply_text(*reply).find("does not belong to the job"), std::string::npos) << reply_text(*reply);
  // The secret is checked first: the refusal says nothing about ranks or world size.
  EXPECT_EQ(reply_text(*reply).find("already taken"), std::string::npos) << reply_text(*reply);
  EXPECT_TRUE(closed_by_server(fd, 2s));  // and the wait got no answer, only the close
  close(fd);
  zero.barrier("after the intruder");
}

TEST(StoreTrust, JobIdentityFromTheLauncher) {
  ScopedEnv s("TDIST_STORE_SECRET", std::nullopt), t("TORCHELASTIC_RUN_ID", std::nullopt),
      j("SLURM_JOB_ID", std::nullopt), st("SLURM_STEP_ID", std::nullopt), o("OMPI_MCA_ess_base_jobid", std::nullopt),
      p("PMIX_NAMESPACE", std::nullopt);
  EXPECT_EQ(TcpStoreOptions::default_secret(), "");
  setenv("SLURM_JOB_ID", "1001", 1);
  const std::string job1 = TcpStoreOptions::default_secret();
  setenv("SLURM_JOB_ID", "1002", 1);
  const std::string job2 = TcpStoreOptions::default_secret();
  EXPECT_FALSE(job1.empty());
  EXPECT_NE(job1, job2);
  setenv("TDIST_STORE_SECRET", "5f2c", 1);
  EXPECT_EQ(TcpStoreOptions::default_secret(), "secret:5f2c");

  // Two jobs with the same port and world size: the second job's rank 1 is refused.
  const int port = free_port();
  RankZero zero(options(port, 0, 2, job1));
  EXPECT_THROW(TcpStore(options(port, 1, 2, job2)), tdist::Error);
  TcpStore one(options(port, 1, 2, job1));
  zero.joined();
  ASSERT_TRUE(zero.store) << zero.error;
}

TEST(StoreTrust, IdleSocketsDoNotStopARealRank) {
  // Rank 0 in a child with a common descriptor limit (1024 on many systems; 512 here), 1000 idle
  // connections from this process, then the real rank 1 must join within a second.
  const int port = free_port();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    rlimit lim{512, 512};
    setrlimit(RLIMIT_NOFILE, &lim);
    int status = 1;
    try {
      TcpStore zero(options(port, 0, 2, "secret:idle", 10s));
      zero.barrier("joined");
      status = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 0: %s\n", e.what());
    }
    _exit(status);
  }
  close(ready[0]);
  close(ready[1]);
  int probe = connect_raw(port);  // rank 0 listens
  ASSERT_GE(probe, 0);
  std::vector<int> idle{probe};
  for (int i = 0; i < 999; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      continue;
    }
    idle.push_back(fd);
  }
  EXPECT_GE(idle.size(), 900u);
  std::this_thread::sleep_for(200ms);  // let the server see them all
  const auto t0 = Clock::now();
  std::string error;
  try {
    TcpStore one(options(port, 1, 2, "secret:idle", 10s));
    EXPECT_LT(seconds_since(t0), 1.0);
    one.barrier("joined");
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "");
  for (int fd : idle) close(fd);
  int status = -1;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(StoreTrust, SilentConnectionIsClosedAtTheHandshakeDeadline) {
  const int port = free_port();
  TcpStore zero(options(port, 0, 1, "secret:x", 1s));  // the handshake deadline is min(10 s, timeout)
  int fd = connect_raw(port);
  const auto t0 = Clock::now();
  EXPECT_TRUE(closed_by_server(fd, 4s));
  EXPECT_GT(seconds_since(t0), 0.5);
  close(fd);
}

TEST(StoreTrust, HugeFrameHeaderKeepsServerMemorySmall) {
  const int port = free_port();
  RankZero zero(options(port, 0, 2, ""));
  // One stranger that never joins, one that joins as rank 1 first: both announce a 4 GiB frame
  // and then stream 200 MiB at the server.
  int stranger = connect_raw(port);
  int member = connect_raw(port);
  ASSERT_TRUE(send_all(member, join_frame(1, 2)));
  auto r = read_reply(member);
  ASSERT_TRUE(r && (*r)[0] == 0);
  ASSERT_TRUE(send_all(member, Frame().u8(kJoinBarrier).u64(5000).done()));
  r = read_reply(member);
  ASSERT_TRUE(r && (*r)[0] == 0);
  zero.joined();
  ASSERT_TRUE(zero.store) << zero.error;

  const long before = rss_kib();
  const std::vector<uint8_t> chunk(1 << 20, 0x5a);
  for (int fd : {stranger, member}) {
    const uint8_t header[4] = {0xff, 0xff, 0xff, 0xff};
    ASSERT_TRUE(send_all(fd, header, 4));
    for (int i = 0; i < 200; ++i)
      if (!send_all(fd, chunk.data(), chunk.size())) break;  // the stranger is cut off early
    const long grown_mib = (rss_kib() - before) / 1024;
    EXPECT_LT(grown_mib, 100) << "the server buffered a frame it should have refused or dropped";
  }
  EXPECT_TRUE(closed_by_server(stranger, 2s));
  close(stranger);
  close(member);
}

TEST(StoreTrust, OversizedRequestGetsAnErrorAndTheStoreGoesOn) {
  const int port = free_port();
  RankZero zero(options(port, 0, 2, ""));
  int member = connect_raw(port);
  ASSERT_TRUE(send_all(member, join_frame(1, 2)));
  ASSERT_TRUE(read_reply(member).has_value());
  ASSERT_TRUE(send_all(member, Frame().u8(kJoinBarrier).u64(5000).done()));
  ASSERT_TRUE(read_reply(member).has_value());
  zero.joined();
  ASSERT_TRUE(zero.store) << zero.error;

  // A set of 100 MiB: above the 64 MiB request limit.
  Frame big;
  big.u8(kSet).str("big");
  big.u32(100u << 20);
  big.b.resize(big.b.size() + (100u << 20), 7);
  big.u8(0);
  ASSERT_TRUE(send_all(member, big.done()));
  auto r = read_reply(member, 20s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ((*r)[0], 1);
  EXPECT_NE(reply_text(*r).find("exceeds the store's limit"), std::string::npos) << reply_text(*r);

  // A reply above its limit: one 10 MiB value asked for 30 times (300 MiB).
  zero.store->set("ten", Bytes(10u << 20, 1));
  Frame many;
  many.u8(kWait).u64(5000).u8(1).u32(30);
  for (int i = 0; i < 30; ++i) many.str("ten");
  ASSERT_TRUE(send_all(member, many.done()));
  r = read_reply(member, 20s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ((*r)[0], 1);
  EXPECT_NE(reply_text(*r).find("above the store's limit"), std::string::npos) << reply_text(*r);

  // The same connection and the server thread still serve: rank 1's half of a barrier.
  ASSERT_TRUE(send_all(member, Frame().u8(kSet).str("__tdist/barrier/after/1").str("").u8(1).done()));
  r = read_reply(member);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ((*r)[0], 0);
  zero.store->barrier("after");
  ASSERT_TRUE(send_all(member, Frame().u8(kShutdown).done()));
  close(member);

  // The client checks its own requests too, naming the limit.
  try {
    zero.store->set("too big", Bytes(65u << 20, 0));
    ADD_FAILURE() << "a 65 MiB set was sent";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("limit"), std::string::npos) << e.what();
  }
  zero.store->set("small", Bytes{1});
  EXPECT_EQ(zero.store->get("small"), Bytes{1});
}

TEST(StoreTrust, NonLocalMasterAddrFailsInsteadOfListeningEverywhere) {
  TcpStoreOptions o = options(free_port(), 0, 1, "", 3s);
  o.host = "192.0.2.1";  // TEST-NET-1: never an address of this machine
  const auto t0 = Clock::now();
  try {
    TcpStore store(o);
    ADD_FAILURE() << "rank 0 started with a MASTER_ADDR that is not local";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not an address of this machine"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TDIST_STORE_BIND"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 1.0);

  // Asked for explicitly, another address works.
  o.host = "localhost";
  o.bind = "127.0.0.1";
  TcpStore store(o);
  store.set("k", Bytes{1});
  ScopedEnv bind("TDIST_STORE_BIND", "0.0.0.0");
  EXPECT_EQ(TcpStoreOptions().bind, "0.0.0.0");
}
