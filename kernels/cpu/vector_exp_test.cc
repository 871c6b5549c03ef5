#include "kernels/cpu/vector_exp.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace flce {
namespace {

// Within 2 units of roundoff of exp over the range whose results are
// normal floats, every value's bits those of the one-float form, tails
// (n not a multiple of 8) included, and the sum the fp64 sum of the values.
TEST(VectorExpTest, CloseToExpAndTheSameBitsAsOneAtATime) {
  std::vector<float> x;
  for (float v = -87.0f; v < 88.0f; v += 0.01371f) x.push_back(v);
  x.push_back(0.0f);
  x.push_back(-0.0f);
  x.push_back(1e-30f);
  x.push_back(-1e-30f);
  const int64_t n = static_cast<int64_t>(x.size());
  ASSERT_NE(n % 8, 0);
  std::vector<float> e = x;
  const double sum = ShiftedExpSum(e.data(), n, 0.0f, /*store=*/true);
  double want_sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double exact = std::exp(static_cast<double>(x[i]));
    ASSERT_LE(std::fabs(e[i] - exact), 2.0 * std::ldexp(exact, -24)) << x[i];
    const float one = VectorExpReference(x[i]);
    ASSERT_EQ(std::memcmp(&e[i], &one, 4), 0) << x[i];
    want_sum += e[i];
  }
  EXPECT_NEAR(sum, want_sum, 1e-12 * want_sum);
  EXPECT_EQ(VectorExpReference(0.0f), 1.0f);
}

// The shift is subtracted in fp32 first; without `store` the row is left
// alone.
TEST(VectorExpTest, ShiftsAndLeavesTheRowUnlessAskedToStore) {
  std::vector<float> z = {3.0f, 1.0f, -2.0f, 0.5f, 3.0f, 2.0f, 1.5f, -1.0f, 2.5f, 0.0f, 3.0f};
  const std::vector<float> before = z;
  double want = 0;
  for (float v : z) want += std::exp(static_cast<double>(v) - 3.0);
  EXPECT_NEAR(ShiftedExpSum(z.data(), static_cast<int64_t>(z.size()), 3.0f, false), want,
              1e-6 * want);
  EXPECT_EQ(z, before);
}

// Infinities, NaN and the ends of the range, in the vector lanes and the tail.
TEST(VectorExpTest, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {-inf, inf, nan, -100.0f, 100.0f, -87.5f, 88.5f, 0.0f, -inf, nan};
  std::vector<float> e = x;
  ShiftedExpSum(e.data(), static_cast<int64_t>(e.size()), 0.0f, /*store=*/true);
  for (size_t i = 0; i < x.size(); i += 8) {  // lane 0 of the vector, then the tail
    EXPECT_EQ(e[i], 0.0f);
  }
  EXPECT_EQ(e[1], inf);
  EXPECT_TRUE(std::isnan(e[2]));
  EXPECT_EQ(e[3], 0.0f);
  EXPECT_EQ(e[4], inf);
  EXPECT_EQ(e[5], 0.0f);
  EXPECT_EQ(e[6], inf);
  EXPECT_EQ(e[7], 1.0f);
  EXPECT_TRUE(std::isnan(e[9]));
  std::vector<float> with_nan = {1.0f, nan, 2.0f};
  EXPECT_TRUE(std::isnan(ShiftedExpSum(with_nan.data(), 3, 0.0f, false)));
}

}  // namespace
}  // namespace flce
