#include "kernels/dtype.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace flce {
namespace {

#if defined(__x86_64__)
// Bulk IEEE half conversions with the F16C instructions (round to nearest
// even, subnormals kept, as the portable functions), chosen at run time.
bool HasF16c() {
  static const bool has = [] {
    // CPUID leaf 1: ECX bit 29 F16C, bit 28 AVX, bit 27 OSXSAVE; the OS must
    // save the YMM state (XCR0 bits 1 and 2). (clang lacks
    // __builtin_cpu_supports("f16c").)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    if (!(c & (1u << 29)) || !(c & (1u << 28)) || !(c & (1u << 27))) return false;
    unsigned xcr0_low = 0, xcr0_high = 0;
    __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    return (xcr0_low & 6u) == 6u;
  }();
  return has;
}

__attribute__((target("avx,f16c"))) void HalfToFloatF16c(const uint16_t* src, int64_t count,
                                                         float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < count; ++i) dst[i] = HalfToFloat(src[i]);
}

__attribute__((target("avx,f16c"))) void FloatToHalfF16c(const float* src, int64_t count,
                                                         uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < count; ++i) dst[i] = FloatToHalf(src[i]);
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

// bf16 <-> float eight at a time: the same bits as BFloat16ToFloat and
// FloatToBFloat16 (round to nearest even, NaN kept quiet).
__attribute__((target("avx2"))) void BFloat16ToFloatAvx2(const uint16_t* src, int64_t count,
                                                         float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), u);
  }
  for (; i < count; ++i) dst[i] = BFloat16ToFloat(src[i]);
}

__attribute__((target("avx2"))) void FloatToBFloat16Avx2(const float* src, int64_t count,
                                                         uint16_t* dst) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  const __m256i half = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(half, lsb));
    const __m256i bits =
        _mm256_srli_epi32(_mm256_blendv_epi8(rounded, _mm256_or_si256(u, quiet), nan), 16);
    // Eight 32-bit lanes (each < 2^16) to eight 16-bit ones, in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
  for (; i < count; ++i) dst[i] = FloatToBFloat16(src[i]);
}
#endif

}  // namespace

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal half: normalise.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (abs >= 0x38800000u) {                       // normal half
    uint32_t v = abs - (112u << 23);
    v += 0xfffu + ((v >> 13) & 1u);
    return sign | static_cast<uint16_t>(v >> 13);
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
  // Subnormal half: value = mant * 2^-24; round to nearest even.
  const int exp = static_cast<int>(abs >> 23);
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const int shift = 126 - exp;  // in [14, 24]
  const uint32_t half_bit = 1u << (shift - 1);
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1);
  if (rem > half_bit || (rem == half_bit && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

void ToFloat(DType dtype, const void* src, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      if (count > 0) std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
#if defined(__x86_64__)
      if (HasAvx2()) return BFloat16ToFloatAvx2(s, count, dst);
#endif
      for (int64_t i = 0; i < count; ++i) dst[i] = BFloat16ToFloat(s[i]);
      return;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
#if defined(__x86_64__)
      if (HasF16c()) return HalfToFloatF16c(s, count, dst);
#endif
      for (int64_t i = 0; i < count; ++i) dst[i] = HalfToFloat(s[i]);
      return;
    }
    default:
      return;
  }
}

void FromFloat(DType dtype, const float* src, int64_t count, void* dst) {
  switch (dtype) {
    case DType::kFloat32:
      if (count > 0) std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
#if defined(__x86_64__)
      if (HasAvx2()) return FloatToBFloat16Avx2(src, count, d);
#endif
      for (int64_t i = 0; i < count; ++i) d[i] = FloatToBFloat16(src[i]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
#if defined(__x86_64__)
      if (HasF16c()) return FloatToHalfF16c(src, count, d);
#endif
      for (int64_t i = 0; i < count; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
    default:
      return;
  }
}

void FromFloatInParallel(DType dtype, const float* src, int64_t count, void* dst) {
  constexpr int64_t kPerThread = int64_t{4} << 20;  // elements: below this, one thread
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = std::min({cores, int64_t{8}, std::max(int64_t{1}, count / kPerThread)});
  if (threads <= 1) return FromFloat(dtype, src, count, dst);
  const int64_t per = (count + threads - 1) / threads;
  char* out = static_cast<char*>(dst);
  const int64_t elem = DTypeSize(dtype);
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t first = t * per, n = std::min(per, count - first);
    if (n > 0) workers.emplace_back([=] { FromFloat(dtype, src + first, n, out + first * elem); });
  }
  FromFloat(dtype, src, std::min(per, count), dst);
  for (std::thread& w : workers) w.join();
}

float RoundTo(DType dtype, float value) {
  switch (dtype) {
    case DType::kBFloat16:
      return BFloat16ToFloat(FloatToBFloat16(value));
    case DType::kFloat16:
      return HalfToFloat(FloatToHalf(value));
    default:
      return value;
  }
}

}  // namespace flce
