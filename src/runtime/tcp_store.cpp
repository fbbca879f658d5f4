// The TCP store's client side and public API. Protocol: tcp_store_wire.hpp; server:
// tcp_store_server.cpp.
//
// Every call sends one request and reads one reply with poll() against a deadline. Waits are
// timed by the server, which answers at the deadline with the keys still missing so that the
// error can name them; the client allows a little extra time for that answer to arrive.
//
// Thread safety: a TcpStore may be used from one thread at a time (its calls share one
// connection and expect the reply to their own request); use one store per thread otherwise.
//
// Shutdown: a destroyed store says goodbye, so its rank counts as having left, not died. Rank 0's
// destructor keeps the server up until every other rank has disconnected (at most the timeout),
// unless it runs during exception unwinding, when the job is failing anyway.
#include "tdist/runtime/tcp_store.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <functional>
#include <thread>

#include "tcp_store_server.hpp"
#include "tcp_store_wire.hpp"
#include "tdist/common/env.hpp"
#include "tdist/jit/hash.hpp"

namespace tdist {

namespace store {

std::string format_rank_list(const std::vector<int>& sorted_ranks) {
  constexpr size_t kMaxRuns = 16;
  std::string out;
  size_t runs = 0;
  for (size_t i = 0; i < sorted_ranks.size();) {
    size_t j = i;
    while (j + 1 < sorted_ranks.size() && sorted_ranks[j + 1] == sorted_ranks[j] + 1) ++j;
    if (runs == kMaxRuns) {
      out.append(", ... (").append(std::to_string(sorted_ranks.size() - i)).append(" more)");
      break;
    }
    if (!out.empty()) out.append(", ");
    out.append(std::to_string(sorted_ranks[i]));
    if (j > i) out.append("-").append(std::to_string(sorted_ranks[j]));
    ++runs;
    i = j + 1;
  }
  return out;
}

Bytes auth_token(const std::string& secret) {
  if (secret.empty()) return {};
  jit::Sha256 h;
  h.field("tdist.store.auth.v1", secret);
  const jit::Digest d = h.finish();
  return Bytes(d.begin(), d.end());
}

bool constant_time_equal(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return false;
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  // Through a volatile so that the compiler cannot turn the loop into an early-exit compare.
  volatile uint8_t result = diff;
  return result == 0;
}

}  // namespace store

namespace {

using namespace store;

// The server answers a wait at its deadline; this much more is allowed for that answer to arrive
// before the client concludes that rank 0 is hung.
constexpr std::chrono::milliseconds kReplyGrace{2000};
constexpr std::chrono::milliseconds kDefaultTimeout{300'000};
// all_gather and barrier keys live under this prefix, apart from user keys.
const std::string kInternalPrefix = "__tdist/";

std::string quoted_list(const std::vector<std::string>& items, const std::vector<uint32_t>& indices) {
  constexpr size_t kMaxShown = 10;
  std::string out;
  for (size_t i = 0; i < indices.size() && i < kMaxShown; ++i) out += (i ? ", '" : "'") + items.at(indices[i]) + "'";
  if (indices.size() > kMaxShown) out += ", ... (" + std::to_string(indices.size() - kMaxShown) + " more)";
  return out;
}

std::vector<int> as_ranks(const std::vector<uint32_t>& indices) {
  return std::vector<int>(indices.begin(), indices.end());
}

}  // namespace

std::chrono::milliseconds TcpStoreOptions::default_timeout() {
  const double seconds = env::seconds("TDIST_HOST_TIMEOUT_S", std::chrono::duration<double>(kDefaultTimeout).count(),
                                      env::kMinTimeoutSeconds, env::kMaxTimeoutSeconds);
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
}

std::string TcpStoreOptions::default_secret() {
  if (auto secret = env::get("TDIST_STORE_SECRET")) return "secret:" + *secret;
  // Identity, not secrecy: a launcher's job id tells two jobs apart on one port. Each source is
  // tagged, so that ids of two launchers cannot coincide.
  std::string id;
  for (const char* var :
       {"TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"})
    if (auto v = env::get(var)) id += std::string(var) + "=" + *v + ";";
  return id.empty() ? std::string() : "job:" + id;
}

std::string TcpStoreOptions::default_bind() { return env::text("TDIST_STORE_BIND"); }

struct TcpStore::Impl {
  TcpStoreOptions opt;
  std::string who;                      // "TcpStore rank 1 of 4", opening every error message
  std::string master;                   // "host:port"
  std::unique_ptr<StoreServer> server;  // rank 0 only
  Fd sock;
  // Set once the connection can no longer be trusted (closed, or a reply overdue); every later
  // call fails at once with this message instead of reading a stale reply.
  std::string broken;

