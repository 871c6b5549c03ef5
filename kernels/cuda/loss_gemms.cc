#include "kernels/cuda/loss_gemms.h"

namespace flce {
namespace internal_cuda {
namespace {

// C[m×n] (column-major, ldc) = op(A)·op(B) + beta·C. `tune`: the GEMM may
// run a tuned algorithm (CudaEngineOptions::tune_gemms). Only the token
// chunks' logits GEMMs do: tuned in isolation, the long-K dX GEMMs, the
// vocabulary-slice GEMMs and the token chunks' dW GEMMs picked algorithms
// that ran slower inside the engine than cuBLAS's defaults (bench/RESULTS.md:
// the per-GEMM experiment; tuning on against off, 2026-12-03, STORE_GRADS
// 0.1–1.7 ms slower with it at three shapes, RECOMPUTE, whose only tuned
// GEMM was the logits', even or faster).
absl::Status Gemm(const GemmLane& g, bool tune, cublasOperation_t op_a, cublasOperation_t op_b,
                  int64_t m, int64_t n, int64_t k, const void* a, DType a_type, int64_t lda,
                  const void* b, DType b_type, int64_t ldb, float beta, void* c, DType c_type,
                  int64_t ldc, float alpha = 1.0f) {
  const GemmShape shape{op_a, op_b, m, n, k, a_type, lda, b_type, ldb, c_type, ldc};
  return g.runner.Run(g.lane.blas(), g.lane.stream(), shape, a, b, beta, c, tune, alpha);
}

}  // namespace

absl::Status ChunkLogitsGemm(const GemmLane& g, const DeviceInputs& in, int64_t r0, int64_t count,
                             void* logits) {
  // Column-major view: logitsᵀ (V×count, ld V) = op(A)·op(B) with
  //   A = W, stored row-major [V, H] = column-major H×V (ld H), op T → V×H;
  //   B = X_c, stored row-major [count, H] = column-major H×count (ld H), op N.
  return Gemm(g, true, CUBLAS_OP_T, CUBLAS_OP_N, in.v, count, in.h, in.weight, in.dtype, in.h,
              in.x_row(r0), in.dtype, in.h, 0.0f, logits, in.dtype, in.v);
}

absl::Status ChunkDxGemm(const GemmLane& g, const DeviceInputs& in, int64_t count, const void* dz,
                         float* dx_c) {
  // Column-major view: dX_cᵀ (H×count, ld H) = A·B with
  //   A = W as column-major H×V (ld H), op N;
  //   B = dZ, stored row-major [count, V] = column-major V×count (ld V), op N.
  return Gemm(g, false, CUBLAS_OP_N, CUBLAS_OP_N, in.h, count, in.v, in.weight, in.dtype, in.h, dz,
              in.dtype, in.v, 0.0f, dx_c, DType::kFloat32, in.h);
}

absl::Status ChunkDwGemm(const GemmLane& g, const DeviceInputs& in, const void* x, int64_t count,
                         const void* dz, bool first, void* dw, DType dw_type, float alpha) {
  // Column-major view: dWᵀ (H×V, ld H) = alpha·A·op(B) with
  //   A = X_c as column-major H×count (ld H), op N;
  //   B = dZ as column-major V×count (ld V), op T → count×V.
  return Gemm(g, false, CUBLAS_OP_N, CUBLAS_OP_T, in.h, in.v, count, x, in.dtype, in.h, dz,
              in.dtype, in.v, first ? 0.0f : 1.0f, dw, dw_type, in.h, alpha);
}

absl::Status SliceLogitsGemm(const GemmLane& g, const DeviceInputs& in, int64_t c0, int64_t cols,
                             void* logits) {
  // Column-major view: logits_sᵀ (cols×N, ld cols) = op(A)·op(B) with
  //   A = W_s, rows c0.. of W: column-major H×cols (ld H), op T;
  //   B = X, column-major H×N (ld H), op N.
  return Gemm(g, false, CUBLAS_OP_T, CUBLAS_OP_N, cols, in.n, in.h, in.w_row(c0), in.dtype, in.h,
              in.hidden, in.dtype, in.h, 0.0f, logits, in.dtype, cols);
}

absl::Status SliceDxGemm(const GemmLane& g, const DeviceInputs& in, int64_t c0, int64_t cols,
                         const void* dz, bool first, float* dx) {
  // Column-major view: dXᵀ (H×N, ld H) = A·B with
  //   A = W_s (H×cols, ld H), op N;
  //   B = dZ_s (cols×N, ld cols), op N.
  return Gemm(g, false, CUBLAS_OP_N, CUBLAS_OP_N, in.h, in.n, cols, in.w_row(c0), in.dtype, in.h,
              dz, in.dtype, cols, first ? 0.0f : 1.0f, dx, DType::kFloat32, in.h);
}

absl::Status SliceDwGemm(const GemmLane& g, const DeviceInputs& in, int64_t cols, const void* dz,
                         void* dw_s, DType wdtype) {
  // Column-major view: dW_sᵀ (H×cols, ld H) = A·op(B) with
  //   A = X (H×N, ld H), op N;
  //   B = dZ_s (cols×N, ld cols), op T → N×cols.
  return Gemm(g, false, CUBLAS_OP_N, CUBLAS_OP_T, in.h, cols, in.n, in.hidden, in.dtype, in.h, dz,
              in.dtype, cols, 0.0f, dw_s, wdtype, in.h);
}

}  // namespace internal_cuda
}  // namespace flce
