#include "kernels/cuda/loss_passes.h"

#include <algorithm>

#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/reductions.h"
#include "kernels/cuda/row_kernels.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {

bool OnePassRows(const CudaEngineOptions& options, const DeviceInputs& in) {
  return options.one_pass_rows && OnePassRowsSupported(in.Params(0, in.n), in.dtype);
}

absl::Status RowScales(const CallContext& call, const DeviceInputs& in, const float* grad_output,
                       int64_t grad_output_count, RowBuffers& rows) {
  return call.lane.Check(
      LaunchRowScales(in.target.as<const int64_t>(), in.n, in.options.ignore_index,
                      in.class_weight.bytes() > 0 ? in.class_weight.as<float>() : nullptr,
                      in.options.reduction == Reduction::kMean, grad_output, grad_output_count,
                      rows.row_scale.as<float>(), rows.denom.as<double>(),
                      rows.num_valid.as<int64_t>(), call.lane.stream()),
      "row scales");
}

bool KeepsChunkLogits(const CudaEngineOptions& options, int64_t n, int64_t v, DType dtype) {
  return options.keep_chunk_logits && n > 0 && ChunkRows(options, n, v, dtype) >= n;
}

absl::Status ChunkGradients(const CallContext& call, const DeviceInputs& in, int64_t r0,
                            int64_t count, const void* dz, const float* row_factor, bool first,
                            float* dx_c, bool want_dx, void* dw, DType dw_type, float alpha,
                            float* db) {
  const Lane& lane = call.lane;
  cudaStream_t s = lane.stream();
  const char* const dw_stage = dw_type != DType::kFloat32 ? "dW GEMM, final dtype"
                               : first                    ? "dW GEMM, fp32, beta 0"
                                                          : "dW GEMM, fp32, beta 1";
  if (row_factor != nullptr) {
    // Each row holds its gradient over its factor: the dW GEMM takes X_c's
    // rows times their factors, rounded to the input dtype, from the
    // chunk's dX rows (fp32, so large enough; the dX GEMM overwrites them
    // next), dX's rows are scaled after their GEMM, and the bias column
    // sums weigh each row by its factor.
    if (dw != nullptr) {
      FLCE_RETURN_IF_ERROR(
          lane.Check(LaunchScaleRows(in.x_row(r0), dx_c, in.dtype, row_factor + r0, count, in.h, s),
                     "scale X rows"));
      Mark(call.clock, "scale X rows");
      FLCE_RETURN_IF_ERROR(
          ChunkDwGemm(call.gemm(), in, dx_c, count, dz, first, dw, dw_type, alpha));
      Mark(call.clock, dw_stage);
    }
    if (want_dx) {
      FLCE_RETURN_IF_ERROR(ChunkDxGemm(call.gemm(), in, count, dz, dx_c));
      Mark(call.clock, "dX GEMM");
      FLCE_RETURN_IF_ERROR(
          lane.Check(LaunchScaleRows(dx_c, dx_c, DType::kFloat32, row_factor + r0, count, in.h, s),
                     "scale dX rows"));
      Mark(call.clock, "scale dX rows");
    }
  } else {
    if (want_dx) {
      FLCE_RETURN_IF_ERROR(ChunkDxGemm(call.gemm(), in, count, dz, dx_c));
      Mark(call.clock, "dX GEMM");
    }
    if (dw != nullptr) {
      FLCE_RETURN_IF_ERROR(
          ChunkDwGemm(call.gemm(), in, in.x_row(r0), count, dz, first, dw, dw_type, alpha));
      Mark(call.clock, dw_stage);
    }
  }
  if (db != nullptr && dw != nullptr) {
    FLCE_RETURN_IF_ERROR(lane.Check(
        LaunchColumnSums(dz, in.dtype, count, in.v, in.v,
                         row_factor != nullptr ? row_factor + r0 : nullptr, r0 > 0, db, s),
        "bias gradient"));
    Mark(call.clock, "bias gradient");
  }
  return absl::OkStatus();
}

