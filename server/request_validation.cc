#include "server/request_validation.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"

namespace flce {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<TensorView> Required(bool present, const v1::Tensor& tensor,
                                    const std::string& field, const SliceResolver* shm,
                                    bool allow_device = false) {
  if (!present) return Invalid(absl::StrCat(field, ": required"));
  return ViewOf(tensor, field, shm, allow_device);
}

absl::Status CheckFloating(const TensorView& view, const std::string& field) {
  if (!IsFloating(view.dtype)) {
    return Invalid(absl::StrCat(field, ": dtype ", DTypeName(view.dtype),
                                " not supported; expected bf16, fp16 or fp32"));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const TensorView& view, const std::string& field,
                        const std::vector<int64_t>& expected, const std::string& meaning) {
  if (view.shape != expected) {
    return Invalid(absl::StrCat(field, ": expected shape ", meaning, " = ", ShapeString(expected),
                                ", got ", ShapeString(view.shape)));
  }
  return absl::OkStatus();
}

absl::Status CheckSameDType(const TensorView& view, const std::string& field, DType hidden_dtype) {
  if (view.dtype != hidden_dtype) {
    return Invalid(absl::StrCat(field, ": dtype ", DTypeName(view.dtype), " differs from hidden's ",
                                DTypeName(hidden_dtype)));
  }
  return absl::OkStatus();
}

// A view of shared memory becomes a view of a private copy, kept in `call`,
// so that what is checked is what is computed on.
TensorView Privatize(const TensorView& view, ForwardCall& call) {
  auto copy = std::make_shared<const HostTensor>(CopyTensor(view));
  call.copies.push_back(copy);
  return copy->view();
}

absl::Status CheckOptions(const v1::LossOptions& o, LossOptions& out) {
  if (!v1::Reduction_IsValid(o.reduction())) {
    return Invalid(absl::StrCat("options.reduction: unknown value ", o.reduction()));
  }
  out.reduction = FromProto(o.reduction());
  if (o.has_ignore_index()) out.ignore_index = o.ignore_index();
  const float eps = o.label_smoothing();
  if (!(eps >= 0.0f && eps < 1.0f)) {
    return Invalid(absl::StrCat("options.label_smoothing: ", eps, " is not in [0, 1)"));
  }
  out.label_smoothing = eps;
  if (o.has_logit_softcap()) {
    const float c = o.logit_softcap();
    if (!(c > 0.0f) || !std::isfinite(c)) {
      return Invalid(absl::StrCat("options.logit_softcap: ", c,
                                  " must be finite and > 0 (leave unset for none)"));
    }
    out.logit_softcap = c;
  }
  const float s = o.z_loss_scale();
  if (!(s >= 0.0f) || !std::isfinite(s)) {
    return Invalid(absl::StrCat("options.z_loss_scale: ", s, " must be finite and >= 0"));
  }
  out.z_loss_scale = s;
  return absl::OkStatus();
}

template <typename T>
absl::Status CheckTargets(const T* t, int64_t n, int64_t v, int64_t ignore_index) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t value = t[i];
    if (value == ignore_index) continue;
    if (value < 0 || value >= v) {
      return absl::OutOfRangeError(absl::StrCat("target[", i, "] = ", value, " is outside [0, ", v,
                                                ") and is not ignore_index (", ignore_index, ")"));
    }
  }
  return absl::OkStatus();
}

// The registered event a request's ready_event names, or null for none.
absl::StatusOr<const DeviceEvent*> ReadyEvent(const std::string& region_id,
                                              const SliceResolver* shm) {
  if (region_id.empty()) return nullptr;
  if (shm == nullptr) {
    return absl::FailedPreconditionError(
        "ready_event: shared memory is not enabled on this server (--enable_shared_memory)");
  }
  return shm->ResolveEvent(region_id, "ready_event");
}

}  // namespace

