// Private to the TCP store: wire protocol shared by client and server, and small POSIX helpers.
//
// Every message is a frame: u32 payload length (little endian), then the payload. A request
// payload starts with an Op byte, a reply payload with a Status byte. Integers are little
// endian; a string or byte array is a u32 length followed by its bytes.
//
//   request                                     reply (Status::ok)
//   join         u32 magic, u32 version,        u32 magic
//                i32 rank, i32 world_size,
//                bytes auth (auth_token(secret): 32 bytes, or none without a secret)
//   join_barrier u64 timeout_ms                 -
//   set          str key, bytes value,          -
//                u8 exclusive (fail if present)
//   wait         u64 timeout_ms, u8 want_values, u32 n values (0 unless want_values), bytes...
//                u32 n keys, str keys...
//   check        u32 n keys, str keys...        u8 all_present
//   add          str key, i64 delta             i64 new value
//   shutdown     -                              (no reply: the client closes next)
//
//   Status::error   str message (join refused, a rank died, key already present, request or
//                   reply above its size limit, ...)
//
// Limits (checked by the server as soon as a frame's length arrives, before any payload is kept):
// a connection that has not joined may send one frame of at most kMaxJoinFrameBytes, within the
// handshake deadline, else it is closed; a joined rank's request above kMaxRequestBytes is read
// and dropped, then answered with an error; a reply above kMaxReplyBytes is not built, an error
// is sent instead. A connection is read only while its previous reply is fully sent.
//   Status::timeout u32 n, u32 indices of the missing keys (join_barrier: missing ranks)
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tdist/common/error.hpp"
#include "tdist/runtime/tcp_store.hpp"

// Like TDIST_FAIL, but throws tdist::TimeoutError.
#define TDIST_STORE_TIMEOUT(...) ::tdist::detail::throw_at<::tdist::TimeoutError>(__FILE__, __LINE__, __VA_ARGS__)

namespace tdist::store {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x54445354;  // "TDST": tells a tdist store from another service
constexpr uint32_t kVersion = 2;         // 2: join carries the job's auth token
// The join frame is a few dozen bytes: anything larger before the handshake is not one of ours.
constexpr uint32_t kMaxJoinFrameBytes = 4096;
// The store carries bootstrap data (ids, sizes, small tables), not tensors.
constexpr uint32_t kMaxRequestBytes = 64u << 20;
constexpr uint64_t kMaxReplyBytes = 256ull << 20;
// Replies the client accepts: the largest reply plus its header.
constexpr uint32_t kMaxFrameBytes = uint32_t(kMaxReplyBytes) + 4096;
// Connections that have not joined yet: at most this many above world_size (the oldest is closed
// to make room), each for at most kHandshakeTimeout (or the store's timeout, if shorter).
constexpr size_t kMaxUnjoinedExtra = 64;
constexpr std::chrono::milliseconds kHandshakeTimeout{10'000};
constexpr size_t kAuthTokenBytes = 32;

enum class Op : uint8_t { join = 1, join_barrier, set, wait, check, add, shutdown };
enum class Status : uint8_t { ok = 0, error = 1, timeout = 2 };

// Thrown by Reader on a truncated or malformed payload.
struct ProtocolError : Error {
  using Error::Error;
};

class Writer {
 public:
  Writer() { buf_.resize(4); }  // room for the frame length
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v) { return put(v, 4); }
  Writer& u64(uint64_t v) { return put(v, 8); }
  Writer& i32(int32_t v) { return u32(static_cast<uint32_t>(v)); }
  Writer& i64(int64_t v) { return u64(static_cast<uint64_t>(v)); }
  Writer& bytes(const void* data, size_t size) {
    u32(static_cast<uint32_t>(size));
    const auto* p = static_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + size);
    return *this;
  }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& blob(const Bytes& b) { return bytes(b.data(), b.size()); }
  // The finished frame, length prefix filled in; leaves the writer empty.
  Bytes frame() {
    uint32_t len = static_cast<uint32_t>(buf_.size() - 4);
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<uint8_t>(len >> (8 * i));
    return std::move(buf_);
  }

 private:
  Writer& put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Bytes buf_;
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  uint8_t u8() {
    need(1);
    return *p_++;
  }
  uint32_t u32() { return static_cast<uint32_t>(get(4)); }
  uint64_t u64() { return get(8); }
  int32_t i32() { return static_cast<int32_t>(u32()); }
  int64_t i64() { return static_cast<int64_t>(u64()); }
  Bytes blob() {
    uint32_t n = u32();
    need(n);
    Bytes out(p_, p_ + n);
    p_ += n;
    return out;
  }
  std::string str() {
    Bytes b = blob();
    return std::string(b.begin(), b.end());
  }
  bool done() const { return p_ == end_; }

 private:
  void need(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) throw ProtocolError("truncated store message");
  }
  uint64_t get(int n) {
    need(n);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p_[i]) << (8 * i);
    p_ += n;
    return v;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

inline uint32_t frame_length(const uint8_t* header) {
  return uint32_t(header[0]) | uint32_t(header[1]) << 8 | uint32_t(header[2]) << 16 | uint32_t(header[3]) << 24;
}

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

inline std::string errno_text(int err) { return std::string(std::strerror(err)); }

// Milliseconds left until `deadline`, clamped to [0, INT_MAX] for poll().
inline int poll_timeout_ms(Clock::time_point deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 0x7fffffff ? 0x7fffffff : static_cast<int>(left);
}

// Long timeouts are clamped so that now() + timeout cannot overflow the clock.
inline Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  constexpr std::chrono::milliseconds kMax = std::chrono::hours(24 * 365 * 10);
  return Clock::now() + std::min(timeout, kMax);
}

// What a process presents at join: SHA-256 over a domain tag and the job secret (so the secret
// itself is not what travels); empty for an empty secret.
Bytes auth_token(const std::string& secret);
// Equal sizes and bytes, in time that depends on the sizes only.
bool constant_time_equal(const Bytes& a, const Bytes& b);

// "3" / "1, 4-6, 9"; long lists are cut after a few entries with the count left.
std::string format_rank_list(const std::vector<int>& sorted_ranks);

}  // namespace tdist::store
