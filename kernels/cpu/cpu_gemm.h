#ifndef FLCE_KERNELS_CPU_CPU_GEMM_H_
#define FLCE_KERNELS_CPU_CPU_GEMM_H_

// The CPU engine's GEMMs: C[m, n] = op(A)[m, k] · op(B)[k, n], or C += that,
// row-major, fp32 accumulation into an fp32 C, with A and B in fp32
// (OpenBLAS's sgemm) or in bf16 (oneDNN's bf16 matmul where the CPU has bf16
// dot products, AVX512-BF16 or AMX: about twice sgemm's rate on the
// development machine, bench/RESULTS.md, and no fp32 copy of a bf16 weight
// or of X). fp16 operands are the caller's to widen: neither library has a
// native fp16 GEMM on CPUs without AVX512-FP16.

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "kernels/dtype.h"

namespace flce {

enum class Transpose { kNo, kYes };

// One operand: `data` holds op(X) as rows × cols with leading dimension
// `ld` (the row stride of X as stored, transposed or not).
struct GemmOperand {
  const void* data = nullptr;
  int64_t ld = 0;
  Transpose transpose = Transpose::kNo;
};

class CpuGemm {
 public:
  // bf16 GEMMs run on oneDNN when `native_bf16` and the CPU multiplies bf16
  // natively (NativeBf16()); otherwise Multiply refuses bf16 operands.
  explicit CpuGemm(bool native_bf16 = true);
  ~CpuGemm();
  CpuGemm(const CpuGemm&) = delete;
  CpuGemm& operator=(const CpuGemm&) = delete;

  // Whether this process's CPU runs oneDNN's bf16 matmul on bf16 dot-product
  // instructions (checked once).
  static bool NativeBf16();

  // The dtype of A and B this object multiplies inputs of `input` in: bf16
  // for bf16 inputs where bf16 GEMMs are native (and asked for), else fp32.
  DType OperandDType(DType input) const;

  // C[m, n] (+)= op(A) · op(B), C row-major with leading dimension ldc; A and
  // B in `dtype` (fp32, or bf16 where OperandDType says so). Thread-safe.
  // INTERNAL if the library fails.
  absl::Status Multiply(DType dtype, int64_t m, int64_t n, int64_t k, const GemmOperand& a,
                        const GemmOperand& b, float* c, int64_t ldc, bool accumulate);

 private:
  class Bf16;  // oneDNN's primitives, cached by shape
  const bool bf16_;
  std::unique_ptr<Bf16> bf16_impl_;
};

}  // namespace flce

#endif  // FLCE_KERNELS_CPU_CPU_GEMM_H_
