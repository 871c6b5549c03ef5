#ifndef FLCE_KERNELS_DTYPE_H_
#define FLCE_KERNELS_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace flce {

// Element types of the tensors flce exchanges.
enum class DType { kFloat32, kFloat16, kBFloat16, kInt32, kInt64 };

// Bytes per element.
int DTypeSize(DType dtype);

// "fp32", "fp16", "bf16", "int32", "int64".
const char* DTypeName(DType dtype);

inline bool IsFloating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

// bfloat16 <-> float: round to nearest even; NaN stays NaN.
inline float BFloat16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float: round to nearest even, with subnormals, inf and NaN.
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float f);

// Converts `count` elements of a floating dtype to float.
// REQUIRES: IsFloating(dtype).
void ToFloat(DType dtype, const void* src, int64_t count, float* dst);

// Converts `count` floats to a floating dtype (rounding once).
// REQUIRES: IsFloating(dtype).
void FromFloat(DType dtype, const float* src, int64_t count, void* dst);
// The same on several threads of its own for large counts (a gigabyte's
// narrowing is a second on one core): the same bits.
void FromFloatInParallel(DType dtype, const float* src, int64_t count, void* dst);

// Rounds a float to the nearest value representable in `dtype`.
float RoundTo(DType dtype, float value);

}  // namespace flce

#endif  // FLCE_KERNELS_DTYPE_H_