absl::StatusOr<ForwardCall> DecodeForward(const v1::ForwardRequest& r,
                                          const WeightRegistry& weights,
                                          const std::string& principal,
                                          std::shared_ptr<SliceResolver> shm) {
  ForwardCall call;
  call.shm = std::move(shm);
  const SliceResolver* resolver = call.shm.get();
  LossProblem& p = call.problem;
  FLCE_ASSIGN_OR_RETURN(p.ready, ReadyEvent(r.ready_event(), resolver));
  FLCE_ASSIGN_OR_RETURN(p.hidden, Required(r.has_hidden(), r.hidden(), "hidden", resolver,
                                           /*allow_device=*/true));
  FLCE_RETURN_IF_ERROR(CheckFloating(p.hidden, "hidden"));
  if (p.hidden.shape.size() != 2) {
    return Invalid(
        absl::StrCat("hidden: expected rank 2 [N, H], got shape ", ShapeString(p.hidden.shape)));
  }
  const int64_t n = p.hidden.dim(0), h = p.hidden.dim(1);
  if (h == 0) return Invalid("hidden: H is 0; expected H >= 1");

  switch (r.weight_source_case()) {
    case v1::ForwardRequest::kWeight: {
      FLCE_ASSIGN_OR_RETURN(p.weight,
                            ViewOf(r.weight(), "weight", resolver, /*allow_device=*/true));
      break;
    }
    case v1::ForwardRequest::kWeightRef: {
      FLCE_ASSIGN_OR_RETURN(
          call.weight_ref, weights.Get(r.weight_ref().name(), r.weight_ref().version(), principal));
      if (r.has_bias()) {
        return Invalid(
            "bias: must be absent with weight_ref (the registered weight's bias "
            "is used)");
      }
      p.weight = call.weight_ref->weight().view();
      if (call.weight_ref->bias()) p.bias = call.weight_ref->bias()->view();
      break;
    }
    default:
      return Invalid("weight: required (a tensor or a weight_ref)");
  }
  FLCE_RETURN_IF_ERROR(CheckSameDType(p.weight, "weight", p.hidden.dtype));
  if (p.weight.shape.size() != 2) {
    return Invalid(
        absl::StrCat("weight: expected rank 2 [V, H], got shape ", ShapeString(p.weight.shape)));
  }
  const int64_t v = p.weight.dim(0);
  if (v == 0) return Invalid("weight: V is 0; expected V >= 1");
  // The vocabulary the targets and class weights index: the shard's whole
  // one, else the weight's.
  int64_t full_v = v;
  if (r.has_vocab_shard()) {
    const v1::VocabShard& s = r.vocab_shard();
    if (s.first() < 0 || s.full_vocab() < 1 || s.first() > s.full_vocab() - v) {
      return Invalid(absl::StrCat("vocab_shard: ids [", s.first(), ", ", s.first(), " + V=", v,
                                  ") do not lie inside a vocabulary of full_vocab=",
                                  s.full_vocab()));
    }
    if (r.has_backward() || r.has_loss_out() || r.outputs().lse() ||
        r.outputs().per_row_loss()) {
      return Invalid(
          "vocab_shard: a shard gives statistics, not a loss: not with backward, loss_out or "
          "outputs (the loss and lse come from every shard's statistics combined)");
    }
    p.shard = VocabShard{s.first(), s.full_vocab()};
    full_v = s.full_vocab();
  }
  if (p.weight.dim(1) != h) {
    return Invalid(absl::StrCat("weight: expected [V, H=", h, "] to match hidden ",
                                ShapeString(p.hidden.shape), ", got ",
                                ShapeString(p.weight.shape)));
  }
  if (r.has_bias()) {
    FLCE_ASSIGN_OR_RETURN(TensorView bias, ViewOf(r.bias(), "bias", resolver));
    FLCE_RETURN_IF_ERROR(CheckSameDType(bias, "bias", p.hidden.dtype));
    FLCE_RETURN_IF_ERROR(CheckShape(bias, "bias", {v}, "[V]"));
    p.bias = bias;
  }

  FLCE_ASSIGN_OR_RETURN(p.target, Required(r.has_target(), r.target(), "target", resolver));
  if (r.target().has_shm()) p.target = Privatize(p.target, call);
  if (p.target.dtype != DType::kInt32 && p.target.dtype != DType::kInt64) {
    return Invalid(absl::StrCat("target: dtype ", DTypeName(p.target.dtype),
                                " not supported; expected int32 or int64"));
  }
  FLCE_RETURN_IF_ERROR(CheckShape(p.target, "target", {n}, "[N]"));

  FLCE_RETURN_IF_ERROR(CheckOptions(r.options(), p.options));
  if (r.options().has_class_weight()) {
    FLCE_ASSIGN_OR_RETURN(TensorView cw,
                          ViewOf(r.options().class_weight(), "options.class_weight", resolver));
    if (cw.dtype != DType::kFloat32) {
      return Invalid(absl::StrCat("options.class_weight: dtype ", DTypeName(cw.dtype),
                                  " not supported; expected fp32"));
    }
    FLCE_RETURN_IF_ERROR(CheckShape(cw, "options.class_weight", {full_v},
                                    p.shard ? "[vocab_shard.full_vocab]" : "[V]"));
    if (r.options().class_weight().has_shm()) cw = Privatize(cw, call);
    const float* w = static_cast<const float*>(cw.data);
    for (int64_t j = 0; j < full_v; ++j) {
      if (!(w[j] >= 0.0f) || !std::isfinite(w[j])) {
        return Invalid(absl::StrCat("options.class_weight[", j, "] = ", w[j],
                                    "; weights must be finite and >= 0"));
      }
    }
    p.class_weight = cw;
  }

  if (!v1::BackwardMode_IsValid(r.backward_mode())) {
    return Invalid(absl::StrCat("backward_mode: unknown value ", r.backward_mode()));
  }
  call.requested_mode = FromProto(r.backward_mode());
  call.need_backward = r.need_backward();
  // (A shard's STORE_GRADS keeps its logits, not gradients: any reduction.)
  if (call.need_backward && call.requested_mode == BackwardMode::kStoreGrads &&
      p.options.reduction == Reduction::kNone && !p.shard) {
    return Invalid(
        "backward_mode: STORE_GRADS cannot serve reduction none (the per-row "
        "grad_output must be folded in before the dW reduction); use RECOMPUTE "
        "or AUTO");
  }
  call.want_lse = r.outputs().lse();
  call.want_per_row_loss = r.outputs().per_row_loss();
  if (r.has_loss_out()) {
    if (resolver == nullptr) {
      return absl::FailedPreconditionError(
          "loss_out: shared memory is not enabled on this server (--enable_shared_memory)");
    }
    if (r.loss_out().accumulate()) {
      return Invalid("loss_out.accumulate: only gradient outputs accumulate");
    }
    const int64_t bytes = (p.options.reduction == Reduction::kNone ? n : 1) * int64_t{4};
    FLCE_ASSIGN_OR_RETURN(call.loss_out,
                          resolver->Resolve(ToSliceRef(r.loss_out()), bytes, "loss_out"));
  }

  // Targets last: the scan is O(N) and needs V.
  if (p.target.dtype == DType::kInt32) {
    FLCE_RETURN_IF_ERROR(CheckTargets(static_cast<const int32_t*>(p.target.data), n, full_v,
                                      p.options.ignore_index));
  } else {
    FLCE_RETURN_IF_ERROR(CheckTargets(static_cast<const int64_t*>(p.target.data), n, full_v,
                                      p.options.ignore_index));
  }
  return call;
}

