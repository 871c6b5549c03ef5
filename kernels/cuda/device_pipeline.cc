#include "kernels/cuda/device_pipeline.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/reductions.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {
namespace {

// Accumulating destinations: dW and db only, in device memory.
absl::Status CheckAccumulating(const BackwardSpec& spec) {
  if (spec.grad_hidden_to && spec.grad_hidden_to->accumulate) {
    return absl::InvalidArgumentError("grad_hidden_out: dX is never accumulated");
  }
  for (const auto* to : {&spec.grad_weight_to, &spec.grad_bias_to}) {
    if (*to && (*to)->accumulate && (*to)->space != MemorySpace::kCuda) {
      return absl::InvalidArgumentError(
          "an accumulating gradient destination must be device memory");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Gradients> BackwardStored(const CallContext& call, StoredGradients& stored,
                                         const BackwardSpec& spec, float scale) {
  const DType dtype = spec.hidden_dtype(stored.dtype);
  const DType wdtype = spec.weight_dtype(stored.dtype);
  Gradients out;
  if (!spec.weight_grads_only) {
    FLCE_ASSIGN_OR_RETURN(
        out.grad_hidden,
        DeliverGradient(call.lane, stored.dx.data(), DType::kFloat32, {stored.n, stored.h}, dtype,
                        scale, spec.grad_hidden_to, spec.grad_hidden_landed));
    Mark(call.clock, "narrowing dX");
  }
  if (spec.hidden_grad_only) return out;
  FLCE_ASSIGN_OR_RETURN(out.grad_weight,
                        DeliverGradient(call.lane, stored.dw.data(), DType::kFloat32,
                                        {stored.v, stored.h}, wdtype, scale, spec.grad_weight_to));
  Mark(call.clock, "narrowing dW");
  if (stored.db.bytes() > 0) {
    FLCE_ASSIGN_OR_RETURN(out.grad_bias,
                          DeliverGradient(call.lane, stored.db.data(), DType::kFloat32, {stored.v},
                                          wdtype, scale, spec.grad_bias_to));
    Mark(call.clock, "narrowing db");
  }
  return out;
}

// Delivers dW, made at `dw_out` in `wdtype` (a device destination's own
// memory, or `dw` when `add_dw`: added from there into an accumulating
// destination), and db (fp32 in `db`, if any, narrowed with `db_scale`)
// where `spec` says, into `out`.
absl::Status DeliverWeightGradients(const CallContext& call, const DeviceInputs& in,
                                    const DeviceBuffer& dw, const void* dw_out, bool add_dw,
                                    DType wdtype, const DeviceBuffer& db, float db_scale,
                                    const BackwardSpec& spec, Gradients& out) {
  const Lane& lane = call.lane;
  if (add_dw) {
    FLCE_ASSIGN_OR_RETURN(out.grad_weight, DeliverGradient(lane, dw.data(), wdtype, {in.v, in.h},
                                                           wdtype, 1.0f, spec.grad_weight_to));
  } else {
    FLCE_ASSIGN_OR_RETURN(out.grad_weight, DeliverFinalGradient(lane, dw_out, {in.v, in.h}, wdtype,
                                                                spec.grad_weight_to));
  }
  if (db.bytes() > 0) {
    FLCE_ASSIGN_OR_RETURN(out.grad_bias, DeliverGradient(lane, db.data(), DType::kFloat32, {in.v},
                                                         wdtype, db_scale, spec.grad_bias_to));
    Mark(call.clock, "narrowing db");
  }
  return absl::OkStatus();
}

// STORE_GRADS of one chunk: the gradient GEMMs from the kept logits, with
// grad_output `scale` folded into dW's GEMM (its one rounding, straight
// into a device destination that is not accumulated) and into dX's and
// db's narrowing. An fp32 accumulator on the device (a registered weight's
// sum) takes dW straight from its GEMM too (beta 1), the call's last GEMM,
// after dX is delivered: a call failing before it leaves the sum as it
// was.
absl::StatusOr<Gradients> BackwardKept(const CallContext& call, const KeptLogits& kept,
                                       const BackwardSpec& spec, float scale) {
  const Lane& lane = call.lane;
  const DeviceInputs& in = *kept.inputs;
  const DType dtype = spec.hidden_dtype(in.dtype);
  const DType wdtype = spec.weight_dtype(in.dtype);
  const bool want_dx = !spec.weight_grads_only;
  const bool want_dw = !spec.hidden_grad_only;
  const float* factor = kept.one_pass ? kept.row_factor.as<float>() : nullptr;
  DeviceBuffer dx;
  if (want_dx || (want_dw && factor != nullptr)) {
    FLCE_ASSIGN_OR_RETURN(dx, lane.Allocate(in.n * in.h * 4));
  }
  // Another accumulating destination (in the input dtype, added to as
  // autograd adds) gets dW added once all of it is made.
  const bool dw_in_place = spec.grad_weight_to &&
                           spec.grad_weight_to->space == MemorySpace::kCuda &&
                           !spec.grad_weight_to->accumulate;
  const bool dw_adds = want_dw && spec.grad_weight_to &&
                       spec.grad_weight_to->space == MemorySpace::kCuda &&
                       spec.grad_weight_to->accumulate && wdtype == DType::kFloat32;
  DeviceBuffer dw, db;
  if (want_dw && !dw_in_place && !dw_adds) {
    FLCE_ASSIGN_OR_RETURN(dw, lane.Allocate(in.v * in.h * DTypeSize(wdtype)));
  }
  void* dw_out = !want_dw                 ? nullptr
                 : dw_in_place || dw_adds ? spec.grad_weight_to->data
                                          : dw.data();
  if (want_dw && in.bias.bytes() > 0) {
    FLCE_ASSIGN_OR_RETURN(db, lane.Allocate(in.v * 4));
  }
  float* const dx_f = dx.bytes() > 0 ? dx.as<float>() : nullptr;
  float* const db_f = db.bytes() > 0 ? db.as<float>() : nullptr;
  // dX first (delivered, its fp32 rows then free for the one-pass dW
  // GEMM's scaled X), dW last.
  Gradients out;
  if (want_dx) {
    FLCE_RETURN_IF_ERROR(ChunkGradients(call, in, 0, in.n, kept.logits.data(), factor,
                                        /*first=*/true, dx_f, /*want_dx=*/true, nullptr, wdtype,
                                        scale, nullptr));
    FLCE_ASSIGN_OR_RETURN(out.grad_hidden,
                          DeliverGradient(lane, dx.data(), DType::kFloat32, {in.n, in.h}, dtype,
                                          scale, spec.grad_hidden_to, spec.grad_hidden_landed));
    Mark(call.clock, "narrowing dX");
  }
  if (!want_dw) return out;
  FLCE_RETURN_IF_ERROR(ChunkGradients(call, in, 0, in.n, kept.logits.data(), factor,
                                      /*first=*/!dw_adds, dx_f, /*want_dx=*/false, dw_out, wdtype,
                                      scale, db_f));
  const bool add_dw = spec.grad_weight_to && spec.grad_weight_to->accumulate && !dw_adds;
  FLCE_RETURN_IF_ERROR(
      DeliverWeightGradients(call, in, dw, dw_out, add_dw, wdtype, db, scale, spec, out));
  return out;
}

// The gradients from per-row lse on the device: RECOMPUTE's saved lse, or
// the whole vocabulary's for a shard (whose stored logits, if any, stand in
// for the logits GEMM). A shard's dX gets spec.grad_hidden_addend added in
// fp32 before it is rounded.
absl::StatusOr<Gradients> BackwardFromLse(const CallContext& call, const DeviceInputs& in,
                                          const float* lse, const void* stored,
                                          const BackwardSpec& spec, const std::vector<float>& g) {
  const Lane& lane = call.lane;
  FLCE_ASSIGN_OR_RETURN(RowBuffers rows, AllocateRows(lane, in.n));
  DeviceBuffer g_device;
  if (!g.empty()) {
    const int64_t bytes = static_cast<int64_t>(g.size()) * 4;
    FLCE_ASSIGN_OR_RETURN(g_device, lane.Allocate(bytes));
    // `g` outlives the copy: BackwardOnDevice waits before it returns.
    FLCE_RETURN_IF_ERROR(lane.Check(
        cudaMemcpyAsync(g_device.data(), g.data(), bytes, cudaMemcpyHostToDevice, lane.stream()),
        "upload grad_output"));
  }
  FLCE_RETURN_IF_ERROR(RowScales(call, in, g.empty() ? nullptr : g_device.as<float>(),
                                 static_cast<int64_t>(g.size()), rows));
  Mark(call.clock, "row scales and reductions");
  const DType dtype = spec.hidden_dtype(in.dtype);
  const DType wdtype = spec.weight_dtype(in.dtype);
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer dx, lane.Allocate(in.n * in.h * 4));
  // dW is made in its final dtype: straight into the caller's device
  // memory, or into a buffer that is delivered from. An accumulating
  // destination gets dW added only once all of it is made (a cancelled
  // call leaves the accumulator as it was).
  const bool dw_in_place = spec.grad_weight_to &&
                           spec.grad_weight_to->space == MemorySpace::kCuda &&
                           !spec.grad_weight_to->accumulate;
  DeviceBuffer dw;
  if (!dw_in_place) {
    FLCE_ASSIGN_OR_RETURN(dw, lane.Allocate(in.v * in.h * DTypeSize(wdtype)));
  }
  void* dw_out = dw_in_place ? spec.grad_weight_to->data : dw.data();
  DeviceBuffer db;
  if (in.bias.bytes() > 0) {
    FLCE_ASSIGN_OR_RETURN(db, lane.Allocate(in.v * 4));
  }
  FLCE_RETURN_IF_ERROR(RecomputeGradients(call, in, rows, lse, stored, dx.as<float>(), dw_out,
                                          wdtype, db.bytes() > 0 ? db.as<float>() : nullptr));
  if (spec.grad_hidden_addend && !spec.weight_grads_only && in.n * in.h > 0) {
    if (spec.grad_hidden_addend_ready) FLCE_RETURN_IF_ERROR(spec.grad_hidden_addend_ready());
    FLCE_RETURN_IF_ERROR(lane.Check(LaunchAccumulate(spec.grad_hidden_addend->data,
                                                     DType::kFloat32, dx.data(), DType::kFloat32,
                                                     in.n * in.h, 1.0f, lane.stream()),
                                    "add grad_hidden_addend"));
  }
  // Computed together; only what was asked for is delivered.
  Gradients out;
  if (!spec.weight_grads_only) {
    FLCE_ASSIGN_OR_RETURN(out.grad_hidden,
                          DeliverGradient(lane, dx.data(), DType::kFloat32, {in.n, in.h}, dtype,
                                          1.0f, spec.grad_hidden_to, spec.grad_hidden_landed));
    Mark(call.clock, "narrowing dX");
  }
  if (spec.hidden_grad_only) return out;
  const bool add_dw = spec.grad_weight_to && spec.grad_weight_to->accumulate;
  FLCE_RETURN_IF_ERROR(
      DeliverWeightGradients(call, in, dw, dw_out, add_dw, wdtype, db, 1.0f, spec, out));
  return out;
}

// A shard's Backward: the whole vocabulary's lse (host memory) uploaded,
// then the gradients from it.
absl::StatusOr<Gradients> BackwardShard(const CallContext& call, ShardState& shard,
                                        const BackwardSpec& spec, const std::vector<float>& g) {
  const DeviceInputs& in = *shard.inputs;
  if (!spec.global_lse) {
    return absl::InvalidArgumentError("global_lse: required by a vocabulary shard's session");
  }
  const TensorView& lse = *spec.global_lse;
  if (lse.dtype != DType::kFloat32 || lse.space != MemorySpace::kHost ||
      lse.num_elements() != in.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_lse: must be fp32 [", in.n, "] in host memory"));
  }
  if (spec.grad_hidden_addend) {
    const TensorView& add = *spec.grad_hidden_addend;
    if (add.dtype != DType::kFloat32 || add.space != MemorySpace::kCuda ||
        add.num_elements() != in.n * in.h) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_hidden_addend: must be fp32 [", in.n, ", ", in.h, "] in the engine's device memory"));
    }
  }
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer lse_device, call.lane.Allocate(in.n * 4));
  if (in.n > 0) {
    // The host view outlives the copy: BackwardOnDevice waits before it returns.
    FLCE_RETURN_IF_ERROR(call.lane.Check(cudaMemcpyAsync(lse_device.data(), lse.data, in.n * 4,
                                                         cudaMemcpyHostToDevice,
                                                         call.lane.stream()),
                                         "upload global_lse"));
  }
  return BackwardFromLse(call, in, lse_device.as<float>(),
                         shard.logits.bytes() > 0 ? shard.logits.data() : nullptr, spec, g);
}

// A shard's Forward: its statistics (every row's, downloaded) and, with
// need_backward, its state.
absl::StatusOr<DeviceForward> ShardForwardOnDevice(const CallContext& call,
                                                   std::shared_ptr<const DeviceInputs> in_ptr,
                                                   const ForwardSpec& spec) {
  const Lane& lane = call.lane;
  cudaStream_t s = lane.stream();
  const DeviceInputs& in = *in_ptr;
  const int64_t n = in.n;
  const bool smoothing = in.options.label_smoothing > 0.0f;
  FLCE_ASSIGN_OR_RETURN(RowBuffers rows, AllocateRows(lane, n));
  FLCE_RETURN_IF_ERROR(RowScales(call, in, nullptr, 0, rows));  // for the valid rows' count
  // argmax (int64) first, then max, sum_exp, target_logit, weighted_sum.
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer stats, lane.Allocate(n * (8 + 4 * 4)));
  ShardRowOutputs out;
  out.argmax = stats.as<int64_t>();
  float* floats = reinterpret_cast<float*>(out.argmax + n);
  out.max = floats;
  out.sum_exp = floats + n;
  out.target_logit = floats + 2 * n;
  out.weighted_sum = smoothing ? floats + 3 * n : nullptr;
  std::unique_ptr<ShardState> state;
  if (spec.need_backward) {
    state = std::make_unique<ShardState>();
    if (spec.mode == BackwardMode::kStoreGrads) {
      FLCE_ASSIGN_OR_RETURN(state->logits, lane.Allocate(n * in.v * DTypeSize(in.dtype)));
    }
  }
  FLCE_RETURN_IF_ERROR(
      ShardStatistics(call, in, out, state && state->logits.bytes() > 0 ? state->logits.data()
                                                                        : nullptr));
  DeviceForward result;
  ShardStats host;
  host.max = HostTensor(DType::kFloat32, {n});
  host.sum_exp = HostTensor(DType::kFloat32, {n});
  host.target_logit = HostTensor(DType::kFloat32, {n});
  host.argmax = HostTensor(DType::kInt64, {n});
  if (smoothing) host.weighted_logit_sum = HostTensor(DType::kFloat32, {n});
  int64_t num_valid = 0;
  auto download = [&](const void* src, HostTensor& dst) -> absl::Status {
    if (n == 0) return absl::OkStatus();
    return lane.Check(cudaMemcpyAsync(&dst.data[0], src, dst.data.size(), cudaMemcpyDeviceToHost, s),
                      "download shard statistics");
  };
  FLCE_RETURN_IF_ERROR(download(out.argmax, host.argmax));
  FLCE_RETURN_IF_ERROR(download(out.max, host.max));
  FLCE_RETURN_IF_ERROR(download(out.sum_exp, host.sum_exp));
  FLCE_RETURN_IF_ERROR(download(out.target_logit, host.target_logit));
  if (smoothing) FLCE_RETURN_IF_ERROR(download(out.weighted_sum, *host.weighted_logit_sum));
  FLCE_RETURN_IF_ERROR(
      lane.Check(cudaMemcpyAsync(&num_valid, rows.num_valid.data(), 8, cudaMemcpyDeviceToHost, s),
                 "download totals"));
  FLCE_RETURN_IF_ERROR(lane.Synchronize("Forward"));
  result.result.num_valid = num_valid;
  result.result.shard_stats = std::move(host);
  if (state) {
    state->inputs = std::move(in_ptr);
    result.result.saved = std::move(state);
  }
  return result;
}

}  // namespace

