#include "kernels/cpu/vector_exp.h"

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace flce {
namespace {

// exp(x) = 2^n · exp(r), n = round(x / ln 2), r = x − n·ln 2 (ln 2 in two
// parts, so r is exact), exp(r) by Cephes' expf polynomial (relative error
// about 1 unit of roundoff on |r| ≤ ln 2 / 2). Every step is one fp32
// operation or fused multiply-add, so the scalar and vector forms give the
// same bits.
constexpr float kHigh = 88.3762626647949f;  // above: +inf (2^n would overflow)
constexpr float kLow = -87.3365478f;        // below: 0 (under FLT_MIN)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

float ExpScalar(float x) {
  if (std::isnan(x)) return x;
  if (x > kHigh) return std::numeric_limits<float>::infinity();
  if (x < kLow) return 0.0f;
  const float n = std::floor(std::fma(x, kLog2e, 0.5f));
  float r = std::fma(n, -kLn2High, x);
  r = std::fma(n, -kLn2Low, r);
  float y = kP0;
  y = std::fma(y, r, kP1);
  y = std::fma(y, r, kP2);
  y = std::fma(y, r, kP3);
  y = std::fma(y, r, kP4);
  y = std::fma(y, r, kP5);
  y = std::fma(y, r * r, r + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#if defined(__x86_64__)
bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(kHigh), _CMP_GT_OQ);
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kLow), _CMP_LT_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 n =
      _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2High), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Low), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), under);
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()), over);
  return _mm256_blendv_ps(e, x, nan);
}

__attribute__((target("avx2,fma"))) double ShiftedExpSumAvx2(float* z, int64_t n, float shift,
                                                             bool store) {
  __m256d sum_low = _mm256_setzero_pd(), sum_high = _mm256_setzero_pd();
  const __m256 s = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(z + i), s));
    if (store) _mm256_storeu_ps(z + i, e);
    sum_low = _mm256_add_pd(sum_low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    sum_high = _mm256_add_pd(sum_high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(sum_low, sum_high));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) {
    const float e = ExpScalar(z[i] - shift);
    if (store) z[i] = e;
    sum += e;
  }
  return sum;
}
#endif

}  // namespace

float VectorExpReference(float x) { return ExpScalar(x); }

double ShiftedExpSum(float* z, int64_t n, float shift, bool store) {
#if defined(__x86_64__)
  if (HasAvx2Fma()) return ShiftedExpSumAvx2(z, n, shift, store);
#endif
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = ExpScalar(z[i] - shift);
    if (store) z[i] = e;
    sum += e;
  }
  return sum;
}

}  // namespace flce
