#include "kernels/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

// The bulk conversions (F16C where the CPU has it) agree with the scalar ones
// bit for bit on every half and on floats around every rounding boundary.
TEST(DTypeTest, BulkHalfConversionsMatchScalar) {
  std::vector<uint16_t> halves(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) halves[b] = static_cast<uint16_t>(b);
  std::vector<float> floats(halves.size());
  ToFloat(DType::kFloat16, halves.data(), static_cast<int64_t>(halves.size()), floats.data());
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float scalar = HalfToFloat(static_cast<uint16_t>(b));
    if (std::isnan(scalar)) {
      ASSERT_TRUE(std::isnan(floats[b])) << b;
    } else {
      ASSERT_EQ(floats[b], scalar) << b;
    }
  }
  std::vector<float> inputs;
  for (uint32_t b = 0; b < 0x7c00; b += 3) {
    const float f = HalfToFloat(static_cast<uint16_t>(b));
    const float next = HalfToFloat(static_cast<uint16_t>(b + 1));
    inputs.push_back(f);
    inputs.push_back((f + next) / 2);  // a tie
    inputs.push_back(std::nextafter((f + next) / 2, 1e9f));
    inputs.push_back(-std::nextafter((f + next) / 2, 0.0f));
  }
  inputs.push_back(1e6f);
  inputs.push_back(-INFINITY);
  std::vector<uint16_t> bulk(inputs.size());
  FromFloat(DType::kFloat16, inputs.data(), static_cast<int64_t>(inputs.size()), bulk.data());
  for (size_t i = 0; i < inputs.size(); ++i) {
    ASSERT_EQ(bulk[i], FloatToHalf(inputs[i])) << inputs[i];
  }
}

// The bulk bf16 conversions (eight at a time where the CPU has AVX2) give
// the scalar functions' bits: every bf16 value, and floats around every
// rounding boundary, ties, infinities, NaNs with payloads in the low bits.
TEST(DTypeTest, BulkBFloat16ConversionsMatchScalar) {
  std::vector<uint16_t> all(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) all[b] = static_cast<uint16_t>(b);
  std::vector<float> floats(all.size());
  ToFloat(DType::kBFloat16, all.data(), static_cast<int64_t>(all.size()), floats.data());
  for (uint32_t b = 0; b < 0x10000; ++b) {
    uint32_t bits;
    std::memcpy(&bits, &floats[b], 4);
    ASSERT_EQ(bits, b << 16) << b;
  }
  std::vector<uint32_t> inputs;
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    const uint32_t base = b << 16;
    for (uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) inputs.push_back(base | low);
  }
  inputs.push_back(0x7f800000u);  // inf
  inputs.push_back(0x7f800001u);  // a NaN with only a low payload bit
  inputs.push_back(0xffffffffu);
  inputs.push_back(0x7f7fffffu);  // the largest float: rounds to inf
  std::vector<float> values(inputs.size());
  std::memcpy(values.data(), inputs.data(), inputs.size() * 4);
  std::vector<uint16_t> bulk(values.size() + 3, 0xabcd);  // (its tail stays)
  FromFloat(DType::kBFloat16, values.data(), static_cast<int64_t>(values.size()), bulk.data());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(bulk[i], FloatToBFloat16(values[i])) << std::hex << inputs[i];
  }
  EXPECT_EQ(bulk[values.size()], 0xabcd);
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

// On several threads: the same bits as one, for a count that does not
// split evenly (and the tail piece lands where it belongs).
TEST(DTypeTest, ParallelNarrowingEqualsOneThread) {
  const int64_t n = (int64_t{9} << 20) + 12345;
  std::vector<float> in(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) in[i] = std::sin(static_cast<float>(i)) * 1e3f;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    std::vector<char> one(static_cast<size_t>(n * DTypeSize(dtype)));
    std::vector<char> many(one.size(), 7);
    FromFloat(dtype, in.data(), n, one.data());
    FromFloatInParallel(dtype, in.data(), n, many.data());
    EXPECT_EQ(one, many) << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace flce
