// core/crc32c.h: the streaming form agrees with the one-shot form at every split point, on
// lengths that exercise the 8-byte hardware loop and its byte tail.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "core/crc32c.h"

TEST(Crc32cExtend, AnySplitEqualsWhole) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    std::string s(rng() % 200 + 1, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    const uint32_t whole = mt::crc32c(s.data(), s.size());
    for (size_t cut = 0; cut <= s.size(); ++cut) {
      const uint32_t a = mt::crc32c_extend(0, s.data(), cut);
      ASSERT_EQ(mt::crc32c_extend(a, s.data() + cut, s.size() - cut), whole) << "cut " << cut << " of " << s.size();
    }
  }
  EXPECT_EQ(mt::crc32c_extend(0, "123456789", 9), 0xE3069283u);
}

TEST(Crc32cExtend, DetectsEveryFlippedByte) {
  std::string s(1000, '\0');
  std::mt19937 rng(7);
  for (char& c : s) c = static_cast<char>(rng());
  const uint32_t ref = mt::crc32c(s.data(), s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    s[i] = static_cast<char>(s[i] ^ 0x01);
    ASSERT_NE(mt::crc32c(s.data(), s.size()), ref) << "byte " << i;
    s[i] = static_cast<char>(s[i] ^ 0x01);
  }
}
