// The TCP store's server: see tcp_store_server.hpp and the protocol in tcp_store_wire.hpp.
#include "tcp_store_server.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdio>
#include <limits>

namespace tdist::store {
namespace {

// Creates a listening socket bound to `addr`; returns -1 with errno set on failure.
int try_listen(const sockaddr* addr, socklen_t len) {
  int fd = ::socket(addr->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  // Lets a new job reuse the port while the previous job's connections sit in TIME_WAIT.
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, addr, len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

[[noreturn]] void fail_port_in_use(const std::string& where) {
  TDIST_FAIL("TcpStore rank 0 cannot listen on ", where,
             ": address already in use. Another job, or an earlier run still shutting down, "
             "holds this port: choose a free port with MASTER_PORT (tdistrun picks a free one "
             "when --master-port is not given)");
}

std::chrono::milliseconds read_timeout(Reader& r) {
  constexpr uint64_t kMaxMs = uint64_t(1) << 40;  // ~35 years: keeps the conversion in range
  return std::chrono::milliseconds(static_cast<int64_t>(std::min(r.u64(), kMaxMs)));
}

// The server holds one socket per rank: lift the soft descriptor limit (often 1024) towards the
// hard one when a large world needs it.
void raise_fd_limit(int world_size) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t wanted = static_cast<rlim_t>(world_size) * 2 + 256;
  if (lim.rlim_cur >= wanted) return;
  lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, lim.rlim_max);
  ::setrlimit(RLIMIT_NOFILE, &lim);
}

}  // namespace

StoreServer::StoreServer(const Config& config)
    : world_size_(config.world_size),
      where_(config.host + ":" + std::to_string(config.port)),
      auth_(config.auth),
      handshake_timeout_(config.handshake_timeout),
      ranks_(static_cast<size_t>(config.world_size), RankState::absent) {
  const bool explicit_bind = !config.bind.empty();
  const std::string& listen_host = explicit_bind ? config.bind : config.host;
  const std::string what = explicit_bind ? "TDIST_STORE_BIND" : "MASTER_ADDR";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(listen_host.c_str(), std::to_string(config.port).c_str(), &hints, &found);
  if (rc != 0)
    TDIST_FAIL("TcpStore rank 0 cannot resolve its listen address '", listen_host, "' (", what,
               "): ", ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);

  int fd = -1;
  int last_err = 0;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = try_listen(ai->ai_addr, ai->ai_addrlen);
    if (fd < 0 && errno == EADDRINUSE) fail_port_in_use(where_);
    if (fd < 0) last_err = errno;
  }
  // Never widen to all interfaces behind the user's back: that would expose the store on every
  // network this machine is on. Listening elsewhere than MASTER_ADDR must be asked for.
  if (fd < 0 && last_err == EADDRNOTAVAIL)
    TDIST_FAIL("TcpStore rank 0 cannot listen on '", listen_host, "' (", what,
               "): it is not an address "
               "of this machine. Rank 0 must run on the host that ",
               what, " names",
               explicit_bind ? ""
                             : "; to listen on another local address, or on all interfaces behind NAT or a DNS alias, "
                               "set TDIST_STORE_BIND (e.g. TDIST_STORE_BIND=0.0.0.0, which exposes the store on every "
                               "network of this machine)");
  if (fd < 0)
    TDIST_FAIL("TcpStore rank 0 cannot listen on ", listen_host, ":", config.port, " (", what,
               "): ", errno_text(last_err));
  listen_fd_ = Fd(fd);

  raise_fd_limit(world_size_);

  wake_fd_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_fd_.valid()) TDIST_FAIL("eventfd failed: ", errno_text(errno));
}

StoreServer::~StoreServer() { stop(Clock::now()); }

void StoreServer::start() {
  TDIST_CHECK(!thread_.joinable(), "the store server was started twice");
  thread_ = std::thread([this] { serve(); });
}

void StoreServer::stop(Clock::time_point linger_until) noexcept {
  if (!thread_.joinable()) return;
  linger_until_.store(linger_until.time_since_epoch().count());
  stop_requested_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  thread_.join();
}

