#include "server/loss_core.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace flce {

LossCore::LossCore(LossEngine* engine, SessionStore* sessions, WeightRegistry* weights,
                   int64_t stage_ahead_bytes)
    : engine_(engine),
      sessions_(sessions),
      weights_(weights),
      stage_ahead_bytes_(stage_ahead_bytes) {}

std::shared_ptr<LossCore::Staged> LossCore::StageAhead(const ForwardCall& call) {
  DeviceMemory* device = engine_->device_memory();
  const TensorView& x = call.problem.hidden;
  const int64_t bytes = x.bytes();
  if (device == nullptr || x.space != MemorySpace::kHost || call.problem.ready != nullptr ||
      bytes <= 0) {
    return nullptr;
  }
  int64_t held = staged_bytes_->load();
  do {
    if (bytes > stage_ahead_bytes_ - held) return nullptr;
  } while (!staged_bytes_->compare_exchange_weak(held, held + bytes));
  absl::StatusOr<StagedCopy> copy = device->StageToDevice(x.data, bytes);
  if (!copy.ok()) {
    staged_bytes_->fetch_sub(bytes);
    return nullptr;  // the engine uploads X in the call and says what fails
  }
  forwards_staged_.fetch_add(1);
  return std::make_shared<Staged>(*std::move(copy), staged_bytes_, bytes);
}

BackwardMode LossCore::ResolveMode(const LossProblem& problem, BackwardMode requested) const {
  if (requested != BackwardMode::kAuto) return requested;
  if (problem.options.reduction == Reduction::kNone) return BackwardMode::kRecompute;
  const int64_t store = engine_->SavedStateBytes(problem, BackwardMode::kStoreGrads);
  const int64_t recompute = engine_->SavedStateBytes(problem, BackwardMode::kRecompute);
  if (!sessions_->Fits(store) && sessions_->Fits(recompute)) {
    return BackwardMode::kRecompute;
  }
  return BackwardMode::kStoreGrads;
}

namespace {

// What a call's device-resident views point into: a registered weight's
// device copy, CUDA IPC regions. A RECOMPUTE session's state holds it.
struct BorrowedMemory {
  std::shared_ptr<RegisteredWeight> weight;
  std::shared_ptr<SliceResolver> shm;
  std::shared_ptr<LossCore::Staged> staged;
};

}  // namespace

absl::StatusOr<ForwardOutcome> LossCore::Forward(const ForwardCall& call,
                                                 const std::string& principal,
                                                 const CancelFn& cancelled,
                                                 const std::function<void()>& started,
                                                 std::shared_ptr<Staged> staged) {
  // A registered weight is read from its device copy where the engine keeps
  // one: never uploaded or copied per call, and not counted in a session.
  // On several devices, its rows are kept in parts where they are computed.
  LossProblem problem = call.problem;
  if (call.weight_ref != nullptr) {
    std::vector<TensorView> parts =
        call.weight_ref->DeviceWeight(engine_->WeightParts(problem.vocab()));
    if (parts.size() == 1) {
      problem.weight = parts[0];
    } else {
      problem.weight_parts = std::move(parts);
    }
  }
  if (problem.shard && !engine_->supports_vocab_shards()) {
    return absl::UnimplementedError(absl::StrCat(
        "vocab_shard: the ", engine_->backend(),
        " engine does not compute vocabulary shards in this version (the cpu engine does)"));
  }
  ForwardOutcome outcome;
  ForwardSpec spec;
  spec.need_backward = call.need_backward;
  spec.want_lse = call.want_lse;
  spec.want_per_row_loss = call.want_per_row_loss;
  Reservation reservation;
  if (call.need_backward) {
    spec.mode = ResolveMode(problem, call.requested_mode);
    FLCE_ASSIGN_OR_RETURN(
        reservation, sessions_->Reserve(engine_->SavedStateBytes(problem, spec.mode), principal));
  }
  if (started) started();
  if (staged != nullptr) {
    // X as StageAhead copied it (the reservation above counted X's device
    // copy, as it would the engine's upload).
    staged->Unhold();
    problem.hidden.data = staged->copy().block->data();
    problem.hidden.space = MemorySpace::kCuda;
    problem.ready = staged->copy().ready.get();
  }
  if (problem.hidden.space == MemorySpace::kCuda || problem.weight.space == MemorySpace::kCuda ||
      !problem.weight_parts.empty()) {
    problem.device_owner = std::make_shared<const BorrowedMemory>(
        BorrowedMemory{call.weight_ref, call.shm, std::move(staged)});
  }
  FLCE_ASSIGN_OR_RETURN(outcome.result, engine_->Forward(problem, spec, cancelled));
  // A shared-memory region its owner shrank under the call was read as
  // zeros: the result is void.
  if (call.shm != nullptr) FLCE_RETURN_IF_ERROR(call.shm->CheckIntact());
  if (call.need_backward) {
    SessionInfo info;
    info.reduction = call.problem.options.reduction;
    info.rows = call.problem.rows();
    info.dtype = call.problem.hidden.dtype;
    info.hidden = call.problem.hidden_size();
    info.vocab = call.problem.vocab();
    info.has_bias = call.problem.bias.has_value();
    info.shard = call.problem.shard.has_value();
    info.weight = call.weight_ref;
    outcome.mode = spec.mode;
    outcome.session_id =
        sessions_->Commit(std::move(reservation), std::move(outcome.result.saved), info);
  }
  return outcome;
}