  explicit Impl(const TcpStoreOptions& o)
      : opt(o),
        who("TcpStore rank " + std::to_string(o.rank) + " of " + std::to_string(o.world_size)),
        master(o.host + ":" + std::to_string(o.port)) {}

  // Reached on its own when the constructor fails. This process is alive and merely giving up,
  // so it leaves cleanly: the others must not be told that it died.
  ~Impl() {
    goodbye();
    if (server) server->stop(Clock::now());
  }

  void connect(Clock::time_point deadline);
  // The join handshake; false when the server closed the connection before answering (it makes
  // room for new connections by closing old ones that have not joined): connect and try again.
  bool try_handshake(Clock::time_point deadline);
  void join(Clock::time_point deadline);
  void send_frame(const Bytes& frame, Clock::time_point deadline, const std::string& what);
  Bytes receive_frame(Clock::time_point deadline, const std::string& what);
  // One request, one reply; returns the reply payload (Status byte first).
  Bytes request(Bytes frame, Clock::time_point reply_deadline, const std::string& what);
  [[noreturn]] void fail_connection(const std::string& why);
  // Stores key; with `exclusive`, returns false instead when the key is present already.
  bool set(const std::string& key, const Bytes& value, bool exclusive, const std::string& what);
  // Waits for `keys`; returns their values when want_values. On timeout, throws TimeoutError
  // whose message ends with describe_missing(indices of the keys still missing).
  using DescribeMissing = std::function<std::string(const std::vector<uint32_t>&)>;
  std::vector<Bytes> wait_for(const std::vector<std::string>& keys, bool want_values, const std::string& what,
                              const DescribeMissing& describe_missing, std::chrono::milliseconds timeout);
  void goodbye() noexcept;
};

void TcpStore::Impl::fail_connection(const std::string& why) {
  broken = why;
  sock.reset();
  TDIST_FAIL(why);
}

void TcpStore::Impl::connect(Clock::time_point deadline) {
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(opt.host.c_str(), std::to_string(opt.port).c_str(), &hints, &found);
    if (rc == EAI_NONAME || rc == EAI_FAIL || rc == EAI_SERVICE || rc == EAI_FAMILY)
      TDIST_FAIL(who, ": cannot resolve the master host '", opt.host, "' (MASTER_ADDR): ", ::gai_strerror(rc));
    if (rc != 0) last_error = std::string("name lookup: ") + ::gai_strerror(rc);
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);

    for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
      Fd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd.valid()) {
        last_error = "socket: " + errno_text(errno);
        continue;
      }
      int err = 0;
      if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          pollfd p{fd.get(), POLLOUT, 0};
          int n;
          do n = ::poll(&p, 1, poll_timeout_ms(deadline));
          while (n < 0 && errno == EINTR);
          socklen_t len = sizeof(err);
          if (n == 1)
            ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          else
            err = ETIMEDOUT;
        }
      }
      if (err == 0) {
        int one = 1;
        ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        sock = std::move(fd);
        return;
      }
      last_error = errno_text(err);
    }
    // Rank 0 may simply not be listening yet: retry with backoff until the deadline.
    const auto now = Clock::now();
    if (now >= deadline)
      TDIST_STORE_TIMEOUT(who, ": could not reach the master at ", master, " within ", opt.timeout.count(),
                          " ms (last error: ", last_error,
                          "). Is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?");
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

void TcpStore::Impl::send_frame(const Bytes& frame, Clock::time_point deadline, const std::string& what) {
  size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t n = ::send(sock.get(), frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{sock.get(), POLLOUT, 0};
      const int ready = ::poll(&p, 1, poll_timeout_ms(deadline));
      if (ready == 0) {
        broken = who + ": sending " + what + " to rank 0's store at " + master + " timed out";
        sock.reset();
        TDIST_STORE_TIMEOUT(broken);
      }
      continue;
    }
    fail_connection(who + ": rank 0's store at " + master + " is gone (" + errno_text(errno) + " while sending " +
                    what + "): rank 0 exited or crashed");
  }
}