void StoreServer::serve() {
  try {
    serve_loop();
  } catch (const std::exception& e) {
    // Clients see their connection close and report that rank 0's store is gone; this line
    // tells rank 0's log why.
    std::fprintf(stderr, "tdist: TcpStore server at %s stopped: %s\n", where_.c_str(), e.what());
  }
  conns_.clear();
  listen_fd_.reset();
}

void StoreServer::serve_loop() {
  std::vector<pollfd> fds;
  while (true) {
    const auto now = Clock::now();
    for (auto& c : conns_)
      if (c->pending && !c->closed) answer_pending(*c, now);
    state_changed_ = false;
    close_expired_handshakes(now);
    std::erase_if(conns_, [](const auto& c) { return c->closed; });

    if (stop_requested_.load()) {
      const Clock::time_point linger_until{Clock::duration(linger_until_.load())};
      if (!any_joined_client_connected() || now >= linger_until) return;
    }

    fds.clear();
    const bool accepting = now >= accept_paused_until_;
    fds.push_back({listen_fd_.get(), short(accepting ? POLLIN : 0), 0});
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    Clock::time_point next_deadline = Clock::time_point::max();
    for (auto& c : conns_) {
      // A client is read only once its last reply is out: one that sends without reading cannot
      // make the server queue replies without bound.
      const bool sending = c->out_sent < c->out.size();
      short events = c->close_after_send || sending ? 0 : POLLIN;
      if (sending) events |= POLLOUT;
      fds.push_back({c->fd.get(), events, 0});
      if (c->pending) next_deadline = std::min(next_deadline, c->pending->deadline);
      if (c->rank < 0) next_deadline = std::min(next_deadline, c->accepted + handshake_timeout_);
    }
    if (stop_requested_.load())
      next_deadline = std::min(next_deadline, Clock::time_point{Clock::duration(linger_until_.load())});
    if (!accepting) next_deadline = std::min(next_deadline, accept_paused_until_);
    const int timeout = next_deadline == Clock::time_point::max() ? -1 : poll_timeout_ms(next_deadline);

    if (::poll(fds.data(), fds.size(), timeout) < 0) {
      if (errno == EINTR) continue;
      TDIST_FAIL("poll failed: ", errno_text(errno));
    }
    if (fds[1].revents != 0) {
      uint64_t count;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_.get(), &count, sizeof(count));
    }
    // conns_ only grows below (accept comes last), so fds[2 + i] still matches conns_[i].
    const size_t polled = conns_.size();
    for (size_t i = 0; i < polled; ++i) {
      Conn& c = *conns_[i];
      const short rev = fds[2 + i].revents;
      if (rev & POLLOUT) send_pending_output(c);
      if (!c.closed && (rev & (POLLIN | POLLHUP | POLLERR))) {
        if (c.close_after_send)
          close_conn(c);  // the rejected client hung up or errored
        else
          read_from(c);
      }
    }
    if (fds[0].revents & POLLIN) accept_clients();
  }
}

bool StoreServer::any_joined_client_connected() const {
  for (const auto& c : conns_)
    if (c->rank >= 0 && !c->closed) return true;
  return false;
}

void StoreServer::accept_clients() {
  while (true) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the pending connection keeps the listen socket readable, so pause
        // accepting for a moment instead of spinning; clients wait in the backlog meanwhile.
        if (!warned_out_of_fds_)
          std::fprintf(stderr, "tdist: TcpStore at %s cannot accept more clients: %s (raise ulimit -n)\n",
                       where_.c_str(), errno_text(errno).c_str());
        warned_out_of_fds_ = true;
        accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
      }
      return;  // EAGAIN: nothing more to accept
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    make_room_for_a_connection();
    auto c = std::make_unique<Conn>();
    c->fd = Fd(fd);
    c->accepted = Clock::now();
    conns_.push_back(std::move(c));
  }
}

