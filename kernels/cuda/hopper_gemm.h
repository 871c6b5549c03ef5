#ifndef FLCE_KERNELS_CUDA_HOPPER_GEMM_H_
#define FLCE_KERNELS_CUDA_HOPPER_GEMM_H_

// flce's own GEMM for Hopper (compute capability 9.0), in the three forms
// the engine's GEMMs take (row-major throughout, fp32 accumulation):
//   logits = X·Wᵀ   C[m×n] = A[m×k] · B[n×k]ᵀ   both operands K-major;
//   dX = dZ·W       C[m×n] = A[m×k] · B[k×n]    B MN-major;
//   dW = dZᵀ·X      C[m×n] = A[k×m]ᵀ · B[k×n]   both MN-major;
// each as C = alpha·A·B (+ an fp32 source, rounded once into C's dtype);
//   fused dX = G·W, G formed from the logits as they are read (LogitGradient).
// Warp-specialised and persistent: one warpgroup feeds shared memory
// through the tensor memory accelerator (TMA, 128-byte swizzle), two
// warpgroups multiply with wgmma from shared memory (the MN-major operands
// through wgmma's transposed reads) and write their tiles to C through
// shared memory in whole lines. Plain C++ and the CUDA runtime's types only
// (no Abseil, no gRPC), so nvcc stays simple. The launcher never allocates
// and never synchronises.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/logit_gradient.h"
#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// How an operand is stored: kK, its rows run along K (A [m, k], B [n, k]);
// kMN, its rows run along M or N (A [k, m], B [k, n]). Row-major, the
// row stride given in elements.
enum class Major { kK, kMN };

struct HopperGemmArgs {
  const void* a = nullptr;  // [m, k] (kK) or [k, m] (kMN), row stride lda elements
  int64_t lda = 0;
  Major a_major = Major::kK;
  const void* b = nullptr;  // [n, k] (kK) or [k, n] (kMN), row stride ldb elements
  int64_t ldb = 0;
  Major b_major = Major::kK;
  void* c = nullptr;  // [m, n] row-major, row stride ldc elements
  int64_t ldc = 0;
  // C = alpha·A·B + source: fp32 [m, n], row stride ld_source, added before
  // C's one rounding (dW's sum over token chunks, its last chunk narrowed
  // to the weight's dtype on the way); may be C itself when C is fp32.
  // Null: nothing added.
  const float* source = nullptr;
  int64_t ld_source = 0;
  float alpha = 1.0f;
  // With lse set: A is the logits and the GEMM multiplies their gradient
  // (LogitGradient), in the dX form only.
  LogitGradient gradient;
  int64_t m = 0, n = 0, k = 0;
  DType in_type = DType::kBFloat16;   // A's and B's: bf16 or fp16
  DType out_type = DType::kBFloat16;  // C's: in_type or fp32
  // Blocks of a cluster that share each of B's tiles (1 or 2): the TMA
  // multicasts B's rows into both, halving its reads from L2. 2 is the
  // faster at the engine's logits shapes (V of 128256 and more); 1 at
  // 4096×4096×32000 and 8192³ (bench/RESULTS.md, "Hopper GEMM" entries).
  int cluster = 2;
  // The consumer warpgroups' schedule. false (cooperative): both read every
  // stage of a tile's 128 rows (64 each) and multiply at once, then both
  // write their rows while the tensor cores idle. true (ping-pong): each
  // stage holds one warpgroup's 64 rows, and the two multiply in turns,
  // one's epilogue beside the other's multiplies; B's tile is read twice
  // per 128 rows. Not with a gradient.
  bool ping_pong = false;
};

// Whether `device` runs the kernel (compute capability 9.0) and the
// arguments fit it: one of the three forms above (a_major kMN only with
// b_major kMN), bf16 or fp16 operands, C in their dtype or fp32, lda and
// ldb multiples of 8 elements (16-byte rows, the TMA's rule) and at least
// the row's extent (k for kK, m or n for kMN), 16-byte aligned A and B,
// k positive and for a K-major operand a multiple of 8, ldc ≥ n,
// ld_source ≥ n with a source, m, n and k below 2³¹ (the TMA's
// coordinates), cluster 1 or 2; a gradient (all four arrays set) only in
// the dX form and not in ping-pong.
bool HopperGemmSupported(const HopperGemmArgs& args, int device);

// C = alpha·A·B (+ source), in the args' form, on `stream` with at most
// `sms` resident blocks (the device's multiprocessor count: one block
// each, persistent). REQUIRES: HopperGemmSupported(args, the stream's
// device); otherwise cudaErrorInvalidValue (cudaErrorNotSupported on
// another architecture). m == 0 or n == 0 is a no-op.
cudaError_t LaunchHopperGemm(const HopperGemmArgs& args, int sms, cudaStream_t stream);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_HOPPER_GEMM_H_
