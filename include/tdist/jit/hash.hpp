// SHA-256 for cache keys and integrity checks of cache entries (FIPS 180-4).
// Not constant-time: it hashes kernel sources and binaries, never secrets.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tdist::jit {

using Digest = std::array<std::uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  Sha256& update(const void* data, std::size_t size);
  Sha256& update(std::string_view s) { return update(s.data(), s.size()); }
  // Length-prefixed field: a tag and a value that cannot run into the next field.
  Sha256& field(std::string_view tag, std::string_view value);
  Digest finish();  // the object must not be updated afterwards

 private:
  void block(const std::uint8_t* p);
  std::array<std::uint32_t, 8> h_;
  std::array<std::uint8_t, 64> buf_{};
  std::size_t buf_len_ = 0;
  std::uint64_t total_ = 0;
};

Digest sha256(std::string_view data);
std::string to_hex(const Digest& d);
// Parses 64 hex digits; returns false on anything else.
bool from_hex(std::string_view hex, Digest& out);

}  // namespace tdist::jit