Bytes TcpStore::Impl::receive_frame(Clock::time_point deadline, const std::string& what) {
  uint8_t header[4];
  Bytes payload;
  size_t got = 0;
  size_t want = sizeof(header);
  bool in_payload = false;
  while (true) {
    if (got == want) {
      if (in_payload) return payload;
      const uint32_t len = frame_length(header);
      if (len > kMaxFrameBytes)
        fail_connection(who + ": malformed reply from " + master + " (is MASTER_PORT the port of another service?)");
      payload.resize(len);
      in_payload = true;
      got = 0;
      want = len;
      continue;
    }
    pollfd p{sock.get(), POLLIN, 0};
    const int ready = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      broken = who + ": no reply from rank 0's store at " + master + " to " + what;
      sock.reset();
      TDIST_STORE_TIMEOUT(broken, " within the timeout of ", opt.timeout.count(), " ms (is rank 0 hung?)");
    }
    uint8_t* dst = in_payload ? payload.data() : header;
    const ssize_t n = ::recv(sock.get(), dst + got, want - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    const std::string cause = n == 0 ? "connection closed" : errno_text(errno);
    fail_connection(who + ": rank 0's store at " + master + " is gone (" + cause + " while waiting for " + what +
                    "): rank 0 exited or crashed");
  }
}

Bytes TcpStore::Impl::request(Bytes frame, Clock::time_point reply_deadline, const std::string& what) {
  if (!broken.empty()) TDIST_FAIL(who, ": ", what, " refused: the connection to the store is unusable since: ", broken);
  if (frame.size() - 4 > kMaxRequestBytes)
    TDIST_FAIL(who, ": ", what, ": the request has ", frame.size() - 4, " bytes, above the store's limit of ",
               kMaxRequestBytes, " bytes (the store is for bootstrap data; exchange large data through NCCL)");
  send_frame(frame, reply_deadline, what);
  return receive_frame(reply_deadline, what);
}

bool TcpStore::Impl::try_handshake(Clock::time_point deadline) {
  const std::string what = "the join handshake";
  const Bytes frame = Writer()
                          .u8(uint8_t(Op::join))
                          .u32(kMagic)
                          .u32(kVersion)
                          .i32(opt.rank)
                          .i32(opt.world_size)
                          .blob(auth_token(opt.secret))
                          .frame();
  Bytes reply;
  try {
    reply = request(frame, deadline, what);
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error&) {
    if (!broken.empty() && Clock::now() < deadline) {
      broken.clear();  // closed before any reply: a fresh connection is as good as new
      return false;
    }
    throw;
  }
  try {
    Reader r(reply.data(), reply.size());
    const auto status = Status(r.u8());
    if (status == Status::error) TDIST_FAIL(who, ": rank 0's store at ", master, " refused this process: ", r.str());
    if (status != Status::ok || r.u32() != kMagic) throw ProtocolError("bad join reply");
  } catch (const ProtocolError&) {
    fail_connection(who + ": the process at " + master +
                    " is not a tdist store "
                    "(is MASTER_PORT the port of another service?)");
  }
  return true;
}

void TcpStore::Impl::join(Clock::time_point deadline) {
  auto backoff = std::chrono::milliseconds(10);
  while (!try_handshake(deadline)) {
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
    connect(deadline);
  }
  Bytes reply;

  // Everyone meets before the constructor returns, so a missing rank shows up here, by number.
  const auto server_timeout = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  const uint64_t server_timeout_ms = uint64_t(std::max<int64_t>(0, server_timeout.count()));
  reply = request(Writer().u8(uint8_t(Op::join_barrier)).u64(server_timeout_ms).frame(), deadline + kReplyGrace,
                  "the join of all ranks");
  Reader r(reply.data(), reply.size());
  const auto status = Status(r.u8());
  if (status == Status::error) TDIST_FAIL(who, ": joining the store at ", master, " failed: ", r.str());
  if (status == Status::timeout) {
    std::vector<int> missing(r.u32());
    for (int& m : missing) m = static_cast<int>(r.u32());
    TDIST_STORE_TIMEOUT(who, ": timed out after ", opt.timeout.count(), " ms waiting for all ", opt.world_size,
                        " ranks to join the store at ", master,
                        "; ranks that never joined: ", format_rank_list(missing),
                        " (are they running, with the same MASTER_ADDR/MASTER_PORT?)");
  }
}

bool TcpStore::Impl::set(const std::string& key, const Bytes& value, bool exclusive, const std::string& what) {
  Bytes reply = request(Writer().u8(uint8_t(Op::set)).str(key).blob(value).u8(exclusive ? 1 : 0).frame(),
                        deadline_after(opt.timeout), what);
  Reader r(reply.data(), reply.size());
  if (Status(r.u8()) != Status::error) return true;
  if (exclusive) return false;  // the only error a set can get
  TDIST_FAIL(who, ": ", what, " failed: ", r.str());
}

