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

StoreServer::StoreServer(const std::string& host, int port, int world_size)
    : world_size_(world_size), where_(host + ":" + std::to_string(port)),
      ranks_(static_cast<size_t>(world_size), RankState::absent) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0)
    TDIST_FAIL("TcpStore rank 0 cannot resolve its listen address '", host, "' (MASTER_ADDR): ",
               ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);

  int fd = -1;
  int last_err = 0;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = try_listen(ai->ai_addr, ai->ai_addrlen);
    if (fd < 0 && errno == EADDRINUSE) fail_port_in_use(where_);
    if (fd < 0) last_err = errno;
  }
  if (fd < 0) {
    // host is not an address of this machine (a NAT or DNS alias): listen on all interfaces.
    sockaddr_storage any{};
    socklen_t len = 0;
    if (found->ai_family == AF_INET6) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&any);
      a6->sin6_family = AF_INET6;
      a6->sin6_addr = in6addr_any;
      a6->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof(sockaddr_in6);
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&any);
      a4->sin_family = AF_INET;
      a4->sin_addr.s_addr = htonl(INADDR_ANY);
      a4->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof(sockaddr_in);
    }
    fd = try_listen(reinterpret_cast<sockaddr*>(&any), len);
    if (fd < 0 && errno == EADDRINUSE) fail_port_in_use(where_);
    if (fd < 0)
      TDIST_FAIL("TcpStore rank 0 cannot listen on ", where_, " (", errno_text(last_err),
                 ") nor on all interfaces (", errno_text(errno), ")");
  }
  listen_fd_ = Fd(fd);

  raise_fd_limit(world_size);

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
      short events = c->close_after_send ? 0 : POLLIN;
      if (c->out_sent < c->out.size()) events |= POLLOUT;
      fds.push_back({c->fd.get(), events, 0});
      if (c->pending) next_deadline = std::min(next_deadline, c->pending->deadline);
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
        if (c.close_after_send) close_conn(c);  // the rejected client hung up or errored
        else read_from(c);
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
    auto c = std::make_unique<Conn>();
    c->fd = Fd(fd);
    conns_.push_back(std::move(c));
  }
}

void StoreServer::read_from(Conn& c) {
  uint8_t buf[65536];
  bool hung_up = false;
  while (true) {
    ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    hung_up = !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));  // EOF or a reset
    break;
  }
  // Frames that arrived before a hang-up still count: a clean shutdown is a frame then EOF.
  size_t consumed = 0;
  while (!c.closed && !c.close_after_send && c.in.size() - consumed >= 4) {
    const uint32_t len = frame_length(c.in.data() + consumed);
    if (len > kMaxFrameBytes) {
      close_conn(c);  // not a tdist client
      return;
    }
    if (c.in.size() - consumed - 4 < len) break;
    handle_frame(c, c.in.data() + consumed + 4, len);
    consumed += 4 + len;
  }
  if (!c.closed) c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(consumed));
  if (hung_up) close_conn(c);
}

void StoreServer::handle_frame(Conn& c, const uint8_t* data, size_t size) {
  try {
    Reader r(data, size);
    const auto op = static_cast<Op>(r.u8());
    // Before the handshake only a join is accepted; a client has at most one request in flight.
    if ((c.rank < 0) != (op == Op::join) || c.pending) throw ProtocolError("unexpected request");
    switch (op) {
      case Op::join:
        handle_join(c, r);
        return;
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
      case Op::add:
        handle_add(c, r);
        return;
      case Op::shutdown:
        c.said_goodbye = true;
        return;
    }
    throw ProtocolError("unknown request");
  } catch (const ProtocolError&) {
    close_conn(c);  // garbage on the port; a joined rank sending it counts as dead
  }
}

void StoreServer::handle_join(Conn& c, Reader& r) {
  if (r.u32() != kMagic) throw ProtocolError("bad magic");
  const uint32_t version = r.u32();
  const int rank = r.i32();
  const int world = r.i32();
  auto refuse = [&](const std::string& why) {
    c.close_after_send = true;  // the store goes on serving the legitimate ranks
    reply_error(c, why);
  };
  if (version != kVersion)
    return refuse("store protocol version " + std::to_string(version) + " differs from rank 0's " +
                  std::to_string(kVersion) + " (are all ranks running the same tdist build?)");
  if (world != world_size_)
    return refuse("this process has world size " + std::to_string(world) +
                  " but rank 0's store at " + where_ + " was created for world size " +
                  std::to_string(world_size_) + ": every rank must be started with the same "
                  "WORLD_SIZE (is another job using this MASTER_PORT?)");
  if (rank < 0 || rank >= world_size_)
    return refuse("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size_) + ")");
  if (ranks_[rank] != RankState::absent)
    return refuse("rank " + std::to_string(rank) + " is already taken by another process: two "
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
