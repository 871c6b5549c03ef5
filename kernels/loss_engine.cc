#include "kernels/loss_engine.h"

#include <cstring>

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
  return p;
}

int64_t OwnedProblem::bytes() const {
  int64_t total = hidden.data.size() + weight.data.size() + target.data.size();
  if (bias) total += bias->data.size();
  if (class_weight) total += class_weight->data.size();
  return total;
}

namespace {

HostTensor Copy(const TensorView& view) {
  HostTensor t(view.dtype, view.shape);
  if (!t.data.empty()) std::memcpy(&t.data[0], view.data, t.data.size());
  return t;
}

}  // namespace

OwnedProblem CopyProblem(const LossProblem& problem) {
  OwnedProblem p;
  p.hidden = Copy(problem.hidden);
  p.weight = Copy(problem.weight);
  p.target = Copy(problem.target);
  if (problem.bias) p.bias = Copy(*problem.bias);
  if (problem.class_weight) p.class_weight = Copy(*problem.class_weight);
  p.options = problem.options;
  return p;
}

}  // namespace flce