void StoreServer::make_room_for_a_connection() {
  // Every real rank sends its join right after connecting, so the oldest connection that has not
  // joined is the likeliest idle one; a real rank closed here reconnects (TcpStore retries).
  const size_t cap = static_cast<size_t>(world_size_) + kMaxUnjoinedExtra;
  size_t unjoined = 0;
  Conn* oldest = nullptr;
  for (auto& c : conns_) {
    if (c->closed || c->rank >= 0) continue;
    ++unjoined;
    if (oldest == nullptr || c->accepted < oldest->accepted) oldest = c.get();
  }
  if (unjoined >= cap && oldest != nullptr) {
    if (!warned_crowded_)
      std::fprintf(stderr,
                   "tdist: TcpStore at %s: more than %zu connections have not joined; closing the "
                   "oldest ones (is something else connecting to this port?)\n",
                   where_.c_str(), cap);
    warned_crowded_ = true;
    close_conn(*oldest);
  }
}

void StoreServer::close_expired_handshakes(Clock::time_point now) {
  for (auto& c : conns_)
    if (!c->closed && c->rank < 0 && now >= c->accepted + handshake_timeout_) close_conn(*c);
}

void StoreServer::read_from(Conn& c) {
  // Reads one frame at a time, never more than its length asks for, so that memory held for a
  // connection is bounded by the frame limits, whatever the peer sends.
  uint8_t buf[65536];
  while (!c.closed && !c.close_after_send && c.out_sent == c.out.size()) {
    size_t want = sizeof(buf);
    if (c.discard_left > 0)
      want = std::min<uint64_t>(c.discard_left, sizeof(buf));
    else if (c.in.size() < 4)
      want = 4 - c.in.size();
    else
      want = std::min<size_t>(4 + frame_length(c.in.data()) - c.in.size(), sizeof(buf));
    const ssize_t n = ::recv(c.fd.get(), buf, want, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF or a reset: frames before it were handled already (a goodbye, say)
      close_conn(c);
      return;
    }
    if (c.discard_left > 0) {
      c.discard_left -= static_cast<uint64_t>(n);
      if (c.discard_left == 0) reply_error(c, c.discard_error);
      continue;
    }
    c.in.insert(c.in.end(), buf, buf + n);
    if (c.in.size() < 4) continue;
    const uint32_t len = frame_length(c.in.data());
    if (c.in.size() == 4) {
      // The length is checked as soon as it arrives, before any of the payload is kept.
      if (c.rank < 0 && len > kMaxJoinFrameBytes) {
        close_conn(c);  // not a tdist client: a join is a few dozen bytes
        return;
      }
      if (len > kMaxRequestBytes) {
        c.in.clear();
        c.discard_left = len;
        c.discard_error = "a request of " + std::to_string(len) + " bytes exceeds the store's limit of " +
                          std::to_string(kMaxRequestBytes) +
                          " bytes (the store is for bootstrap data; "
                          "exchange large data through NCCL)";
        continue;
      }
    }
    if (c.in.size() == 4 + size_t(len)) {
      const Bytes frame = std::move(c.in);
      c.in.clear();
      handle_frame(c, frame.data() + 4, len);
    }
  }
}

void StoreServer::handle_frame(Conn& c, const uint8_t* data, size_t size) {
  try {
    Reader r(data, size);
    const auto op = static_cast<Op>(r.u8());
    // Before the handshake only a join is accepted; a client has at most one request in flight.
    if ((c.rank < 0) != (op == Op::join) || c.pending) throw ProtocolError("unexpected request");
    handle_request(c, r, op);
  } catch (const ProtocolError&) {
    close_conn(c);  // garbage on the port; a joined rank sending it counts as dead
  } catch (const std::exception& e) {
    // Out of memory, say: this request fails, the store and the other ranks carry on.
    if (c.rank < 0)
      close_conn(c);
    else
      reply_error(c, std::string("the store could not serve this request: ") + e.what());
  }
}

