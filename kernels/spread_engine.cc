#include "kernels/spread_engine.h"

#include <utility>

#include "kernels/status_macros.h"

namespace flce {
namespace {

// A session's state and the engine that made it.
class SpreadState : public SavedState {
 public:
  SpreadState(int engine, std::unique_ptr<SavedState> inner)
      : engine(engine), inner(std::move(inner)) {}
  int64_t bytes() const override { return inner->bytes(); }
  const int engine;
  const std::unique_ptr<SavedState> inner;
};

// Counts a call in flight on an engine while it lives.
class InFlight {
 public:
  explicit InFlight(std::atomic<int>& count) : count_(count) { count_.fetch_add(1); }
  ~InFlight() { count_.fetch_sub(1); }

 private:
  std::atomic<int>& count_;
};

}  // namespace

SpreadEngine::SpreadEngine(std::vector<std::unique_ptr<LossEngine>> engines)
    : engines_(std::move(engines)), in_flight_(new std::atomic<int>[engines_.size()]) {
  for (size_t e = 0; e < engines_.size(); ++e) in_flight_[e].store(0);
}

std::vector<DeviceInfo> SpreadEngine::devices() const {
  std::vector<DeviceInfo> out;
  for (const auto& e : engines_) {
    for (DeviceInfo d : e->devices()) out.push_back(std::move(d));
  }
  return out;
}

int64_t SpreadEngine::device_memory_bytes() const {
  int64_t total = 0;
  for (const auto& e : engines_) total += e->device_memory_bytes();
  return total;
}

int64_t SpreadEngine::forward_reruns() const {
  int64_t total = 0;
  for (const auto& e : engines_) total += e->forward_reruns();
  return total;
}

bool SpreadEngine::supports_vocab_shards() const {
  for (const auto& e : engines_) {
    if (!e->supports_vocab_shards()) return false;
  }
  return true;
}

absl::Status SpreadEngine::health() const {
  for (const auto& e : engines_) FLCE_RETURN_IF_ERROR(e->health());
  return absl::OkStatus();
}

std::vector<WeightPart> SpreadEngine::WeightParts(int64_t vocab) const {
  std::vector<WeightPart> parts;
  for (const auto& e : engines_) parts.push_back(WeightPart{0, vocab, e->device_memory()});
  return parts;
}

namespace {

// `problem` as engine e computes it: the weight from e's replica, where the
// caller gave replicas (WeightParts).
LossProblem OnEngine(const LossProblem& problem, int e) {
  return problem.weight_parts.empty() ? problem : ProblemOnPart(problem, e);
}

}  // namespace

int64_t SpreadEngine::SavedStateBytes(const LossProblem& problem, BackwardMode mode) const {
  return engines_[0]->SavedStateBytes(OnEngine(problem, 0), mode);
}

int SpreadEngine::Pick() {
  const int count = static_cast<int>(engines_.size());
  const int start = next_.fetch_add(1) % count;
  int best = start;
  for (int i = 1; i < count; ++i) {
    const int e = (start + i) % count;
    if (in_flight_[e].load() < in_flight_[best].load()) best = e;
  }
  return best;
}

absl::StatusOr<ForwardResult> SpreadEngine::Forward(const LossProblem& problem,
                                                    const ForwardSpec& spec,
                                                    const CancelFn& cancelled) {
  if (problem.hidden.space != MemorySpace::kHost || problem.weight.space != MemorySpace::kHost) {
    return absl::FailedPreconditionError(
        "hidden, weight: an engine spreading requests over devices reads them from host memory");
  }
  if (!problem.weight_parts.empty() && problem.weight_parts.size() != engines_.size()) {
    return absl::InternalError("weight_parts: not a replica per engine (WeightParts)");
  }
  const int e = Pick();
  InFlight counted(in_flight_[e]);
  FLCE_ASSIGN_OR_RETURN(ForwardResult result,
                        engines_[e]->Forward(OnEngine(problem, e), spec, cancelled));
  if (result.saved != nullptr) {
    result.saved = std::make_unique<SpreadState>(e, std::move(result.saved));
  }
  return result;
}

absl::StatusOr<Gradients> SpreadEngine::Backward(SavedState& state, const BackwardSpec& spec,
                                                 const CancelFn& cancelled) {
  auto* spread = dynamic_cast<SpreadState*>(&state);
  if (spread == nullptr) return absl::InternalError("saved state was not made by this engine");
  const int e = spread->engine;
  InFlight counted(in_flight_[e]);
  if (spec.grad_weight_parts_to.empty())
    return engines_[e]->Backward(*spread->inner, spec, cancelled);
  // dW and db into the sums beside the replica this session's engine read.
  if (spec.grad_weight_parts_to.size() != engines_.size() ||
      (!spec.grad_bias_parts_to.empty() && spec.grad_bias_parts_to.size() != engines_.size())) {
    return absl::InternalError("grad_weight_parts_to: not a sum per engine (WeightParts)");
  }
  return engines_[e]->Backward(*spread->inner, BackwardOnPart(spec, e), cancelled);
}

}  // namespace flce