int64_t SavedStateBytes(const CudaEngineOptions& options, const LossProblem& p, BackwardMode mode) {
  const int64_t n = p.rows(), h = p.hidden_size(), v = p.vocab();
  if (p.shard) {
    return DeviceInputBytes(p) +
           (mode == BackwardMode::kStoreGrads ? n * v * DTypeSize(p.hidden.dtype) : 0);
  }
  if (mode == BackwardMode::kStoreGrads && KeepsChunkLogits(options, n, v, p.hidden.dtype)) {
    return DeviceInputBytes(p) + n * v * DTypeSize(p.hidden.dtype) + n * 4;
  }
  if (mode == BackwardMode::kStoreGrads) {
    return (n * h + v * h + (p.bias ? v : 0)) * int64_t{4};
  }
  return DeviceInputBytes(p) + n * 4;  // the inputs and the lse
}

absl::StatusOr<DeviceForward> ForwardOnDevice(const CallContext& call,
                                              std::shared_ptr<const DeviceInputs> in_ptr,
                                              const ForwardSpec& spec) {
  const Lane& lane = call.lane;
  cudaStream_t s = lane.stream();
  if (in_ptr->shard) return ShardForwardOnDevice(call, std::move(in_ptr), spec);
  const DeviceInputs& in = *in_ptr;
  const int64_t n = in.n;
  const bool store = spec.need_backward && spec.mode == BackwardMode::kStoreGrads;
  if (store && in.options.reduction == Reduction::kNone) {
    return absl::InternalError("STORE_GRADS with reduction none");
  }
  FLCE_ASSIGN_OR_RETURN(RowBuffers rows, AllocateRows(lane, n));
  FLCE_RETURN_IF_ERROR(RowScales(call, in, nullptr, 0, rows));
  Mark(call.clock, "row scales and reductions");
  std::unique_ptr<StoredGradients> grads;
  std::unique_ptr<KeptLogits> kept;
  if (store && KeepsChunkLogits(call.options, n, in.v, in.dtype)) {
    kept = std::make_unique<KeptLogits>();
    FLCE_ASSIGN_OR_RETURN(kept->logits, lane.Allocate(n * in.v * DTypeSize(in.dtype)));
  } else if (store) {
    grads = std::make_unique<StoredGradients>();
    grads->dtype = in.dtype;
    grads->n = n;
    grads->h = in.h;
    grads->v = in.v;
    FLCE_ASSIGN_OR_RETURN(grads->dx, lane.Allocate(n * in.h * 4));
    FLCE_ASSIGN_OR_RETURN(grads->dw, lane.Allocate(in.v * in.h * 4));
    if (in.bias.bytes() > 0) {
      FLCE_ASSIGN_OR_RETURN(grads->db, lane.Allocate(in.v * 4));
    }
  }
  const bool divide = in.options.reduction == Reduction::kMean;
  double totals[3];
  int64_t num_valid = 0;
  int32_t redo = 0;
  DeviceForward out;
  ForwardResult& result = out.result;
  // The chunks, the totals and the per-row results the spec asks for,
  // downloaded; waits for them.
  auto run = [&](Pass pass) -> absl::Status {
    FLCE_RETURN_IF_ERROR(RunChunks(call, in, pass, rows, nullptr,
                                   grads ? grads->dx.as<float>() : nullptr,
                                   grads ? grads->dw.as<float>() : nullptr,
                                   grads && grads->db.bytes() > 0 ? grads->db.as<float>() : nullptr,
                                   kept ? kept->logits.data() : nullptr));
    FLCE_RETURN_IF_ERROR(lane.Check(LaunchReduceRows(rows.outputs(), n, rows.denom.as<double>(),
                                                     divide, rows.totals.as<double>(), s),
                                    "reduce rows"));
    Mark(call.clock, "row scales and reductions");
    FLCE_RETURN_IF_ERROR(lane.Check(
        cudaMemcpyAsync(totals, rows.totals.data(), sizeof(totals), cudaMemcpyDeviceToHost, s),
        "download totals"));
    FLCE_RETURN_IF_ERROR(
        lane.Check(cudaMemcpyAsync(&num_valid, rows.num_valid.data(), 8, cudaMemcpyDeviceToHost, s),
                   "download totals"));
    if (pass == Pass::kLossAndGradOnePass) {
      FLCE_RETURN_IF_ERROR(lane.Check(
          cudaMemcpyAsync(&redo, rows.redo.data(), 4, cudaMemcpyDeviceToHost, s), "redo"));
    }
    auto download_rows = [&](const DeviceBuffer& src, HostTensor& dst) -> absl::Status {
      dst = HostTensor(DType::kFloat32, {n});
      if (n == 0) return absl::OkStatus();
      return lane.Check(cudaMemcpyAsync(&dst.data[0], src.data(), n * 4, cudaMemcpyDeviceToHost, s),
                        "download rows");
    };
    if (in.options.reduction == Reduction::kNone) {
      FLCE_RETURN_IF_ERROR(download_rows(rows.loss, result.loss));
      FLCE_RETURN_IF_ERROR(download_rows(rows.z_loss, result.z_loss));
    }
    if (spec.want_lse) {
      result.lse.emplace();
      FLCE_RETURN_IF_ERROR(download_rows(rows.lse, *result.lse));
    }
    if (spec.want_per_row_loss) {
      result.per_row_loss.emplace();
      FLCE_RETURN_IF_ERROR(download_rows(rows.loss, *result.per_row_loss));
    }
    return lane.Synchronize("Forward");
  };
  const Pass first = !store                          ? Pass::kLoss
                     : OnePassRows(call.options, in) ? Pass::kLossAndGradOnePass
                                                     : Pass::kLossAndGrad;
  FLCE_RETURN_IF_ERROR(run(first));
  if (redo != 0) {
    // A row out of the one-pass kernel's range: every result again with
    // two passes (they overwrite all of them).
    out.reran = true;
    FLCE_RETURN_IF_ERROR(run(Pass::kLossAndGrad));
  }
  if (in.options.reduction != Reduction::kNone) {
    result.loss = HostTensor(DType::kFloat32, {});
    result.z_loss = HostTensor(DType::kFloat32, {});
    result.loss.mutable_data<float>()[0] = static_cast<float>(totals[0]);
    result.z_loss.mutable_data<float>()[0] = static_cast<float>(totals[1]);
  }
  result.num_valid = num_valid;
  result.num_correct = static_cast<int64_t>(totals[2]);
  if (kept) {
    kept->one_pass = first == Pass::kLossAndGradOnePass && !out.reran;
    kept->row_factor = std::move(rows.row_factor);
    kept->inputs = std::move(in_ptr);
    result.saved = std::move(kept);
  } else if (store) {
    result.saved = std::move(grads);
  } else if (spec.need_backward) {
    auto saved = std::make_unique<RecomputeState>();
    saved->lse = std::move(rows.lse);
    saved->inputs = std::move(in_ptr);
    result.saved = std::move(saved);
  }
  return out;
}

