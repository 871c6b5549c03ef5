#include "kernels/loss_engine.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flce {

const char* ReductionName(Reduction reduction) {
  switch (reduction) {
    case Reduction::kMean:
      return "mean";
    case Reduction::kSum:
      return "sum";
    case Reduction::kNone:
      return "none";
  }
  return "unknown";
}

const char* BackwardModeName(BackwardMode mode) {
  switch (mode) {
    case BackwardMode::kAuto:
      return "auto";
    case BackwardMode::kStoreGrads:
      return "store_grads";
    case BackwardMode::kRecompute:
      return "recompute";
  }
  return "unknown";
}

LossProblem OwnedProblem::view() const {
  LossProblem p;
  p.hidden = hidden.view();
  p.weight = weight.view();
  if (bias) p.bias = bias->view();
  p.target = target.view();
  if (class_weight) p.class_weight = class_weight->view();
  p.options = options;
  p.shard = shard;
  return p;
}

int64_t OwnedProblem::bytes() const {
  int64_t total = hidden.data.size() + weight.data.size() + target.data.size();
  if (bias) total += bias->data.size();
  if (class_weight) total += class_weight->data.size();
  return total;
}

OwnedProblem CopyProblem(const LossProblem& problem) {
  OwnedProblem p;
  p.hidden = CopyTensor(problem.hidden);
  p.weight = CopyTensor(problem.weight);
  p.target = CopyTensor(problem.target);
  if (problem.bias) p.bias = CopyTensor(*problem.bias);
  if (problem.class_weight) p.class_weight = CopyTensor(*problem.class_weight);
  p.options = problem.options;
  p.shard = problem.shard;
  return p;
}

LossProblem ProblemOnPart(const LossProblem& problem, size_t k) {
  LossProblem part = problem;
  part.weight = problem.weight_parts[k];
  part.weight_parts.clear();
  return part;
}

BackwardSpec BackwardOnPart(const BackwardSpec& spec, size_t k) {
  BackwardSpec part = spec;
  part.grad_weight_to = spec.grad_weight_parts_to[k];
  part.grad_bias_to.reset();
  if (!spec.grad_bias_parts_to.empty()) part.grad_bias_to = spec.grad_bias_parts_to[k];
  part.grad_weight_parts_to.clear();
  part.grad_bias_parts_to.clear();
  return part;
}

absl::Status RequireHostMemory(const LossProblem& p) {
  const std::pair<const TensorView*, const char*> views[] = {
      {&p.hidden, "hidden"},
      {&p.weight, "weight"},
      {p.bias ? &*p.bias : nullptr, "bias"},
      {&p.target, "target"},
      {p.class_weight ? &*p.class_weight : nullptr, "options.class_weight"}};
  for (const auto& [view, name] : views) {
    if (view != nullptr && view->space != MemorySpace::kHost) {
      return absl::FailedPreconditionError(
          absl::StrCat(name, ": this engine cannot read GPU memory"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteToHostDestinations(const BackwardSpec& spec, Gradients& grads) {
  auto write = [](const std::optional<GradientDestination>& to, HostTensor* t,
                  const char* name) -> absl::Status {
    if (!to || t == nullptr) return absl::OkStatus();
    if (to->space != MemorySpace::kHost) {
      return absl::FailedPreconditionError(
          absl::StrCat(name, ": this engine cannot write GPU memory"));
    }
    if (to->accumulate) {
      return absl::FailedPreconditionError(
          absl::StrCat(name, ": this engine does not accumulate into destinations"));
    }
    if (!t->data.empty()) std::memcpy(to->data, t->data.data(), t->data.size());
    t->data.clear();
    t->data.shrink_to_fit();
    return absl::OkStatus();
  };
  absl::Status status = write(spec.grad_hidden_to, &grads.grad_hidden, "grad_hidden_out");
  if (status.ok()) status = write(spec.grad_weight_to, &grads.grad_weight, "grad_weight_out");
  if (status.ok()) {
    status =
        write(spec.grad_bias_to, grads.grad_bias ? &*grads.grad_bias : nullptr, "grad_bias_out");
  }
  return status;
}

}  // namespace flce
