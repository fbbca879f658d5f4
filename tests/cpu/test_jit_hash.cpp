// SHA-256 against FIPS 180-4 test vectors, field framing and hex round trips.
#include <gtest/gtest.h>

#include <string>

#include "tdist/jit/hash.hpp"

using tdist::jit::Digest;
using tdist::jit::Sha256;
using tdist::jit::sha256;
using tdist::jit::to_hex;

TEST(JitHash, StandardVectors) {
  EXPECT_EQ(to_hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(to_hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(to_hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(to_hex(sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(JitHash, IncrementalEqualsOneShot) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data += char('a' + i % 26);
  for (std::size_t split : {0ul, 1ul, 55ul, 56ul, 63ul, 64ul, 65ul, 500ul, 1000ul}) {
    Sha256 h;
    h.update(data.substr(0, split)).update(data.substr(split));
    EXPECT_EQ(h.finish(), sha256(data)) << "split " << split;
  }
}

TEST(JitHash, FieldsDoNotRunTogether) {
  Digest a = Sha256().field("x", "ab").field("y", "c").finish();
  Digest b = Sha256().field("x", "a").field("y", "bc").finish();
  EXPECT_NE(a, b);
}

TEST(JitHash, HexRoundTrip) {
  Digest d = sha256("tdist");
  Digest back{};
  ASSERT_TRUE(tdist::jit::from_hex(to_hex(d), back));
  EXPECT_EQ(back, d);
  EXPECT_FALSE(tdist::jit::from_hex("zz", back));
  EXPECT_FALSE(tdist::jit::from_hex(std::string(64, 'g'), back));
}
