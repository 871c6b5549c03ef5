#include "kernels/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace flce {
namespace {

TEST(DTypeTest, Sizes) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kInt32), 4);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8);
}

TEST(DTypeTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even.
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(BFloat16ToFloat(0xc000), -2.0f);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(INFINITY)), INFINITY);
}

TEST(DTypeTest, HalfRoundTripsEveryFiniteValue) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) continue;  // NaN
    ASSERT_EQ(FloatToHalf(HalfToFloat(h)), h) << "bits " << bits;
  }
}

TEST(DTypeTest, HalfRoundsOverflowAndSubnormals) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(65504.0f)), 65504.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(70000.0f)), INFINITY);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  // Half of the smallest subnormal ties to even: 0.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 1);
  EXPECT_EQ(HalfToFloat(FloatToHalf(0.1f)), 0.0999755859375f);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(DTypeTest, ConvertsArrays) {
  const float in[3] = {1.5f, -0.25f, 3.0f};
  uint16_t half[3];
  float back[3];
  FromFloat(DType::kBFloat16, in, 3, half);
  ToFloat(DType::kBFloat16, half, 3, back);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(back[i], in[i]);
  EXPECT_EQ(RoundTo(DType::kBFloat16, 1.00390625f), 1.0f);
  EXPECT_EQ(RoundTo(DType::kFloat32, 1.00390625f), 1.00390625f);
}

}  // namespace
}  // namespace flce