std::vector<Bytes> TcpStore::Impl::wait_for(const std::vector<std::string>& keys, bool want_values,
                                            const std::string& what, const DescribeMissing& describe_missing,
                                            std::chrono::milliseconds timeout) {
  Writer w;
  w.u8(uint8_t(Op::wait)).u64(uint64_t(timeout.count())).u8(want_values ? 1 : 0);
  w.u32(uint32_t(keys.size()));
  for (const auto& k : keys) w.str(k);
  Bytes reply = request(w.frame(), deadline_after(timeout + kReplyGrace), what);
  Reader r(reply.data(), reply.size());
  const auto status = Status(r.u8());
  if (status == Status::error) TDIST_FAIL(who, ": ", what, " failed: ", r.str());
  if (status == Status::timeout) {
    std::vector<uint32_t> missing(r.u32());
    for (auto& m : missing) m = r.u32();
    TDIST_STORE_TIMEOUT(who, ": ", what, " timed out after ", timeout.count(), " ms; ", describe_missing(missing));
  }
  std::vector<Bytes> values(r.u32());
  for (auto& v : values) v = r.blob();
  return values;
}

void TcpStore::Impl::goodbye() noexcept {
  if (!sock.valid() || !broken.empty()) return;
  // Announce a clean exit so the server does not report this rank as dead. Failures do not
  // matter here: the server being gone already is fine.
  const Bytes frame = Writer().u8(uint8_t(Op::shutdown)).frame();
  [[maybe_unused]] ssize_t n = ::send(sock.get(), frame.data(), frame.size(), MSG_NOSIGNAL);
  ::shutdown(sock.get(), SHUT_WR);
  sock.reset();
}

TcpStore::TcpStore(const TcpStoreOptions& options) {
  TDIST_CHECK_ARG(options.world_size >= 1, "options.world_size", "expected >= 1, got ", options.world_size);
  TDIST_CHECK_ARG(options.rank >= 0 && options.rank < options.world_size, "options.rank",
                  "expected 0 <= rank < world_size (=", options.world_size, "), got ", options.rank);
  TDIST_CHECK_ARG(options.port >= 1 && options.port <= 65535, "options.port", "expected 1..65535, got ", options.port);
  TDIST_CHECK_ARG(!options.host.empty(), "options.host", "expected a host name or address, got ''");
  TDIST_CHECK_ARG(options.timeout.count() > 0, "options.timeout", "expected a positive duration, got ",
                  options.timeout.count(), " ms");

  auto impl = std::make_unique<Impl>(options);
  const auto deadline = deadline_after(options.timeout);
  if (options.rank == 0) {
    StoreServer::Config config;
    config.host = options.host;
    config.bind = options.bind;
    config.port = options.port;
    config.world_size = options.world_size;
    config.auth = auth_token(options.secret);
    config.handshake_timeout = std::min(kHandshakeTimeout, options.timeout);
    impl->server = std::make_unique<StoreServer>(config);
    impl->server->start();
  }
  impl->connect(deadline);
  impl->join(deadline);
  impl_ = std::move(impl);
}

TcpStore::~TcpStore() {
  impl_->goodbye();
  if (impl_->server) {
    // Rank 0 keeps serving until the others have left (bounded by the timeout), so that leaving
    // first does not cut them off. When unwinding from an error there is nothing to wait for.
    const bool unwinding = std::uncaught_exceptions() > 0;
    impl_->server->stop(unwinding ? Clock::now() : deadline_after(impl_->opt.timeout));
  }
}

int TcpStore::rank() const { return impl_->opt.rank; }
int TcpStore::world_size() const { return impl_->opt.world_size; }

void TcpStore::set(const std::string& key, const Bytes& value) {
  impl_->set(key, value, /*exclusive=*/false, "set('" + key + "')");
}

Bytes TcpStore::get(const std::string& key) {
  const std::vector<std::string> keys{key};
  return impl_
      ->wait_for(
          keys, true, "get('" + key + "')",
          [&](const std::vector<uint32_t>& missing) { return "missing key: " + quoted_list(keys, missing); },
          impl_->opt.timeout)
      .at(0);
}

void TcpStore::wait(const std::vector<std::string>& keys) {
  impl_->wait_for(
      keys, false, "wait",
      [&](const std::vector<uint32_t>& missing) { return "missing keys: " + quoted_list(keys, missing); },
      impl_->opt.timeout);
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Writer w;
  w.u8(uint8_t(Op::check)).u32(uint32_t(keys.size()));
  for (const auto& k : keys) w.str(k);
  Bytes reply = impl_->request(w.frame(), deadline_after(impl_->opt.timeout), "check");
  Reader r(reply.data(), reply.size());
  if (Status(r.u8()) == Status::error) TDIST_FAIL(impl_->who, ": check failed: ", r.str());
  return r.u8() != 0;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  const std::string what = "add('" + key + "')";
  Bytes reply = impl_->request(Writer().u8(uint8_t(Op::add)).str(key).i64(delta).frame(),
                               deadline_after(impl_->opt.timeout), what);
  Reader r(reply.data(), reply.size());
  if (Status(r.u8()) == Status::error) TDIST_FAIL(impl_->who, ": ", what, " failed: ", r.str());
  return r.i64();
}

