#include "server/loss_core.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace flce {

LossCore::LossCore(LossEngine* engine, SessionStore* sessions, WeightRegistry* weights)
    : engine_(engine), sessions_(sessions), weights_(weights) {}

BackwardMode LossCore::ResolveMode(const ForwardCall& call) const {
  if (call.requested_mode != BackwardMode::kAuto) return call.requested_mode;
  if (call.problem.options.reduction == Reduction::kNone) {
    return BackwardMode::kRecompute;
  }
  const int64_t store = engine_->SavedStateBytes(call.problem, BackwardMode::kStoreGrads);
  const int64_t recompute = engine_->SavedStateBytes(call.problem, BackwardMode::kRecompute);
  if (!sessions_->Fits(store) && sessions_->Fits(recompute)) {
    return BackwardMode::kRecompute;
  }
  return BackwardMode::kStoreGrads;
}

absl::StatusOr<ForwardOutcome> LossCore::Forward(const ForwardCall& call,
                                                 const std::string& principal,
                                                 const CancelFn& cancelled) {
  ForwardOutcome outcome;
  ForwardSpec spec;
  spec.need_backward = call.need_backward;
  spec.want_lse = call.want_lse;
  spec.want_per_row_loss = call.want_per_row_loss;
  Reservation reservation;
  if (call.need_backward) {
    spec.mode = ResolveMode(call);
    FLCE_ASSIGN_OR_RETURN(
        reservation,
        sessions_->Reserve(engine_->SavedStateBytes(call.problem, spec.mode), principal));
  }
  // A registered weight is read from its device copy where the engine keeps
  // one, instead of being uploaded on every call.
  LossProblem problem = call.problem;
  if (call.weight_ref != nullptr) {
    if (const void* device = call.weight_ref->DeviceWeight(*engine_)) {
      problem.weight.data = device;
      problem.weight.space = MemorySpace::kCuda;
    }
  }
  FLCE_ASSIGN_OR_RETURN(outcome.result, engine_->Forward(problem, spec, cancelled));
  if (call.need_backward) {
    SessionInfo info;
    info.reduction = call.problem.options.reduction;
    info.rows = call.problem.rows();
    info.dtype = call.problem.hidden.dtype;
    info.hidden = call.problem.hidden_size();
    info.vocab = call.problem.vocab();
    info.has_bias = call.problem.bias.has_value();
    info.weight = call.weight_ref;
    outcome.mode = spec.mode;
    outcome.session_id = sessions_->Commit(std::move(reservation),
                                           std::move(outcome.result.saved), info);
  }
  return outcome;
}

absl::StatusOr<BackwardOutcome> LossCore::Backward(const BackwardCall& call,
                                                   const std::string& principal,
                                                   const CancelFn& cancelled) {
  FLCE_ASSIGN_OR_RETURN(SessionLease lease,
                        sessions_->Acquire(call.session_id, principal));
  absl::Status status = CheckGradOutput(call, lease.info);
  if (status.ok() && call.accumulate_weight_grad && lease.info.weight == nullptr) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "accumulate_weight_grad: session ", call.session_id.substr(0, 8),
        "… was made from a weight tensor, not a weight_ref; there is no accumulator"));
  }
  // Shared-memory destinations are checked before any compute.
  const DType out_dtype = call.grad_dtype.value_or(lease.info.dtype);
  const int64_t elem = DTypeSize(out_dtype);
  BackwardSpec spec;
  auto resolve = [&](const std::optional<v1::SharedMemorySlice>& slice, int64_t bytes,
                     const char* field, std::optional<GradientDestination>* to) -> absl::Status {
    if (!slice || !status.ok()) return status;
    FLCE_ASSIGN_OR_RETURN(SliceMemory memory, call.shm->Resolve(*slice, bytes, field));
    *to = GradientDestination{memory.data, memory.space};
    return absl::OkStatus();
  };
  status = resolve(call.grad_hidden_out, lease.info.rows * lease.info.hidden * elem,
                   "grad_hidden_out", &spec.grad_hidden_to);
  if (!call.accumulate_weight_grad) {
    status = resolve(call.grad_weight_out, lease.info.vocab * lease.info.hidden * elem,
                     "grad_weight_out", &spec.grad_weight_to);
    if (status.ok() && call.grad_bias_out && !lease.info.has_bias) {
      status = absl::InvalidArgumentError("grad_bias_out: the session has no bias");
    }
    status = resolve(call.grad_bias_out, lease.info.vocab * elem, "grad_bias_out",
                     &spec.grad_bias_to);
  }
  if (!status.ok()) {
    sessions_->Finish(lease, /*consume=*/false);
    return status;
  }
  if (call.grad_output) spec.grad_output = call.grad_output->view();
  spec.grad_dtype = call.grad_dtype;
  // The accumulator sums fp32 gradients: on the engine's device when it has
  // one (the engine adds them there), else here on the host.
  std::optional<RegisteredWeight::DeviceGrad> device_grad =
      call.accumulate_weight_grad ? lease.info.weight->LeaseDeviceGrad(*engine_) : std::nullopt;
  if (call.accumulate_weight_grad) {
    spec.weight_grad_dtype = DType::kFloat32;
    if (device_grad) {
      spec.grad_weight_to = device_grad->dw();
      spec.grad_bias_to = device_grad->db();
    }
  }
  spec.last_use = !call.keep_session;
  absl::StatusOr<Gradients> grads = engine_->Backward(*lease.state, spec, cancelled);
  sessions_->Finish(lease, /*consume=*/grads.ok() && !call.keep_session);
  if (!grads.ok()) return grads.status();
  if (device_grad) device_grad->Added();
  BackwardOutcome outcome;
  outcome.grad_hidden = std::move(grads->grad_hidden);
  outcome.grad_hidden_in_shm = spec.grad_hidden_to.has_value();
  if (call.accumulate_weight_grad) {
    if (!device_grad) {
      lease.info.weight->AccumulateGrad(std::move(grads->grad_weight),
                                        std::move(grads->grad_bias));
    }
  } else {
    outcome.grad_weight = std::move(grads->grad_weight);
    outcome.grad_bias = std::move(grads->grad_bias);
    outcome.grad_weight_in_shm = spec.grad_weight_to.has_value();
    outcome.grad_bias_in_shm = spec.grad_bias_to.has_value();
  }
  return outcome;
}

bool LossCore::Release(const std::string& session_id, const std::string& principal) {
  return sessions_->Release(session_id, principal);
}

}  // namespace flce
