#ifndef FLCE_KERNELS_CUDA_LOSS_GEMMS_H_
#define FLCE_KERNELS_CUDA_LOSS_GEMMS_H_

// The CUDA engine's GEMMs, each named by what it computes in row-major
// terms, with the column-major mapping cuBLAS sees spelled out argument by
// argument in loss_gemms.cc. Input-dtype operands, fp32 accumulation (no
// TF32 for fp32 inputs), on the lane's stream.
//
// Two layouts: token chunks (rows [r0, r0 + count) of X against all of W:
// Forward, and RECOMPUTE when the budget allows no vocabulary slices) and
// vocabulary slices (all rows of X against rows [c0, c0 + cols) of W:
// RECOMPUTE's backward).

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/device_problem.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lane_pool.h"

namespace flce {
namespace internal_cuda {

// The GEMM runner and the lane a call's GEMMs run with.
struct GemmLane {
  GemmRunner& runner;
  const Lane& lane;
};

// logits[count, V] (input dtype) = X[r0 : r0 + count] · Wᵀ. Tuned.
absl::Status ChunkLogitsGemm(const GemmLane& g, const DeviceInputs& in, int64_t r0, int64_t count,
                             void* logits);

// dX_c[count, H] (fp32) = dZ · W for a chunk's gradient dz [count, V].
absl::Status ChunkDxGemm(const GemmLane& g, const DeviceInputs& in, int64_t count, const void* dz,
                         float* dx_c);

// dW[V, H] (`dw_type`: fp32 for an accumulator over chunks, or the final
// dtype when one GEMM makes all of it) = alpha · dZᵀ · X_c (first chunk:
// overwrites, so dW needs no zeroing) or += (later chunks), for `count`
// rows of X at x (input dtype) and their gradient dz [count, V]. Tuned.
absl::Status ChunkDwGemm(const GemmLane& g, const DeviceInputs& in, const void* x, int64_t count,
                         const void* dz, bool first, void* dw, DType dw_type, float alpha = 1.0f);

// logits_s[N, cols] (input dtype) = X · W[c0 : c0 + cols]ᵀ.
absl::Status SliceLogitsGemm(const GemmLane& g, const DeviceInputs& in, int64_t c0, int64_t cols,
                             void* logits);

// dX[N, H] (fp32) = dZ_s · W[c0 : c0 + cols] (first slice) or += (later).
absl::Status SliceDxGemm(const GemmLane& g, const DeviceInputs& in, int64_t c0, int64_t cols,
                         const void* dz, bool first, float* dx);

// dW[c0 : c0 + cols] ([cols, H], `wdtype`, rounded once) = dZ_sᵀ · X, over
// every token in one GEMM, written at dw_s.
absl::Status SliceDwGemm(const GemmLane& g, const DeviceInputs& in, int64_t cols, const void* dz,
                         void* dw_s, DType wdtype);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_LOSS_GEMMS_H_
