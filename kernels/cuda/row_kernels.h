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

// One block of logits: `rows` rows from global row `row0`, columns
// [col0, col0 + cols) of the weight's `vocab` rows, stored with row stride
// `cols`. The weight's row j is the vocabulary id first + j of a vocabulary
// of full_vocab ids (first 0 and full_vocab = vocab unless the weight is a
// vocabulary shard, loss_engine.h's VocabShard): bias is the weight's,
// class weights and targets the whole vocabulary's. Pointers are device
// pointers.
struct RowParams {
  int64_t rows = 0;                     // rows in this chunk
  int64_t row0 = 0;                     // global index of the chunk's first row
  int64_t vocab = 0;                    // the weight's rows (V, or a shard's V_s)
  int64_t col0 = 0;                     // first column given
  int64_t cols = 0;                     // columns given per row (vocab for whole rows)
  int64_t first = 0;                    // the vocabulary id of column 0
  int64_t full_vocab = 0;               // the whole vocabulary (ε/V's V)
  const float* bias = nullptr;          // [vocab] fp32, or null
  const float* class_weight = nullptr;  // [full_vocab] fp32, or null (all 1)
  float class_weight_sum = 0.0f;        // Σ class_weight (full_vocab without)
  const int64_t* target = nullptr;      // [N], vocabulary ids, global rows
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
// cols = V, not a shard; anything else is cudaErrorInvalidValue) in `dtype` (the input
// dtype; fp32 accumulation happened in the GEMM):
//   z' = softcap(z + b); lse = log Σ exp(z'); the row loss of loss_engine.h,
// all in fp32. With write_grad, also overwrites each row with the gradient
// of its loss times row_scale[row], in `dtype` (zeros for ignored rows; the
// target column's p − 1 formed in fp32). One block per row, 16-byte loads
// when V allows. Traffic: reads the chunk twice, writes it once with
// write_grad; reads it once without.
cudaError_t LaunchForwardRows(const RowParams& p, void* logits, DType dtype, bool write_grad,
                              const float* row_scale, const RowOutputs& out, cudaStream_t stream);

// The gradient pass alone, from per-row lse (RECOMPUTE backward; a
// shard's backward with the whole vocabulary's lse): same in-place output
// as LaunchForwardRows, for whole rows or a slice of columns of each.
// Reads and writes each logit once.
cudaError_t LaunchGradientRows(const RowParams& p, void* logits, DType dtype, const float* lse,
                               const float* row_scale, cudaStream_t stream);

// LaunchGradientRows reading the logits from `src` (row r's given columns
// at src + r·src_stride elements) and writing the gradient to `logits`
// (row stride cols): a shard's stored logits left as they were.
cudaError_t LaunchGradientRowsFrom(const RowParams& p, const void* src, int64_t src_stride,
                                   void* logits, DType dtype, const float* lse,
                                   const float* row_scale, cudaStream_t stream);

// Whether LaunchGradientFactors takes these rows: no label smoothing,
// softcap or bias (class weights and z-loss allowed).
bool FusedGradientSupported(const RowParams& p);

// The per-row factors of the gradient that the fused dX GEMM forms from
// the logits as it reads them (LogitGradient, logit_gradient.h), for a
// chunk of logits: rows of the given columns at logits + r·src_stride
// elements (src_stride ≥ cols, as LaunchGradientRowsFrom reads them), row r
// of the chunk being global row row0 + r. coef[r] = scale·(w_t + 2·s·lse),
// column[r] the target's column among the given ones (−1 when it is not
// one of them, LogitGradient::kIgnoredRow for an ignored row) and target[r]
// = scale·(w_t·(p_t − 1) + 2·s·lse·p_t), p_t from the target's logit;
// indexed by the chunk's row, lse and row_scale by global row. Without class weights, the G the fused GEMM forms is what
// LaunchGradientRows writes, bit for bit; with them, the same formula
// rounded in the other kernels' order. REQUIRES FusedGradientSupported(p),
// else cudaErrorInvalidValue.
cudaError_t LaunchGradientFactors(const RowParams& p, const void* logits, int64_t src_stride,
                                  DType dtype, const float* lse, const float* row_scale,
                                  float* coef, int32_t* column, float* target,
                                  cudaStream_t stream);

// A vocabulary shard's per-row statistics (loss_engine.h's ShardStats),
// indexed by global row.
struct ShardRowOutputs {
  float* max = nullptr;             // m_s = max z' (NaN where a z' is NaN)
  float* sum_exp = nullptr;         // S_s = Σ exp(z' − m_s)
  float* target_logit = nullptr;    // z'_t where t is the shard's, else 0
  float* weighted_sum = nullptr;    // Σ w_j z'_j, with label smoothing; else may be null
  int64_t* argmax = nullptr;        // the vocabulary id of the first largest z'
};

// A shard's statistics over a chunk of whole rows of logits [rows, vocab]
// (col0 = 0, cols = vocab): z' = softcap(z + b) in fp32, as
// LaunchForwardRows takes them. Reads the chunk once; leaves it as it was.
cudaError_t LaunchShardStats(const RowParams& p, const void* logits, DType dtype,
                             const ShardRowOutputs& out, cudaStream_t stream);

// Whether LaunchOnePassRows takes these rows: whole rows of a whole
// vocabulary (not a shard) without label smoothing (bias, softcap, class
// weights and z-loss allowed), bf16 or fp32, V a multiple of the 16-byte
// pack.
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