// Chunks are as large as the budget allows (chunk_plan.h): every chunk after
// the first re-reads and re-writes the fp32 dW accumulator, which costs more
// than the row kernel does (measured: two half-size buffers alternating so
// the row kernels overlapped the neighbouring GEMMs ran 4-16% slower than
// one buffer; bench/RESULTS.md).
//
// kLossAndGradOnePass reads each logit once: the row kernel leaves
// unnormalised exponentials and per-row factors (ChunkGradients applies
// them).
absl::Status RunChunks(const CallContext& call, const DeviceInputs& in, Pass pass,
                       const RowBuffers& rows, const float* lse_in, float* dx, float* dw, float* db,
                       void* keep) {
  const Lane& lane = call.lane;
  cudaStream_t s = lane.stream();
  const bool grad = pass != Pass::kLoss;
  const int64_t chunk = keep != nullptr ? in.n : ChunkRows(call.options, in.n, in.v, in.dtype);
  if (keep != nullptr && !KeepsChunkLogits(call.options, in.n, in.v, in.dtype)) {
    return absl::InternalError("kept logits asked for a problem of several chunks");
  }
  const bool one_pass = pass == Pass::kLossAndGradOnePass;
  if (one_pass && !OnePassRows(call.options, in)) {
    return absl::InternalError("one-pass rows asked for rows that need two passes");
  }
  float* row_factor = one_pass ? rows.row_factor.as<float>() : nullptr;
  if (one_pass)
    FLCE_RETURN_IF_ERROR(lane.Check(cudaMemsetAsync(rows.redo.data(), 0, 4, s), "clear redo"));
  if (grad && keep == nullptr && in.n == 0) {
    FLCE_RETURN_IF_ERROR(lane.Check(cudaMemsetAsync(dw, 0, in.v * in.h * 4, s), "zero dW"));
    if (db) FLCE_RETURN_IF_ERROR(lane.Check(cudaMemsetAsync(db, 0, in.v * 4, s), "zero db"));
  }
  DeviceBuffer buffer;
  if (keep == nullptr) {
    FLCE_ASSIGN_OR_RETURN(buffer,
                          lane.Allocate(std::min(chunk, in.n) * in.v * DTypeSize(in.dtype)));
  }
  void* logits = keep != nullptr ? keep : buffer.data();
  for (int64_t r0 = 0; r0 < in.n; r0 += chunk) {
    if (call.Cancelled()) return absl::CancelledError("cancelled between chunks");
    const int64_t count = std::min(chunk, in.n - r0);
    FLCE_RETURN_IF_ERROR(ChunkLogitsGemm(call.gemm(), in, r0, count, logits));
    Mark(call.clock, "logits GEMM");
    const RowParams params = in.Params(r0, count);
    if (pass == Pass::kGradFromLse) {
      FLCE_RETURN_IF_ERROR(lane.Check(
          LaunchGradientRows(params, logits, in.dtype, lse_in, rows.row_scale.as<float>(), s),
          "gradient rows"));
    } else if (one_pass) {
      FLCE_RETURN_IF_ERROR(
          lane.Check(LaunchOnePassRows(params, logits, in.dtype, rows.row_scale.as<float>(),
                                       rows.outputs(), row_factor, rows.redo.as<int32_t>(), s),
                     "one-pass rows"));
    } else {
      FLCE_RETURN_IF_ERROR(
          lane.Check(LaunchForwardRows(params, logits, in.dtype, grad, rows.row_scale.as<float>(),
                                       rows.outputs(), s),
                     "forward rows"));
    }
    Mark(call.clock, "row kernel");
    if (!grad || keep != nullptr) continue;
    FLCE_RETURN_IF_ERROR(ChunkGradients(call, in, r0, count, logits, row_factor, r0 == 0,
                                        dx + r0 * in.h, /*want_dx=*/true, dw, DType::kFloat32, 1.0f,
                                        db));
  }
  return absl::OkStatus();
}

