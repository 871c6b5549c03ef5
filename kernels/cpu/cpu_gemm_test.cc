#include "kernels/cpu/cpu_gemm.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"

namespace flce {
namespace {

// op(X)[i][j] of X stored row-major with leading dimension ld.
double At(const std::vector<float>& x, int64_t ld, Transpose t, int64_t i, int64_t j) {
  return t == Transpose::kNo ? x[i * ld + j] : x[j * ld + i];
}

struct Case {
  int64_t m, n, k;
  Transpose ta, tb;
};

// Every transpose pair on odd sizes, written and then added: the fp64
// product of the operands as the GEMM sees them (bf16-rounded for bf16),
// within fp32 accumulation's rounding.
void Check(DType dtype, CpuGemm& gemm) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (const Case& c : {Case{1, 1, 1, Transpose::kNo, Transpose::kNo},
                        Case{3, 17, 5, Transpose::kNo, Transpose::kYes},
                        Case{17, 33, 257, Transpose::kYes, Transpose::kNo},
                        Case{64, 7, 129, Transpose::kYes, Transpose::kYes},
                        Case{255, 1000, 64, Transpose::kNo, Transpose::kYes}}) {
    SCOPED_TRACE(testing::Message() << c.m << "x" << c.n << "x" << c.k);
    // Stored shapes: A is m×k (or k×m transposed), B is k×n (or n×k).
    const int64_t lda = (c.ta == Transpose::kNo ? c.k : c.m) + 3;  // padded rows
    const int64_t ldb = c.tb == Transpose::kNo ? c.n : c.k;
    const int64_t a_rows = c.ta == Transpose::kNo ? c.m : c.k;
    const int64_t b_rows = c.tb == Transpose::kNo ? c.k : c.n;
    std::vector<float> a(a_rows * lda), b(b_rows * ldb);
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    // The operands in `dtype`, and their values as floats.
    std::vector<uint16_t> a16(a.size()), b16(b.size());
    const void* pa = a.data();
    const void* pb = b.data();
    if (dtype == DType::kBFloat16) {
      FromFloat(dtype, a.data(), a.size(), a16.data());
      FromFloat(dtype, b.data(), b.size(), b16.data());
      ToFloat(dtype, a16.data(), a.size(), a.data());
      ToFloat(dtype, b16.data(), b.size(), b.data());
      pa = a16.data();
      pb = b16.data();
    }
    const int64_t ldc = c.n + 2;
    std::vector<float> out(c.m * ldc, -1.0f);
    for (bool accumulate : {false, true}) {
      ASSERT_TRUE(gemm.Multiply(dtype, c.m, c.n, c.k, {pa, lda, c.ta}, {pb, ldb, c.tb}, out.data(),
                                ldc, accumulate)
                      .ok());
    }
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double want = 0, magnitude = 0;
        for (int64_t l = 0; l < c.k; ++l) {
          const double p = At(a, lda, c.ta, i, l) * At(b, ldb, c.tb, l, j);
          want += p;
          magnitude += std::fabs(p);
        }
        // Written, then added once more: twice the product.
        ASSERT_NEAR(out[i * ldc + j], 2 * want, 2 * magnitude * 1e-6 + 1e-30) << i << "," << j;
      }
      // The padding between rows is left alone.
      if (c.n + 1 < ldc) ASSERT_EQ(out[i * ldc + c.n], -1.0f);
    }
  }
}

TEST(CpuGemmTest, Fp32OnOneDnn) {
  CpuGemm gemm;
  EXPECT_EQ(gemm.OperandDType(DType::kFloat32), DType::kFloat32);
  EXPECT_EQ(gemm.OperandDType(DType::kFloat16), DType::kFloat32);
  Check(DType::kFloat32, gemm);
  // An empty reduction writes zeros, or adds nothing.
  float out[2] = {5.0f, 5.0f};
  ASSERT_TRUE(gemm.Multiply(DType::kFloat32, 1, 2, 0, {out, 0}, {out, 2}, out, 2, true).ok());
  EXPECT_EQ(out[1], 5.0f);
  ASSERT_TRUE(gemm.Multiply(DType::kFloat32, 1, 2, 0, {out, 0}, {out, 2}, out, 2, false).ok());
  EXPECT_EQ(out[1], 0.0f);
}

TEST(CpuGemmTest, Fp32OnOpenBlas) {
  CpuGemm gemm(Bf16Gemms::kWhereFaster, /*onednn_fp32=*/false);
  EXPECT_EQ(gemm.OperandDType(DType::kFloat32), DType::kFloat32);
  Check(DType::kFloat32, gemm);
}

TEST(CpuGemmTest, Bf16WhereTheCpuHasIt) {
  // Where bf16 is slower than fp32, not by default.
  EXPECT_EQ(CpuGemm().OperandDType(DType::kBFloat16),
            CpuGemm::Bf16Faster() ? DType::kBFloat16 : DType::kFloat32);
  if (CpuGemm::Bf16Faster()) EXPECT_TRUE(CpuGemm::NativeBf16());
  CpuGemm gemm(Bf16Gemms::kWhereNative);
  if (!CpuGemm::NativeBf16()) {
    EXPECT_EQ(gemm.OperandDType(DType::kBFloat16), DType::kFloat32);
    GTEST_SKIP() << "this CPU has no native bf16 GEMM (oneDNN)";
  }
  EXPECT_EQ(gemm.OperandDType(DType::kBFloat16), DType::kBFloat16);
  Check(DType::kBFloat16, gemm);
  // Turned off: bf16 inputs are widened to fp32 operands, and bf16 operands
  // are refused.
  CpuGemm off(Bf16Gemms::kNever);
  EXPECT_EQ(off.OperandDType(DType::kBFloat16), DType::kFloat32);
  uint16_t x = 0;
  float out = 0;
  EXPECT_EQ(off.Multiply(DType::kBFloat16, 1, 1, 1, {&x, 1}, {&x, 1}, &out, 1, false).code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace flce