void StoreServer::handle_request(Conn& c, Reader& r, Op op) {
  switch (op) {
    case Op::join: handle_join(c, r); return;
    case Op::join_barrier: {
      Pending p;
      p.for_join = true;
      p.deadline = deadline_after(read_timeout(r));
      c.pending = std::move(p);
      state_changed_ = true;  // check it on the next pass: everyone may have joined already
      return;
    }
    case Op::set: {
      std::string key = r.str();
      Bytes value = r.blob();
      const bool exclusive = r.u8() != 0;
      if (exclusive && kv_.count(key)) {
        reply_error(c, "key '" + key + "' is already present");
        return;
      }
      kv_[std::move(key)] = std::move(value);
      state_changed_ = true;
      reply(c, Writer().u8(uint8_t(Status::ok)).frame());
      return;
    }
    case Op::wait: {
      Pending p;
      p.deadline = deadline_after(read_timeout(r));
      p.want_values = r.u8() != 0;
      const uint32_t n = r.u32();
      for (uint32_t i = 0; i < n; ++i) p.keys.push_back(r.str());
      c.pending = std::move(p);
      state_changed_ = true;  // check it on the next pass, it may be satisfied already
      return;
    }
    case Op::check: {
      const uint32_t n = r.u32();
      bool all_present = true;
      for (uint32_t i = 0; i < n; ++i) all_present = kv_.count(r.str()) && all_present;
      reply(c, Writer().u8(uint8_t(Status::ok)).u8(all_present ? 1 : 0).frame());
      return;
    }
    case Op::add: handle_add(c, r); return;
    case Op::shutdown: c.said_goodbye = true; return;
  }
  throw ProtocolError("unknown request");
}

void StoreServer::handle_join(Conn& c, Reader& r) {
  if (r.u32() != kMagic) throw ProtocolError("bad magic");
  const uint32_t version = r.u32();
  auto refuse = [&](const std::string& why) {
    c.close_after_send = true;  // the store goes on serving the legitimate ranks
    reply_error(c, why);
  };
  if (version != kVersion)
    return refuse("store protocol version " + std::to_string(version) + " differs from rank 0's " +
                  std::to_string(kVersion) + " (are all ranks running the same tdist build?)");
  const int rank = r.i32();
  const int world = r.i32();
  const Bytes auth = r.blob();
  // First, before anything about this job is said: a process of another job learns nothing.
  if (!constant_time_equal(auth, auth_))
    return refuse("this process does not belong to the job of rank 0's store at " + where_ +
                  ": its job secret differs (TDIST_STORE_SECRET, or the launcher's job id). Another "
                  "job may be using this MASTER_PORT, or the ranks were started with different "
                  "secrets");
  if (world != world_size_)
    return refuse("this process has world size " + std::to_string(world) + " but rank 0's store at " + where_ +
                  " was created for world size " + std::to_string(world_size_) +
                  ": every rank must be started with the same "
                  "WORLD_SIZE (is another job using this MASTER_PORT?)");
  if (rank < 0 || rank >= world_size_)
    return refuse("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size_) + ")");
  if (ranks_[rank] != RankState::absent)
    return refuse("rank " + std::to_string(rank) +
                  " is already taken by another process: two "
                  "processes were started with the same RANK (or another job uses this MASTER_PORT)");
  c.rank = rank;
  ranks_[rank] = RankState::joined;
  ++joined_count_;
  state_changed_ = true;
  reply(c, Writer().u8(uint8_t(Status::ok)).u32(kMagic).frame());
}

void StoreServer::handle_add(Conn& c, Reader& r) {
  std::string key = r.str();
  const int64_t delta = r.i64();
  int64_t value = 0;
  if (auto it = kv_.find(key); it != kv_.end()) {
    const char* begin = reinterpret_cast<const char*>(it->second.data());
    const char* end = begin + it->second.size();
    auto [ptr, ec] = std::from_chars(begin, end, value);
    if (ec != std::errc() || ptr != end || begin == end)
      return reply_error(c, "add on key '" + key + "' whose value is not a decimal integer");
  }
  if ((delta > 0 && value > std::numeric_limits<int64_t>::max() - delta) ||
      (delta < 0 && value < std::numeric_limits<int64_t>::min() - delta))
    return reply_error(c, "add on key '" + key + "' overflows int64");
  value += delta;
  const std::string text = std::to_string(value);  // stored as text so get() reads it back
  kv_[key] = Bytes(text.begin(), text.end());
  state_changed_ = true;
  reply(c, Writer().u8(uint8_t(Status::ok)).i64(value).frame());
}