// Over vocabulary slices of all rows where the budget allows
// (chunk_plan.h's SliceColumns): per slice the logits GEMM, the gradient in
// place from the lse, dX += dZ_s·W_s (fp32, beta 1 after the first slice:
// N×H is small) and dW_s = dZ_sᵀ·X over every token in one GEMM, rounded
// once straight into its final dtype: no fp32 dW accumulator, no pass over
// it per chunk and none to narrow it. Else over token chunks into an fp32
// accumulator, narrowed into dw at the end.
absl::Status RecomputeGradients(const CallContext& call, const DeviceInputs& in,
                                const RowBuffers& rows, const float* lse, const void* stored,
                                float* dx, void* dw, DType wdtype, float* db) {
  const Lane& lane = call.lane;
  cudaStream_t s = lane.stream();
  const int64_t width = SliceColumns(call.options, in.n, in.v, in.dtype);
  if (width == 0) {
    if (wdtype == DType::kFloat32) {
      return RunChunks(call, in, Pass::kGradFromLse, rows, lse, dx, static_cast<float*>(dw), db);
    }
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer dw32, lane.Allocate(in.v * in.h * 4));
    FLCE_RETURN_IF_ERROR(
        RunChunks(call, in, Pass::kGradFromLse, rows, lse, dx, dw32.as<float>(), db));
    FLCE_RETURN_IF_ERROR(lane.Check(
        LaunchConvert(dw32.data(), DType::kFloat32, dw, wdtype, in.v * in.h, 1.0f, s), "convert"));
    Mark(call.clock, "narrowing dW");
    return absl::OkStatus();
  }
  const int64_t welem = DTypeSize(wdtype);
  if (in.n == 0) {
    FLCE_RETURN_IF_ERROR(lane.Check(cudaMemsetAsync(dw, 0, in.v * in.h * welem, s), "zero dW"));
    if (db) FLCE_RETURN_IF_ERROR(lane.Check(cudaMemsetAsync(db, 0, in.v * 4, s), "zero db"));
    return absl::OkStatus();
  }
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer logits, lane.Allocate(in.n * width * DTypeSize(in.dtype)));
  for (int64_t c0 = 0; c0 < in.v; c0 += width) {
    if (call.Cancelled()) return absl::CancelledError("cancelled between slices");
    const int64_t cols = std::min(width, in.v - c0);
    const RowParams params = in.Params(0, in.n, c0, cols);
    if (stored != nullptr) {
      const char* from = static_cast<const char*>(stored) + c0 * DTypeSize(in.dtype);
      FLCE_RETURN_IF_ERROR(lane.Check(
          LaunchGradientRowsFrom(params, from, in.v, logits.data(), in.dtype, lse,
                                 rows.row_scale.as<float>(), s),
          "gradient rows"));
    } else {
      FLCE_RETURN_IF_ERROR(SliceLogitsGemm(call.gemm(), in, c0, cols, logits.data()));
      Mark(call.clock, "logits GEMM");
      FLCE_RETURN_IF_ERROR(lane.Check(
          LaunchGradientRows(params, logits.data(), in.dtype, lse, rows.row_scale.as<float>(), s),
          "gradient rows"));
    }
    Mark(call.clock, "row kernel");
    FLCE_RETURN_IF_ERROR(SliceDxGemm(call.gemm(), in, c0, cols, logits.data(), c0 == 0, dx));
    Mark(call.clock, "dX GEMM");
    FLCE_RETURN_IF_ERROR(SliceDwGemm(call.gemm(), in, cols, logits.data(),
                                     static_cast<char*>(dw) + c0 * in.h * welem, wdtype));
    Mark(call.clock, "dW GEMM, final dtype");
    if (db) {
      FLCE_RETURN_IF_ERROR(lane.Check(
          LaunchColumnSums(logits.data(), in.dtype, in.n, cols, cols, nullptr, false, db + c0, s),
          "bias gradient"));
      Mark(call.clock, "bias gradient");
    }
  }
  return absl::OkStatus();
}

absl::Status ShardStatistics(const CallContext& call, const DeviceInputs& in,
                             const ShardRowOutputs& out, void* keep) {
  const Lane& lane = call.lane;
  const int64_t chunk = keep != nullptr ? std::max<int64_t>(in.n, 1)
                                        : ChunkRows(call.options, in.n, in.v, in.dtype);
  DeviceBuffer buffer;
  if (keep == nullptr) {
    FLCE_ASSIGN_OR_RETURN(buffer,
                          lane.Allocate(std::min(chunk, in.n) * in.v * DTypeSize(in.dtype)));
  }
  for (int64_t r0 = 0; r0 < in.n; r0 += chunk) {
    if (call.Cancelled()) return absl::CancelledError("cancelled between chunks");
    const int64_t count = std::min(chunk, in.n - r0);
    void* logits = keep != nullptr
                       ? static_cast<char*>(keep) + r0 * in.v * DTypeSize(in.dtype)
                       : buffer.data();
    FLCE_RETURN_IF_ERROR(ChunkLogitsGemm(call.gemm(), in, r0, count, logits));
    Mark(call.clock, "logits GEMM");
    FLCE_RETURN_IF_ERROR(lane.Check(
        LaunchShardStats(in.Params(r0, count), logits, in.dtype, out, lane.stream()),
        "shard statistics"));
    Mark(call.clock, "row kernel");
  }
  return absl::OkStatus();
}

}  // namespace internal_cuda
}  // namespace flce