absl::StatusOr<Gradients> BackwardOnDevice(const CallContext& call, SavedState& state,
                                           const BackwardSpec& spec) {
  std::vector<float> g;
  if (spec.grad_output) g = TensorToFloats(*spec.grad_output);
  FLCE_RETURN_IF_ERROR(CheckAccumulating(spec));
  auto* shard = dynamic_cast<ShardState*>(&state);
  if (shard == nullptr && (spec.global_lse || spec.grad_hidden_addend)) {
    return absl::InvalidArgumentError(
        "global_lse, grad_hidden_addend: for a vocabulary shard's session only");
  }
  absl::StatusOr<Gradients> out;
  if (auto* stored = dynamic_cast<StoredGradients*>(&state)) {
    out = BackwardStored(call, *stored, spec, g.empty() ? 1.0f : g[0]);
  } else if (auto* kept = dynamic_cast<KeptLogits*>(&state)) {
    out = BackwardKept(call, *kept, spec, g.empty() ? 1.0f : g[0]);
  } else if (auto* saved = dynamic_cast<RecomputeState*>(&state)) {
    out = BackwardFromLse(call, *saved->inputs, saved->lse.as<float>(), nullptr, spec, g);
  } else if (shard != nullptr) {
    out = BackwardShard(call, *shard, spec, g);
  } else {
    return absl::InternalError("saved state was not made by the CUDA engine");
  }
  // Device destinations are written in stream order; the call is over when
  // they are (and the uploaded grad_output's host copy may go).
  const absl::Status synced = call.lane.Synchronize("Backward");
  if (!out.ok()) return out;
  FLCE_RETURN_IF_ERROR(synced);
  return out;
}

}  // namespace internal_cuda
}  // namespace flce