void StoreServer::answer_pending(Conn& c, Clock::time_point now) {
  Pending& p = *c.pending;
  if (!dead_ranks_.empty()) {
    reply_error(c, dead_ranks_message());
    c.pending.reset();
    return;
  }
  const bool expired = now >= p.deadline;
  if (!state_changed_ && !expired && !(p.for_join && join_failed_)) return;

  if (p.for_join) {
    if (joined_count_ == world_size_) {
      reply(c, Writer().u8(uint8_t(Status::ok)).frame());
    } else if (expired || join_failed_) {
      // Once one rank's join has timed out the job cannot start: tell every waiting rank now,
      // with the same list, before that rank gives up and (on rank 0) takes the server away.
      join_failed_ = true;
      Writer w;
      w.u8(uint8_t(Status::timeout)).u32(uint32_t(world_size_ - joined_count_));
      for (int r = 0; r < world_size_; ++r)
        if (ranks_[r] == RankState::absent) w.u32(uint32_t(r));
      reply(c, w.frame());
    } else {
      return;
    }
    c.pending.reset();
    return;
  }

  while (p.next_missing < p.keys.size() && kv_.count(p.keys[p.next_missing])) ++p.next_missing;
  if (p.next_missing == p.keys.size()) {
    uint64_t reply_bytes = 0;
    if (p.want_values)
      for (const auto& k : p.keys) reply_bytes += 4 + kv_[k].size();  // < 2^32 keys of < 2^26 bytes
    if (reply_bytes > kMaxReplyBytes) {
      reply_error(c, "the reply would hold " + std::to_string(reply_bytes) +
                         " bytes, above the store's "
                         "limit of " +
                         std::to_string(kMaxReplyBytes) + " bytes: fetch fewer or smaller values at once");
      c.pending.reset();
      return;
    }
    Writer w;
    w.u8(uint8_t(Status::ok)).u32(p.want_values ? uint32_t(p.keys.size()) : 0);
    if (p.want_values)
      for (const auto& k : p.keys) w.blob(kv_[k]);
    reply(c, w.frame());
  } else if (expired) {
    std::vector<uint32_t> missing;
    for (size_t i = p.next_missing; i < p.keys.size(); ++i)
      if (!kv_.count(p.keys[i])) missing.push_back(uint32_t(i));
    Writer w;
    w.u8(uint8_t(Status::timeout)).u32(uint32_t(missing.size()));
    for (uint32_t i : missing) w.u32(i);
    reply(c, w.frame());
  } else {
    return;
  }
  c.pending.reset();
}

std::string StoreServer::dead_ranks_message() const {
  const bool one = dead_ranks_.size() == 1;
  return std::string(one ? "rank " : "ranks ") + format_rank_list(dead_ranks_) +
         (one ? " died: its connection" : " died: their connections") +
         " to the store closed without a clean shutdown (the process crashed, was killed, or "
         "exited without destroying its TcpStore)";
}

void StoreServer::reply(Conn& c, Bytes frame) {
  c.out.insert(c.out.end(), frame.begin(), frame.end());
  send_pending_output(c);
}

void StoreServer::reply_error(Conn& c, const std::string& message) {
  reply(c, Writer().u8(uint8_t(Status::error)).str(message).frame());
}

void StoreServer::send_pending_output(Conn& c) {
  while (!c.closed && c.out_sent < c.out.size()) {
    ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL);
    if (n > 0) {
      c.out_sent += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;  // poll reports POLLOUT when there is room again
    } else {
      close_conn(c);
      return;
    }
  }
  if (c.closed) return;
  c.out.clear();
  c.out_sent = 0;
  if (c.close_after_send) close_conn(c);
}

void StoreServer::close_conn(Conn& c) {
  if (c.closed) return;
  c.closed = true;
  c.fd.reset();
  if (c.rank < 0) return;
  if (c.said_goodbye) {
    ranks_[c.rank] = RankState::left;
    return;
  }
  ranks_[c.rank] = RankState::dead;
  dead_ranks_.insert(std::upper_bound(dead_ranks_.begin(), dead_ranks_.end(), c.rank), c.rank);
  state_changed_ = true;
  std::fprintf(stderr,
               "tdist: TcpStore at %s: rank %d disconnected without a clean shutdown; "
               "waits on every rank now fail\n",
               where_.c_str(), c.rank);
}

}  // namespace tdist::store
