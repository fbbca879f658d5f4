// Private to the TCP store: the server that rank 0 runs in a background thread.
//
// One thread serves every client with poll() over non-blocking sockets, so a slow or silent
// client never stalls the others. Waits are kept as pending requests and answered when their
// keys appear, when a rank dies, or at their deadline (with the missing keys), whichever is first.
//
// Admission (docs/security.md): a connection must join within the handshake deadline, presenting
// the job's auth token, a free rank and the job's world size; until then it may send one small
// frame and read nothing. Connections not joined are capped (the oldest is closed for a new one),
// so idle sockets cannot crowd out a real rank. A request that fails is answered with an error;
// the server thread itself survives every request.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tcp_store_wire.hpp"

namespace tdist::store {

class StoreServer {
 public:
  struct Config {
    std::string host;  // MASTER_ADDR: listened on, and named in messages
    std::string bind;  // listen here instead when not empty (TDIST_STORE_BIND)
    int port = 0;
    int world_size = 1;
    Bytes auth;  // auth_token(secret) every joining process must present
    std::chrono::milliseconds handshake_timeout = kHandshakeTimeout;
  };
  // Binds and listens on `bind`, else on `host`, which must then be an address of this machine
  // (a clear error otherwise: the server never widens to all interfaces by itself). Throws
  // tdist::Error when the port is taken or the address does not resolve.
  explicit StoreServer(const Config& config);
  ~StoreServer();  // stops at once
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Starts serving in a background thread.
  void start();
  // Keeps serving until every joined client has disconnected or until `linger_until`, whichever
  // is first, then closes every connection and joins the thread. Lingering lets rank 0 leave
  // first without cutting off ranks still finishing their last requests.
  void stop(Clock::time_point linger_until) noexcept;

 private:
  enum class RankState { absent, joined, left, dead };

  struct Pending {
    bool for_join = false;  // join_barrier: wait until every rank has joined
    std::vector<std::string> keys;
    bool want_values = false;
    size_t next_missing = 0;  // keys before this index are known present (keys never vanish)
    Clock::time_point deadline;
  };

  struct Conn {
    Fd fd;
    int rank = -1;               // -1 until the join handshake succeeds
    Clock::time_point accepted;  // the handshake deadline counts from here
    Bytes in;                    // one frame being received: length, then up to `length` bytes
    uint64_t discard_left = 0;   // bytes of an oversized request still to read and drop
    std::string discard_error;   // the error that answers it
    Bytes out;                   // replies not yet sent
    size_t out_sent = 0;
    bool said_goodbye = false;  // clean shutdown announced: closing is not a death
    bool close_after_send = false;
    bool closed = false;
    std::optional<Pending> pending;
  };

  void serve();
  void serve_loop();
  void accept_clients();
  void read_from(Conn& c);
  void make_room_for_a_connection();
  void close_expired_handshakes(Clock::time_point now);
  void handle_frame(Conn& c, const uint8_t* data, size_t size);
  void handle_request(Conn& c, Reader& r, Op op);
  void handle_join(Conn& c, Reader& r);
  void handle_add(Conn& c, Reader& r);
  void answer_pending(Conn& c, Clock::time_point now);
  void send_pending_output(Conn& c);
  void reply(Conn& c, Bytes frame);
  void reply_error(Conn& c, const std::string& message);
  void close_conn(Conn& c);
  std::string dead_ranks_message() const;
  bool any_joined_client_connected() const;

  const int world_size_;
  const std::string where_;  // "host:port" for messages
  const Bytes auth_;
  const std::chrono::milliseconds handshake_timeout_;
  Fd listen_fd_;
  Fd wake_fd_;  // eventfd: stop() wakes the poll loop through it
  std::thread thread_;
  std::atomic<bool> stop_requested_{false};
  std::atomic<Clock::rep> linger_until_{0};

  // State below is touched by the server thread only.
  std::map<std::string, Bytes> kv_;
  std::vector<RankState> ranks_;
  int joined_count_ = 0;
  std::vector<int> dead_ranks_;              // sorted
  bool state_changed_ = false;               // a key, a join or a death since pending waits were last checked
  bool join_failed_ = false;                 // a join barrier timed out: answer the other ones at once
  Clock::time_point accept_paused_until_{};  // set while out of file descriptors
  bool warned_out_of_fds_ = false;
  bool warned_crowded_ = false;
  std::vector<std::unique_ptr<Conn>> conns_;
};

}  // namespace tdist::store
