#include "common/flag_types.h"

#include <string>

#include "absl/flags/marshalling.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

int64_t Bytes(const std::string& text) {
  ByteCount b;
  std::string error;
  EXPECT_TRUE(absl::ParseFlag(text, &b, &error)) << text << ": " << error;
  return b.bytes;
}

std::string ByteError(const std::string& text) {
  ByteCount b;
  std::string error;
  EXPECT_FALSE(absl::ParseFlag(text, &b, &error)) << text;
  return error;
}

TEST(ByteCountTest, TakesIntegersAndUnits) {
  EXPECT_EQ(Bytes("17179869184"), int64_t{16} << 30);
  EXPECT_EQ(Bytes("16GiB"), int64_t{16} << 30);
  EXPECT_EQ(Bytes("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(Bytes("1.5TiB"), int64_t{3} << 39);
  EXPECT_EQ(Bytes("64KiB"), 65536);
  EXPECT_EQ(Bytes("2GB"), 2000000000);
  EXPECT_EQ(Bytes("100 MB"), 100000000);
  EXPECT_EQ(Bytes("7B"), 7);
  EXPECT_EQ(Bytes("8Gi"), int64_t{8} << 30);
  EXPECT_EQ(Bytes("0"), 0);
}

TEST(ByteCountTest, RefusalsNameTheForms) {
  for (const char* bad : {"16G", "sixteen", "GiB", "-1", "-2GiB", "16 gib", ""}) {
    EXPECT_THAT(ByteError(bad), HasSubstr("e.g. 17179869184, 16GiB")) << bad;
  }
  EXPECT_THAT(ByteError("9000000TiB"), HasSubstr("2^63"));
}

TEST(ByteCountTest, UnparsesToTheShortestExactForm) {
  EXPECT_EQ(absl::UnparseFlag(ByteCount{int64_t{16} << 30}), "16GiB");
  EXPECT_EQ(absl::UnparseFlag(ByteCount{int64_t{1016} << 20}), "1016MiB");
  EXPECT_EQ(absl::UnparseFlag(ByteCount{int64_t{1} << 40}), "1TiB");
  EXPECT_EQ(absl::UnparseFlag(ByteCount{1000}), "1000");
  EXPECT_EQ(absl::UnparseFlag(ByteCount{0}), "0");
  for (int64_t v : {int64_t{0}, int64_t{12345}, int64_t{3} << 39}) {
    EXPECT_EQ(Bytes(absl::UnparseFlag(ByteCount{v})), v);
  }
}

TEST(DurationFlagTest, TakesDurationsWithUnits) {
  for (const auto& [text, want] :
       {std::pair<const char*, absl::Duration>{"600s", absl::Seconds(600)},
        {"10m", absl::Minutes(10)},
        {"1h30m", absl::Minutes(90)},
        {"250ms", absl::Milliseconds(250)},
        {"0", absl::ZeroDuration()}}) {
    DurationFlag d;
    std::string error;
    ASSERT_TRUE(absl::ParseFlag(text, &d, &error)) << text << ": " << error;
    EXPECT_EQ(d.value, want) << text;
    DurationFlag again;
    ASSERT_TRUE(absl::ParseFlag(absl::UnparseFlag(d), &again, &error));
    EXPECT_EQ(again.value, want);
  }
}

TEST(DurationFlagTest, ABareNumberIsRefusedNamingTheForms) {
  DurationFlag d;
  std::string error;
  EXPECT_FALSE(absl::ParseFlag("600", &d, &error));
  EXPECT_THAT(error, HasSubstr("'600' has no unit"));
  EXPECT_THAT(error, HasSubstr("e.g. 600s, 10m"));
  EXPECT_FALSE(absl::ParseFlag("soon", &d, &error));
  EXPECT_THAT(error, HasSubstr("e.g. 600s, 10m"));
  EXPECT_FALSE(absl::ParseFlag("-5s", &d, &error));
  EXPECT_THAT(error, HasSubstr("negative"));
  EXPECT_FALSE(absl::ParseFlag("inf", &d, &error));
}

}  // namespace
}  // namespace flce
