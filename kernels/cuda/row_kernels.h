#ifndef FLCE_KERNELS_CUDA_ROW_KERNELS_H_
#define FLCE_KERNELS_CUDA_ROW_KERNELS_H_

// The fused row kernels over a chunk of logits: softmax statistics, the
// row losses and the gradient written in place (two-pass and one-pass).
// Every launcher takes an explicit stream, never allocates, never
// synchronises, and returns cudaGetLastError() after its launches. Plain C++
// and the CUDA runtime's types only (no Abseil, no gRPC), so nvcc stays simple.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// One block of logits: `rows` rows from global row `row0`, vocabulary
// columns [col0, col0 + cols) of each, stored with row stride `cols`.
// Pointers are device pointers.
struct RowParams {
  int64_t rows = 0;                     // rows in this chunk
  int64_t row0 = 0;                     // global index of the chunk's first row
  int64_t vocab = 0;                    // V, the whole vocabulary
  int64_t col0 = 0;                     // first vocabulary column given
  int64_t cols = 0;                     // columns given per row (V for whole rows)
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
  float* lse = nullptr;        // [N]
  float* loss = nullptr;       // [N], 0 for ignored rows; includes z-loss
  float* z_loss = nullptr;     // [N]
  int32_t* correct = nullptr;  // [N], argmax == target on valid rows
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
                              const float* row_scale, const RowOutputs& out, cudaStream_t stream);

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
cudaError_t LaunchOnePassRows(const RowParams& p, void* logits, DType dtype, const float* row_scale,
                              const RowOutputs& out, float* row_factor, int32_t* redo,
                              cudaStream_t stream);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_ROW_KERNELS_H_
