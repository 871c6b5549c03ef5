#include "proto/crc32c.h"

#include <string>

#include "gtest/gtest.h"

namespace flce {
namespace {

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 (iSCSI) test vectors.
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  const std::string ones(32, '\xff');
  EXPECT_EQ(Crc32c(0, ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
}

TEST(Crc32cTest, ExtendsAcrossPieces) {
  const std::string text = "fused linear cross-entropy, chunk by chunk";
  const uint32_t whole = Crc32c(0, text.data(), text.size());
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    EXPECT_EQ(Crc32c(Crc32c(0, text.data(), cut), text.data() + cut, text.size() - cut), whole);
  }
}

}  // namespace
}  // namespace flce
