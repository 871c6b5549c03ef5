#ifndef FLCE_KERNELS_CUDA_LOSS_KERNELS_H_
#define FLCE_KERNELS_CUDA_LOSS_KERNELS_H_

// Launchers of the CUDA engine's fused row kernels. Plain C++ and the CUDA
// runtime's types only (no Abseil, no gRPC), so nvcc stays simple. Every
// launcher takes an explicit stream, never allocates, never synchronises,
// and returns cudaGetLastError() after its launches.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// One block of logits: `rows` rows from global row `row0`, vocabulary
// columns [col0, col0 + cols) of each, stored with row stride `cols`.
// Pointers are device pointers.
struct RowParams {
  int64_t rows = 0;   // rows in this chunk
  int64_t row0 = 0;   // global index of the chunk's first row
  int64_t vocab = 0;  // V, the whole vocabulary
  int64_t col0 = 0;   // first vocabulary column given
  int64_t cols = 0;   // columns given per row (V for whole rows)
  const float* bias = nullptr;          // [V] fp32, or null
  const float* class_weight = nullptr;  // [V] fp32, or null (all 1)
  float class_weight_sum = 0.0f;        // Σ class_weight (V without)
  const int64_t* target = nullptr;      // [N], global
  int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float z_loss_scale = 0.0f;
  float softcap = 0.0f;  // 0: none
};

// Per-row results of the forward pass, indexed by global row.
struct RowOutputs {
  float* lse = nullptr;       // [N]
  float* loss = nullptr;      // [N], 0 for ignored rows; includes z-loss
  float* z_loss = nullptr;    // [N]
  int32_t* correct = nullptr; // [N], argmax == target on valid rows
};

// Forward over a chunk of whole rows of logits z [rows, V] (col0 = 0,
// cols = V; anything else is cudaErrorInvalidValue) in `dtype` (the input
// dtype; fp32 accumulation happened in the GEMM):
//   z' = softcap(z + b); lse = log Σ exp(z'); the row loss of loss_engine.h,
// all in fp32. With write_grad, also overwrites each row with the gradient
// of its loss times row_scale[row], in `dtype` (zeros for ignored rows; the
// target column's p − 1 formed in fp32). One block per row, 16-byte loads
// when V allows. Traffic: reads the chunk twice, writes it once with
// write_grad; reads it once without.
cudaError_t LaunchForwardRows(const RowParams& p, void* logits, DType dtype, bool write_grad,
                              const float* row_scale, const RowOutputs& out,
                              cudaStream_t stream);

// The gradient pass alone, from saved per-row lse (RECOMPUTE backward):
// same in-place output as LaunchForwardRows, for whole rows or a slice of
// columns of each. Reads and writes each logit once.
cudaError_t LaunchGradientRows(const RowParams& p, void* logits, DType dtype, const float* lse,
                               const float* row_scale, cudaStream_t stream);

// Whether LaunchOnePassRows takes these rows: whole rows without label
// smoothing (bias, softcap, class weights and z-loss allowed), bf16 or
// fp32, V a multiple of the 16-byte pack.
bool OnePassRowsSupported(const RowParams& p, DType dtype);

// LaunchForwardRows with write_grad, reading each logit once (deferred
// normalisation): writes u = exp(z' − m̂) (times the softcap's chain factor)
// over the logits, m̂ the maximum of each row's first 16-byte pack per
// thread, with the target element rewritten so that row_factor[row] × (the
// row) is the scaled gradient; the caller applies row_factor (dX rows after
// the dX GEMM, X rows before the dW GEMM, rows of the bias column sums).
// Sets *redo to 1 (never to 0) when a row's sum leaves the range where that
// is exact to fp32 (a logit ~44 nats over m̂, a non-finite logit, a zero
// factor beside a non-zero target term): the results are then not to be
// used and the call is to be run again with LaunchForwardRows. Same per-row
// outputs. Traffic: reads the chunk once, writes it once.
cudaError_t LaunchOnePassRows(const RowParams& p, void* logits, DType dtype,
                              const float* row_scale, const RowOutputs& out, float* row_factor,
                              int32_t* redo, cudaStream_t stream);

// dst[r, c] = factor[r] × src[r, c] over a row-major rows × cols matrix of
// `dtype`, rounded once; dst may equal src.
cudaError_t LaunchScaleRows(const void* src, void* dst, DType dtype, const float* factor,
                            int64_t rows, int64_t cols, cudaStream_t stream);

// Reduction divisor and per-row gradient scale, on the device:
//   denom = Σ_{valid rows} class_weight[t] (mean) or 1 (sum, none);
//   row_scale[i] = g_i / denom, with g_i = grad_output[0] (count 1),
//   grad_output[i] (count N) or 1 (grad_output null).
// Also writes num_valid. `denom` and `num_valid` are single device values.
cudaError_t LaunchRowScales(const int64_t* target, int64_t n, int64_t ignore_index,
                            const float* class_weight, bool mean,
                            const float* grad_output, int64_t grad_output_count,
                            float* row_scale, double* denom, int64_t* num_valid,
                            cudaStream_t stream);

// Totals over all N rows: totals[0] = Σ loss / denom (mean) or Σ loss,
// totals[1] the same for z-loss, totals[2] = Σ correct. One block, fp64
// accumulation, deterministic.
cudaError_t LaunchReduceRows(const RowOutputs& rows, int64_t n, const double* denom,
                             bool divide, double* totals, cudaStream_t stream);

// db[j] (+)= Σ_r row_weight[r]·grad[r, j] over a chunk's gradient
// (grad_dtype, leading dimension ld elements; row_weight null: all 1, else
// `rows` fp32 device values). accumulate = false overwrites db.
cudaError_t LaunchColumnSums(const void* grad, DType grad_dtype, int64_t rows,
                             int64_t vocab, int64_t ld, const float* row_weight,
                             bool accumulate, float* db, cudaStream_t stream);

// dst[i] = src[i] × scale converted from src_dtype to dst_dtype (floating
// dtypes), rounded once. dst may equal src only when the element sizes match.
cudaError_t LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                          int64_t count, float scale, cudaStream_t stream);

// dst[i] += src[i] × scale, fp32 (a gradient added into an accumulator).
cudaError_t LaunchAccumulate(const float* src, float* dst, int64_t count, float scale,
                             cudaStream_t stream);

// dst[i] = src[i]: int32 targets widened to int64.
cudaError_t LaunchWidenTargets(const int32_t* src, int64_t count, int64_t* dst,
                               cudaStream_t stream);

// *hash += an order-independent 64-bit hash of the bits of the m×n
// column-major matrix at c (leading dimension ld elements) of
// `elem_bytes`-byte elements (2 or 4): equal matrices hash equal; any
// differing element changes the hash with overwhelming probability.
cudaError_t LaunchHashMatrix(const void* c, int elem_bytes, int64_t m, int64_t n, int64_t ld,
                             unsigned long long* hash, cudaStream_t stream);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_LOSS_KERNELS_H_