namespace {

// Keys of a collective: one per rank, "__tdist/<kind>/<tag>/<rank>".
std::vector<std::string> per_rank_keys(const std::string& kind, const std::string& tag, int world_size) {
  std::vector<std::string> keys;
  keys.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) keys.push_back(kInternalPrefix + kind + "/" + tag + "/" + std::to_string(r));
  return keys;
}

// Where a rank last entered a store collective: "__tdist/at/<rank>" holds that call's name, so that
// a timeout can tell ranks that are elsewhere (another barrier, another call count) from ranks
// that never came.
std::string position_key(int rank) { return kInternalPrefix + "at/" + std::to_string(rank); }

// "; rank 2 last entered barrier('x'), rank 3 has entered none" for the ranks a collective misses.
std::string positions_of(TcpStore& store, const std::vector<uint32_t>& ranks) {
  std::string out;
  try {
    for (uint32_t r : ranks) {
      const std::string key = position_key(static_cast<int>(r));
      out += out.empty() ? "; " : ", ";
      if (store.check({key})) {
        const Bytes at = store.get(key);
        out += "rank " + std::to_string(r) + " last entered " + std::string(at.begin(), at.end());
      } else {
        out += "rank " + std::to_string(r) + " has entered no store collective";
      }
    }
  } catch (const std::exception&) {
    // The store is failing too: the missing ranks alone must do.
  }
  return out;
}

}  // namespace

void TcpStore::note_position(const std::string& what) {
  impl_->set(position_key(impl_->opt.rank), Bytes(what.begin(), what.end()), /*exclusive=*/false, "note position");
}

std::vector<Bytes> TcpStore::all_gather(const std::string& tag, const Bytes& mine) {
  return all_gather(tag, mine, impl_->opt.timeout);
}

std::vector<Bytes> TcpStore::all_gather(const std::string& tag, const Bytes& mine, std::chrono::milliseconds timeout) {
  TDIST_CHECK_ARG(timeout.count() > 0, "timeout", "expected a positive duration, got ", timeout.count(), " ms");
  const std::string what = "all_gather('" + tag + "')";
  note_position(what);
  const auto keys = per_rank_keys("all_gather", tag, impl_->opt.world_size);
  if (!impl_->set(keys[impl_->opt.rank], mine, /*exclusive=*/true, what))
    TDIST_FAIL(impl_->who, ": ", what,
               ": this tag was used before; each all_gather tag may be "
               "used once per job, so make it unique (e.g. add a counter suffix)");
  return impl_->wait_for(
      keys, true, what,
      [&](const std::vector<uint32_t>& missing) {
        return "ranks that never arrived: " + format_rank_list(as_ranks(missing)) + positions_of(*this, missing);
      },
      timeout);
}

void TcpStore::barrier(const std::string& tag) {
  const std::string what = "barrier('" + tag + "')";
  note_position(what);
  const auto keys = per_rank_keys("barrier", tag, impl_->opt.world_size);
  if (!impl_->set(keys[impl_->opt.rank], Bytes{}, /*exclusive=*/true, what))
    TDIST_FAIL(impl_->who, ": ", what,
               ": this tag was used before; each barrier tag may be used "
               "once per job, so make it unique (e.g. add a counter suffix)");
  impl_->wait_for(
      keys, false, what,
      [&](const std::vector<uint32_t>& missing) {
        return "ranks that never arrived: " + format_rank_list(as_ranks(missing)) + positions_of(*this, missing);
      },
      impl_->opt.timeout);
}

void TcpStore::check_alive() {
  // A wait that expires at once on a key nobody sets: the server answers a wait with the dead
  // ranks before anything else, else with "timeout", which here means "all alive".
  const std::vector<std::string> keys{kInternalPrefix + "never_set"};
  try {
    impl_->wait_for(
        keys, false, "check_alive", [](const std::vector<uint32_t>&) { return std::string(); },
        std::chrono::milliseconds(0));
  } catch (const TimeoutError&) {
    if (!impl_->broken.empty()) throw;  // no answer at all: rank 0 is gone or hung
  }
}

}  // namespace tdist