namespace {

bool SameGradOutput(const std::optional<HostTensor>& a, const std::optional<HostTensor>& b) {
  auto is_one = [](const std::optional<HostTensor>& g) {
    if (!g) return true;
    const float* v = g->data_as<float>();
    for (int64_t i = 0; i < g->num_elements(); ++i) {
      if (v[i] != 1.0f) return false;
    }
    return true;
  };
  if (!a || !b) return is_one(a) && is_one(b);
  return a->num_elements() == b->num_elements() && a->data == b->data;
}

}  // namespace

absl::StatusOr<BackwardOutcome> LossCore::Backward(const BackwardCall& call,
                                                   const std::string& principal,
                                                   const CancelFn& cancelled) {
  FLCE_ASSIGN_OR_RETURN(SessionLease lease, sessions_->Acquire(call.session_id, principal));
  const std::string short_id = call.session_id.substr(0, 8);
  absl::Status status = CheckGradOutput(call, lease.info);
  if (status.ok() && call.accumulate_weight_grad && lease.info.weight == nullptr) {
    status = absl::FailedPreconditionError(
        absl::StrCat("accumulate_weight_grad: session ", short_id,
                     "… was made from a weight tensor, not a weight_ref; there is no accumulator"));
  }
  // A retry of an accumulating Backward whose dX was lost: dW is in the
  // accumulator already.
  const bool retry = lease.undelivered.has_value();
  if (status.ok() && retry &&
      !(call.accumulate_weight_grad &&
        SameGradOutput(call.grad_output, lease.undelivered->grad_output))) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "session_id ", short_id, "…: its last Backward added dW into weight ",
        lease.info.weight->name(),
        " but its dX did not reach the client; only a retry of "
        "that call (accumulate_weight_grad, the same grad_output) may run, and returns dX"));
  }
  // Shared-memory destinations are checked before any compute.
  const DType out_dtype = call.grad_dtype.value_or(lease.info.dtype);
  const int64_t elem = DTypeSize(out_dtype);
  const int64_t dx_bytes = lease.info.rows * lease.info.hidden * elem;
  const int64_t dw_bytes = lease.info.vocab * lease.info.hidden * elem;
  const int64_t db_bytes = lease.info.has_bias ? lease.info.vocab * elem : 0;
  BackwardSpec spec;
  spec.ready = call.ready;
  auto resolve = [&](const std::optional<SliceRef>& slice, int64_t bytes, const char* field,
                     std::optional<GradientDestination>* to) -> absl::Status {
    if (!slice || !status.ok()) return status;
    FLCE_ASSIGN_OR_RETURN(SliceMemory memory, call.shm->Resolve(*slice, bytes, field));
    if (slice->accumulate && memory.space != MemorySpace::kCuda) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".accumulate: only GPU memory (a CUDA IPC region) accumulates"));
    }
    *to = GradientDestination{memory.data, memory.space, slice->accumulate};
    return absl::OkStatus();
  };
  status = resolve(call.grad_hidden_out, dx_bytes, "grad_hidden_out", &spec.grad_hidden_to);
  if (!call.accumulate_weight_grad) {  // (GRADIENTS_HIDDEN comes without weight destinations)
    status = resolve(call.grad_weight_out, dw_bytes, "grad_weight_out", &spec.grad_weight_to);
    if (status.ok() && call.grad_bias_out && !lease.info.has_bias) {
      status = absl::InvalidArgumentError("grad_bias_out: the session has no bias");
    }
    status = resolve(call.grad_bias_out, db_bytes, "grad_bias_out", &spec.grad_bias_to);
  }
  if (status.ok() && call.max_response_bytes > 0) {
    int64_t inline_bytes = spec.grad_hidden_to || call.weight_only ? 0 : dx_bytes;
    if (!call.accumulate_weight_grad && !call.hidden_only) {
      inline_bytes += (spec.grad_weight_to ? 0 : dw_bytes) + (spec.grad_bias_to ? 0 : db_bytes);
    }
    // Room for the message's framing and shapes.
    if (inline_bytes > call.max_response_bytes - 4096) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "Backward: the gradients take ", inline_bytes,
          " bytes, over the server's message limit of ", call.max_response_bytes,
          " (--max_message_bytes); call BackwardStream (the clients switch by themselves)"));
    }
  }
  if (!status.ok()) {
    sessions_->Finish(lease, /*consume=*/false, lease.undelivered);
    return status;
  }
  if (call.grad_output) spec.grad_output = call.grad_output->view();
  if (call.global_lse) spec.global_lse = call.global_lse->view();
  spec.grad_dtype = call.grad_dtype;
  // The accumulator sums fp32 gradients: on the engine's device when it has
  // one (the engine adds them there), else here on the host. A retry only
  // recomputes dX: its dW is in the sum already and is dropped.
  std::optional<RegisteredWeight::DeviceGrad> device_grad =
      call.accumulate_weight_grad && !retry
          ? lease.info.weight->LeaseDeviceGrad(engine_->WeightParts(lease.info.vocab))
          : std::nullopt;
  if (call.accumulate_weight_grad) {
    spec.weight_grad_dtype = DType::kFloat32;
    if (device_grad) {
      std::vector<GradientDestination> dw = device_grad->dw(), db = device_grad->db();
      if (dw.size() == 1) {
        spec.grad_weight_to = dw[0];
        if (!db.empty()) spec.grad_bias_to = db[0];
      } else {
        spec.grad_weight_parts_to = std::move(dw);
        spec.grad_bias_parts_to = std::move(db);
      }
    }
  }
  // The state must survive an undelivered answer: never handed over, but
  // for the dW and db an accumulation takes for good (a retry asks for dX
  // only).
  spec.weight_grads_last_use =
      call.accumulate_weight_grad && !call.keep_session && !retry && !device_grad;
  spec.hidden_grad_only = retry || call.hidden_only;
  if (spec.grad_hidden_to) spec.grad_hidden_landed = call.grad_hidden_landed;
  spec.weight_grads_only = call.weight_only;
  absl::StatusOr<Gradients> grads = engine_->Backward(*lease.state, spec, cancelled);
  if (!grads.ok()) {
    // A device accumulation that went wrong leaves the sum undefined only
    // on a sticky device error, after which the engine serves no more.
    sessions_->Finish(lease, /*consume=*/false, lease.undelivered);
    return grads.status();
  }
  BackwardOutcome outcome;
  if (device_grad) {
    device_grad->Added();  // dW is in the device sum now, whatever follows
    outcome.accumulated = UndeliveredAccumulation{call.grad_output};
  } else if (retry) {
    outcome.accumulated = lease.undelivered;
  }
  // A destination its owner shrank under the call got nothing: the session
  // stays (remembering a device accumulation), as for an undelivered answer.
  if (call.shm != nullptr) {
    absl::Status intact = call.shm->CheckIntact();
    if (!intact.ok()) {
      sessions_->Finish(lease, /*consume=*/false, std::move(outcome.accumulated));
      return intact;
    }
  }
  outcome.grad_hidden = std::move(grads->grad_hidden);
  outcome.has_grad_hidden = !call.weight_only;
  outcome.grad_hidden_in_shm = spec.grad_hidden_to.has_value();
  if (call.accumulate_weight_grad) {
    if (!device_grad && !retry) {
      lease.info.weight->AccumulateGrad(std::move(grads->grad_weight), std::move(grads->grad_bias));
      outcome.accumulated = UndeliveredAccumulation{call.grad_output};
    }
  } else if (!call.hidden_only) {
    outcome.grad_weight = std::move(grads->grad_weight);
    outcome.grad_bias = std::move(grads->grad_bias);
    outcome.grad_weight_in_shm = spec.grad_weight_to.has_value();
    outcome.grad_bias_in_shm = spec.grad_bias_to.has_value();
  }
  outcome.keep_session = call.keep_session;
  outcome.lease = std::move(lease);
  return outcome;
}

void LossCore::Answered(BackwardOutcome& outcome) {
  if (!outcome.lease || outcome.answered) return;
  outcome.answered = true;
  sessions_->Finish(*outcome.lease, /*consume=*/!outcome.keep_session, std::nullopt,
                    /*pending=*/true);
}

void LossCore::Settle(BackwardOutcome& outcome, bool delivered) {
  if (!outcome.lease) return;
  SessionLease lease = std::move(*outcome.lease);
  outcome.lease.reset();
  if (!outcome.answered) {
    // Failed between the compute and the answer: as if it had not run.
    sessions_->Finish(lease, /*consume=*/false, std::move(outcome.accumulated));
  } else if (outcome.keep_session) {
    if (!delivered && outcome.accumulated) {
      sessions_->MarkUndelivered(lease, *std::move(outcome.accumulated));
    }
  } else if (delivered) {
    sessions_->Delivered(lease);
  } else {
    sessions_->Restore(lease, std::move(outcome.accumulated));
  }
}

bool LossCore::Release(const std::string& session_id, const std::string& principal) {
  return sessions_->Release(session_id, principal);
}

}  // namespace flce
