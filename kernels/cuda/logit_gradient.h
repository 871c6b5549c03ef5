#ifndef FLCE_KERNELS_CUDA_LOGIT_GRADIENT_H_
#define FLCE_KERNELS_CUDA_LOGIT_GRADIENT_H_

// The fused gradient's per-row factors: what row_kernels.h's
// LaunchGradientFactors writes and hopper_gemm.h's fused dX GEMM reads.
// Plain C++ (no CUDA headers needed), shared by both.

#include <cstdint>

namespace flce {
namespace internal_cuda {

// dX's A operand formed from the logits as it is read (the fused
// gradient): with `a` the logits z [m, k] (K-major, the input dtype), the
// GEMM multiplies
//   G(r, j) = target[r]                          where j == column[r]
//           = 0                                  where column[r] == kIgnoredRow
//           = coef[r] · exp(z(r, j) − lse[r])    elsewhere,
// each rounded once to the input dtype: for rows without label smoothing,
// softcap or bias (coef = scale·(w_t + 2·s·lse), target = scale·(w_t·(p_t
// − 1) + 2·s·lse·p_t)) the gradient LaunchGradientRows writes, bit for bit
// where there are no class weights either, without writing it. Device
// arrays of m values each.
struct LogitGradient {
  static constexpr int32_t kIgnoredRow = -2;
  const float* lse = nullptr;
  const float* coef = nullptr;
  const int32_t* column = nullptr;  // the target's j, -1 (none), or kIgnoredRow
  const float* target = nullptr;
  bool present() const { return lse != nullptr; }
};

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_LOGIT_GRADIENT_H_