absl::StatusOr<BackwardCall> DecodeBackward(const v1::BackwardRequest& r,
                                            std::shared_ptr<SliceResolver> shm) {
  BackwardCall call;
  call.shm = std::move(shm);
  if (r.has_grad_hidden_out()) call.grad_hidden_out = ToSliceRef(r.grad_hidden_out());
  if (r.has_grad_weight_out()) call.grad_weight_out = ToSliceRef(r.grad_weight_out());
  if (r.has_grad_bias_out()) call.grad_bias_out = ToSliceRef(r.grad_bias_out());
  if ((call.grad_hidden_out || call.grad_weight_out || call.grad_bias_out) && !call.shm) {
    return absl::FailedPreconditionError(
        "grad_*_out: shared memory is not enabled on this server (--enable_shared_memory)");
  }
  if (call.grad_hidden_out && call.grad_hidden_out->accumulate) {
    return Invalid("grad_hidden_out.accumulate: dX is never accumulated");
  }
  FLCE_ASSIGN_OR_RETURN(call.ready, ReadyEvent(r.ready_event(), call.shm.get()));
  if (r.session_id().empty()) return Invalid("session_id: required");
  call.session_id = r.session_id();
  call.keep_session = r.keep_session();
  call.accumulate_weight_grad = r.accumulate_weight_grad();
  if (r.has_grad_output()) {
    FLCE_ASSIGN_OR_RETURN(TensorView g, ViewOf(r.grad_output(), "grad_output", call.shm.get()));
    FLCE_RETURN_IF_ERROR(CheckFloating(g, "grad_output"));
    HostTensor fp32(DType::kFloat32, g.shape);
    ToFloat(g.dtype, g.data, g.num_elements(), fp32.mutable_data<float>());
    call.grad_output = std::move(fp32);
  }
  if (r.has_global_lse()) {
    FLCE_ASSIGN_OR_RETURN(TensorView lse, ViewOf(r.global_lse(), "global_lse", call.shm.get()));
    if (lse.dtype != DType::kFloat32) {
      return Invalid(absl::StrCat("global_lse: dtype ", DTypeName(lse.dtype),
                                  " not supported; expected fp32"));
    }
    HostTensor copy(DType::kFloat32, lse.shape);
    if (lse.num_elements() > 0) std::memcpy(&copy.data[0], lse.data, copy.data.size());
    call.global_lse = std::move(copy);
  }
  switch (r.grad_dtype()) {
    case v1::DTYPE_UNSPECIFIED:
      break;
    case v1::DTYPE_FLOAT32:
      call.grad_dtype = DType::kFloat32;
      break;
    default:
      return Invalid(absl::StrCat("grad_dtype: ",
                                  v1::DType_Name(r.grad_dtype()).empty()
                                      ? std::to_string(r.grad_dtype())
                                      : v1::DType_Name(r.grad_dtype()),
                                  " not supported; leave unset (input dtype) or DTYPE_FLOAT32"));
  }
  switch (r.gradients()) {
    case v1::GRADIENTS_ALL:
      break;
    case v1::GRADIENTS_HIDDEN:
      if (!call.keep_session) {
        return Invalid("gradients: GRADIENTS_HIDDEN leaves dW in the session for a later "
                       "Backward: set keep_session");
      }
      if (call.accumulate_weight_grad || call.grad_weight_out || call.grad_bias_out) {
        return Invalid("gradients: GRADIENTS_HIDDEN delivers dX only: not with "
                       "accumulate_weight_grad, grad_weight_out or grad_bias_out");
      }
      call.hidden_only = true;
      break;
    case v1::GRADIENTS_WEIGHT:
      if (call.grad_hidden_out) {
        return Invalid("gradients: GRADIENTS_WEIGHT sends no dX: not with grad_hidden_out");
      }
      call.weight_only = true;
      break;
    default:
      return Invalid(absl::StrCat("gradients: unknown value ", r.gradients()));
  }
  return call;
}

