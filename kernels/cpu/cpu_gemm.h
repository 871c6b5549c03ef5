#ifndef FLCE_KERNELS_CPU_CPU_GEMM_H_
#define FLCE_KERNELS_CPU_CPU_GEMM_H_

// The CPU engine's GEMMs: C[m, n] = op(A)[m, k] · op(B)[k, n], or C += that,
// row-major, fp32 accumulation into an fp32 C, with A and B in fp32 or in
// bf16 (where the CPU has bf16 dot products, AVX512-BF16 or AMX: about twice
// fp32's rate on the development machine, bench/RESULTS.md, and no fp32 copy
// of a bf16 weight or of X), both on oneDNN's matmul; fp32 on OpenBLAS's
// sgemm when asked. oneDNN picks its kernels by the CPU's instruction sets,
// while Debian's OpenBLAS (0.3.21) picks them by the CPU's model and falls
// back to its SSE3 ones ("Prescott") on a CPU it does not know, as a VM's
// generic "Intel Xeon Processor": there sgemm ran at 38-43 GFLOP/s on 2
// cores against oneDNN's 200-290 (bench/RESULTS.md). fp16 operands are the
// caller's to widen: Debian's oneDNN (2.6) has no fp16 matmul.

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "kernels/dtype.h"

namespace flce {

enum class Transpose { kNo, kYes };

// When bf16 operands multiply in bf16 on oneDNN, rather than widened to fp32
// by the caller.
enum class Bf16Gemms {
  kNever,
  // Where the CPU has bf16 dot products (CpuGemm::NativeBf16()).
  kWhereNative,
  // Where it has them and oneDNN's bf16 matmul outruns its fp32 one on this
  // CPU (CpuGemm::Bf16Faster(), measured once): twice as fast on one
  // development machine, 0.6× on another (bench/RESULTS.md).
  kWhereFaster,
};

// One operand: `data` holds op(X) as rows × cols with leading dimension
// `ld` (the row stride of X as stored, transposed or not).
struct GemmOperand {
  const void* data = nullptr;
  int64_t ld = 0;
  Transpose transpose = Transpose::kNo;
};

class CpuGemm {
 public:
  // bf16 GEMMs run on oneDNN as `bf16` says; otherwise Multiply refuses
  // bf16 operands. fp32 GEMMs run on oneDNN with `onednn_fp32`, else on
  // OpenBLAS.
  explicit CpuGemm(Bf16Gemms bf16 = Bf16Gemms::kWhereFaster, bool onednn_fp32 = true);
  ~CpuGemm();
  CpuGemm(const CpuGemm&) = delete;
  CpuGemm& operator=(const CpuGemm&) = delete;

  // Whether this process's CPU runs oneDNN's bf16 matmul on bf16 dot-product
  // instructions (checked once).
  static bool NativeBf16();
  // Whether, in addition, oneDNN's bf16 matmul is faster than its fp32 one
  // here: each timed (best of 3) on a 256×2048×1024 product once per process
  // (a few milliseconds on two cores).
  static bool Bf16Faster();

  // The dtype of A and B this object multiplies inputs of `input` in: bf16
  // for bf16 inputs where bf16 GEMMs run (see Bf16Gemms), else fp32.
  DType OperandDType(DType input) const;

  // C[m, n] (+)= op(A) · op(B), C row-major with leading dimension ldc; A and
  // B in `dtype` (fp32, or bf16 where OperandDType says so). Thread-safe.
  // INTERNAL if the library fails.
  absl::Status Multiply(DType dtype, int64_t m, int64_t n, int64_t k, const GemmOperand& a,
                        const GemmOperand& b, float* c, int64_t ldc, bool accumulate);

 private:
  class OneDnn;  // oneDNN's primitives, cached by operand type and shape
  const bool bf16_;
  const bool onednn_fp32_;
  std::unique_ptr<OneDnn> onednn_;
};

}  // namespace flce

#endif  // FLCE_KERNELS_CPU_CPU_GEMM_H_
