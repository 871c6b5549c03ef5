#ifndef FLCE_KERNELS_CUDA_LOSS_PASSES_H_
#define FLCE_KERNELS_CUDA_LOSS_PASSES_H_

// The CUDA engine's passes over the logits, all queued on one lane without
// host synchronisation: the row scales, the token-chunk loop (loss; loss
// and gradients in two passes or one; gradients from a saved lse) and the
// RECOMPUTE backward over vocabulary slices. device_pipeline.h strings them
// into Forward and Backward.

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_engine_options.h"
#include "kernels/cuda/device_problem.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lane_pool.h"
#include "kernels/cuda/loss_gemms.h"
#include "kernels/cuda/stage_clock.h"
#include "kernels/loss_engine.h"

namespace flce {
namespace internal_cuda {

// What one call works with: the engine's options and GEMM runner, the
// call's lane and cancellation, and (benchmarks) a clock for its stages.
struct CallContext {
  const CudaEngineOptions& options;
  GemmRunner& gemms;
  const Lane& lane;
  const CancelFn& cancelled;  // may be empty
  StageClock* clock = nullptr;

  GemmLane gemm() const { return {gemms, lane}; }
  bool Cancelled() const { return cancelled && cancelled(); }
};

// What RunChunks computes: the loss; the loss and the gradients with the
// two-pass row kernel (LaunchForwardRows) or the one-pass one
// (LaunchOnePassRows, where OnePassRows allows); the gradients from a
// saved lse.
enum class Pass { kLoss, kLossAndGrad, kLossAndGradOnePass, kGradFromLse };

// Whether STORE_GRADS Forward's chunks may read each logit once
// (CudaEngineOptions::one_pass_rows and LaunchOnePassRows's conditions).
bool OnePassRows(const CudaEngineOptions& options, const DeviceInputs& in);

// Row scales and the reduction divisor into `rows`; grad_output is a device
// pointer to `grad_output_count` values (1 or N), or null for 1.
absl::Status RowScales(const CallContext& call, const DeviceInputs& in, const float* grad_output,
                       int64_t grad_output_count, RowBuffers& rows);

// Whether STORE_GRADS keeps the chunk's logits instead of gradients
// (CudaEngineOptions::keep_chunk_logits, and all of the problem's rows fit
// one token chunk: chunk_plan.h).
bool KeepsChunkLogits(const CudaEngineOptions& options, int64_t n, int64_t v, DType dtype);

// The token-chunk loop. dx, dw, db are fp32 device outputs that the
// gradient passes overwrite (db may be null; all null for kLoss). lse_in:
// the saved lse, for kGradFromLse. With kLossAndGradOnePass, rows.redo
// says afterwards whether the results are void and the call must run again
// with kLossAndGrad. With `keep`, a [N, V] buffer in the input dtype
// (REQUIRES KeepsChunkLogits), every row goes through its logits GEMM and row
// kernel into it and no gradient GEMM runs (dx, dw, db unused): the
// gradient in its logit form stays there for ChunkGradients.
absl::Status RunChunks(const CallContext& call, const DeviceInputs& in, Pass pass,
                       const RowBuffers& rows, const float* lse_in, float* dx, float* dw, float* db,
                       void* keep = nullptr);

// The gradient GEMMs of rows [r0, r0 + count) from dz [count, V], their
// gradient in the logit form a row kernel left (row_factor: the one-pass
// kernel's per-row factors, which each row of dz is to be multiplied by;
// null: dz is the gradient). dX_c (fp32 [count, H], overwritten) when
// `want_dx`; dW (`dw_type`, alpha times the gradient; overwritten when
// `first`, else added to) and db (fp32, not scaled; overwritten for the
// first rows, r0 == 0, else added to; may be null) unless dw is null. The one-pass dW GEMM reads
// X's scaled rows from dx_c's memory, so dx_c is REQUIRED with row_factor and dw even when dX is
// not wanted.
absl::Status ChunkGradients(const CallContext& call, const DeviceInputs& in, int64_t r0,
                            int64_t count, const void* dz, const float* row_factor, bool first,
                            float* dx_c, bool want_dx, void* dw, DType dw_type, float alpha,
                            float* db);

// The RECOMPUTE backward: dX (fp32 [N, H]), dW ([V, H] in `wdtype`, device
// memory) and db (fp32 [V], or null) for the row scales in `rows` and the
// saved `lse` (a shard's: the whole vocabulary's). `stored`: a shard's
// logits [N, V] in the input dtype as its Forward's GEMM gave them, or
// null; where the budget allows vocabulary slices, each slice's gradient
// is then made from them (left as they were) instead of a logits GEMM.
absl::Status RecomputeGradients(const CallContext& call, const DeviceInputs& in,
                                const RowBuffers& rows, const float* lse, const void* stored,
                                float* dx, void* dw, DType wdtype, float* db);

// A shard's statistics (ShardRowOutputs, [N] each) over token chunks: the
// logits GEMM of each chunk into `logits` (the chunk buffer, or with
// `keep` the shard's [N, V] buffer that Backward reads again, all rows in
// one GEMM), then the statistics kernel.
absl::Status ShardStatistics(const CallContext& call, const DeviceInputs& in,
                             const ShardRowOutputs& out, void* keep);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_LOSS_PASSES_H_