absl::Status CheckGradOutput(const BackwardCall& call, const SessionInfo& info) {
  if (info.shard != call.global_lse.has_value()) {
    return Invalid(info.shard ? "global_lse: required by a vocabulary shard's session (each "
                                "row's lse over the whole vocabulary, fp32 [N])"
                              : "global_lse: only a vocabulary shard's session takes it");
  }
  if (call.global_lse && call.global_lse->shape != std::vector<int64_t>{info.rows}) {
    return Invalid(absl::StrCat("global_lse: expected fp32 [N] = ", info.rows, ", got ",
                                ShapeString(call.global_lse->shape)));
  }
  if (!call.grad_output) return absl::OkStatus();
  const std::vector<int64_t>& shape = call.grad_output->shape;
  if (info.reduction == Reduction::kNone) {
    if (shape != std::vector<int64_t>{info.rows}) {
      return Invalid(absl::StrCat("grad_output: expected shape [N] = ", info.rows,
                                  " for reduction none, got ", ShapeString(shape)));
    }
  } else if (!(shape.empty() || shape == std::vector<int64_t>{1})) {
    return Invalid(
        absl::StrCat("grad_output: expected a scalar (shape [] or [1]) for "
                     "reduction ",
                     ReductionName(info.reduction), ", got ", ShapeString(shape)));
  }
  return absl::OkStatus();
}

}  // namespace flce
