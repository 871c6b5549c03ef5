#include "kernels/sharded_engine.h"

#include <algorithm>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "kernels/shard_combine.h"
#include "kernels/status_macros.h"

namespace flce {
namespace {

// Every shard's state, and what Backward needs to put the parts together.
class ShardedState : public SavedState {
 public:
  std::vector<std::unique_ptr<SavedState>> parts;
  HostTensor lse;               // fp32 [N], the combined one
  std::vector<int64_t> firsts;  // each shard's first vocabulary id
  int64_t n = 0, h = 0, v = 0;
  DType dtype = DType::kFloat32;
  bool has_bias = false;
  int64_t bytes() const override {
    int64_t total = static_cast<int64_t>(lse.data.size());
    for (const auto& p : parts) total += p->bytes();
    return total;
  }
};

HostTensor Scalar(double value) {
  HostTensor t(DType::kFloat32, {});
  t.mutable_data<float>()[0] = static_cast<float>(value);
  return t;
}

HostTensor PerRow(const std::vector<double>& values) {
  HostTensor t(DType::kFloat32, {static_cast<int64_t>(values.size())});
  for (size_t i = 0; i < values.size(); ++i)
    t.mutable_data<float>()[i] = static_cast<float>(values[i]);
  return t;
}

}  // namespace

ShardedEngine::ShardedEngine(std::vector<std::unique_ptr<LossEngine>> engines, int shards,
                             std::unique_ptr<PartialSum> sum)
    : engines_(std::move(engines)), shards_(std::max(1, shards)), sum_(std::move(sum)) {
  if (sum_ == nullptr && engines_.size() > 1 && engines_[0]->device_memory() == nullptr) {
    sum_ = HostPartialSum();
  }
}

absl::Status ShardedEngine::ForEachEngine(int count,
                                          const std::function<absl::Status(int)>& run) const {
  const int engines = static_cast<int>(engines_.size());
  auto shards_of = [&](int e) -> absl::Status {
    for (int k = e; k < count; k += engines) FLCE_RETURN_IF_ERROR(run(k));
    return absl::OkStatus();
  };
  if (engines == 1) return shards_of(0);
  std::vector<absl::Status> status(engines);
  std::vector<std::thread> threads;
  for (int e = 1; e < engines; ++e) threads.emplace_back([&, e] { status[e] = shards_of(e); });
  status[0] = shards_of(0);
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) FLCE_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

ShardedEngine::CombineTimes ShardedEngine::last_combine_times() const {
  return CombineTimes{stats_ms_.load(), dx_wait_ms_.load(), dx_sum_ms_.load()};
}

std::vector<DeviceInfo> ShardedEngine::devices() const {
  std::vector<DeviceInfo> out;
  for (const auto& e : engines_) {
    for (DeviceInfo d : e->devices()) {
      d.name = absl::StrCat(d.name, " (", shards_, " vocabulary shards over ", engines_.size(),
                            " engine", engines_.size() > 1 ? "s" : "", ")");
      out.push_back(std::move(d));
    }
  }
  return out;
}

int64_t ShardedEngine::device_memory_bytes() const {
  int64_t total = 0;
  for (const auto& e : engines_) total += e->device_memory_bytes();
  return total;
}

absl::Status ShardedEngine::health() const {
  for (const auto& e : engines_) FLCE_RETURN_IF_ERROR(e->health());
  return absl::OkStatus();
}

int ShardedEngine::Count(int64_t vocab) const {
  return static_cast<int>(std::min<int64_t>(shards_, vocab));
}

std::pair<int64_t, int64_t> ShardedEngine::Rows(int64_t vocab, int k) const {
  const int count = Count(vocab);
  return {vocab * k / count, vocab * (k + 1) / count};
}

std::vector<WeightPart> ShardedEngine::WeightParts(int64_t vocab) const {
  if (engines_.size() == 1) return engines_[0]->WeightParts(vocab);
  std::vector<WeightPart> parts;
  for (int k = 0; k < Count(vocab); ++k) {
    const auto [first, last] = Rows(vocab, k);
    parts.push_back(WeightPart{first, last - first, EngineOf(k).device_memory()});
  }
  return parts;
}

LossProblem ShardedEngine::Shard(const LossProblem& problem, int k) const {
  const int64_t v = problem.vocab();
  const auto [first, last] = Rows(v, k);
  // Over several engines the parts are the shards (WeightParts).
  LossProblem part = problem.weight_parts.empty() ? problem : ProblemOnPart(problem, k);
  if (problem.weight_parts.empty()) part.weight = RowSlice(problem.weight, first, last - first);
  if (problem.bias) part.bias = RowSlice(*problem.bias, first, last - first);
  part.shard = VocabShard{first, v};
  return part;
}

int64_t ShardedEngine::SavedStateBytes(const LossProblem& problem, BackwardMode mode) const {
  if (problem.shard) return engines_[0]->SavedStateBytes(problem, mode);
  int64_t total = problem.rows() * 4;  // the combined lse
  for (int k = 0; k < Count(problem.vocab()); ++k) {
    total += EngineOf(k).SavedStateBytes(Shard(problem, k), mode);
  }
  return total;
}

absl::StatusOr<ForwardResult> ShardedEngine::Forward(const LossProblem& problem,
                                                     const ForwardSpec& spec,
                                                     const CancelFn& cancelled) {
  if (problem.shard) return engines_[0]->Forward(problem, spec, cancelled);
  const int count = Count(problem.vocab());
  if (engines_.size() > 1 &&
      (problem.hidden.space != MemorySpace::kHost ||
       (problem.weight.space != MemorySpace::kHost && problem.weight_parts.empty()))) {
    return absl::FailedPreconditionError(
        "hidden, weight: a sharded engine over several devices reads them from host memory "
        "(or the weight from its parts on the devices)");
  }
  if (!problem.weight_parts.empty() &&
      (engines_.size() == 1 || static_cast<int>(problem.weight_parts.size()) != count)) {
    return absl::InternalError(absl::StrCat("weight_parts: ", problem.weight_parts.size(),
                                            " parts, expected those of WeightParts"));
  }
  ForwardSpec part_spec;
  part_spec.need_backward = spec.need_backward;
  part_spec.mode = spec.mode;
  std::vector<ForwardResult> parts(count);
  std::vector<const ShardStats*> stats;
  auto state = std::make_unique<ShardedState>();
  for (int k = 0; k < count; ++k) state->firsts.push_back(Shard(problem, k).shard->first);
  // Shards of different engines at once (a thread each), each engine's in turn.
  FLCE_RETURN_IF_ERROR(ForEachEngine(count, [&](int k) -> absl::Status {
    FLCE_ASSIGN_OR_RETURN(parts[k], EngineOf(k).Forward(Shard(problem, k), part_spec, cancelled));
    if (!parts[k].shard_stats) return absl::InternalError("a shard's Forward gave no statistics");
    return absl::OkStatus();
  }));
  for (const ForwardResult& r : parts) stats.push_back(&*r.shard_stats);
  const absl::Time combine_start = absl::Now();
  FLCE_ASSIGN_OR_RETURN(CombinedShards combined, CombineShards(problem, problem.vocab(), stats));
  stats_ms_ = absl::ToDoubleMilliseconds(absl::Now() - combine_start);
  ForwardResult result;
  result.num_valid = combined.num_valid;
  result.num_correct = combined.num_correct;
  if (problem.options.reduction == Reduction::kNone) {
    result.loss = PerRow(combined.loss);
    result.z_loss = PerRow(combined.z_loss);
  } else {
    double total = 0, z_total = 0;
    for (size_t i = 0; i < combined.loss.size(); ++i) {
      total += combined.loss[i];
      z_total += combined.z_loss[i];
    }
    // mean over zero valid rows is 0/0 = NaN, as in PyTorch.
    const double denom = problem.options.reduction == Reduction::kMean ? combined.denom : 1.0;
    result.loss = Scalar(total / denom);
    result.z_loss = Scalar(z_total / denom);
  }
  if (spec.want_lse) result.lse = combined.lse;
  if (spec.want_per_row_loss) result.per_row_loss = PerRow(combined.loss);
  if (spec.need_backward) {
    for (ForwardResult& r : parts) state->parts.push_back(std::move(r.saved));
    state->lse = std::move(combined.lse);
    state->n = problem.rows();
    state->h = problem.hidden_size();
    state->v = problem.vocab();
    state->dtype = problem.hidden.dtype;
    state->has_bias = problem.bias.has_value();
    result.saved = std::move(state);
  }
  return result;
}

absl::StatusOr<Gradients> ShardedEngine::Backward(SavedState& saved, const BackwardSpec& spec,
                                                  const CancelFn& cancelled) {
  auto* state = dynamic_cast<ShardedState*>(&saved);
  if (state == nullptr) return engines_[0]->Backward(saved, spec, cancelled);  // a shard's own
  const int64_t n = state->n, h = state->h, v = state->v;
  const DType dx_dtype = spec.hidden_dtype(state->dtype);
  const DType w_dtype = spec.weight_dtype(state->dtype);
  const int64_t w_elem = DTypeSize(w_dtype);
  const int count = static_cast<int>(state->parts.size());
  const int engines = static_cast<int>(engines_.size());
  if (engines > 1) {
    for (const auto* to : {&spec.grad_hidden_to, &spec.grad_weight_to, &spec.grad_bias_to}) {
      if (*to && (*to)->space != MemorySpace::kHost) {
        return absl::FailedPreconditionError(
            "a sharded engine over several devices writes gradients into host memory only "
            "(or dW and db into the weight's parts)");
      }
    }
  }
  // dX: each engine's shards add their fp32 parts into one sum in its
  // memory (BackwardSpec::grad_hidden_addend: a shard adds the sum of those
  // before it and writes it back); the last shard of engine 0 adds engine
  // 0's sum and, once the other engines' sums are added into it (the
  // collective, sum_, while that shard's own part is made), delivers dX
  // rounded once where the caller asked.
  const bool sum_dx = !spec.weight_grads_only && count > 1 && n * h > 0;
  if (sum_dx && engines > 1 && sum_ == nullptr) {
    return absl::UnimplementedError("a sharded engine over several devices needs a collective");
  }
  std::vector<std::unique_ptr<DeviceBlock>> device_sums(engines);
  std::vector<std::vector<float>> host_sums(engines);
  std::vector<float*> sums(engines, nullptr);
  std::vector<TensorView> sum_views(engines);
  if (sum_dx) {
    for (int e = 0; e < engines; ++e) {
      DeviceMemory* device = engines_[e]->device_memory();
      TensorView& view = sum_views[e];
      view.dtype = DType::kFloat32;
      view.shape = {n, h};
      if (device != nullptr) {
        FLCE_ASSIGN_OR_RETURN(device_sums[e], device->Allocate(n * h * 4));  // zeroed
        sums[e] = static_cast<float*>(device_sums[e]->data());
        view.space = MemorySpace::kCuda;
      } else {
        host_sums[e].assign(static_cast<size_t>(n * h), 0.0f);
        sums[e] = host_sums[e].data();
        view.space = MemorySpace::kHost;
      }
      view.data = sums[e];
    }
  }
  // The shard that delivers dX: engine 0's last.
  const int final_shard = (count - 1) / engines * engines;
  // The other engines' sums are complete (or failed) when this reaches 0.
  absl::BlockingCounter others(std::max(0, std::min(engines, count) - 1));
  std::vector<absl::Status> other_status(engines);
  std::function<absl::Status()> collect = [&]() -> absl::Status {
    const absl::Time wait_start = absl::Now();
    others.Wait();
    const absl::Time sum_start = absl::Now();
    dx_wait_ms_ = absl::ToDoubleMilliseconds(sum_start - wait_start);
    for (const absl::Status& s : other_status) FLCE_RETURN_IF_ERROR(s);
    absl::Status summed = sum_->SumIntoFirst(sums, n * h);
    dx_sum_ms_ = absl::ToDoubleMilliseconds(absl::Now() - sum_start);
    return summed;
  };
  // dW and db: each shard writes its rows in place, into the caller's
  // destination or into tensors made here.
  Gradients out;
  std::optional<GradientDestination> weight_to = spec.grad_weight_to, bias_to = spec.grad_bias_to;
  // (Or each shard's rows to its own destination: the weight's parts.)
  const bool weight_parts = !spec.grad_weight_parts_to.empty();
  if (weight_parts &&
      (static_cast<int>(spec.grad_weight_parts_to.size()) != count ||
       (state->has_bias && static_cast<int>(spec.grad_bias_parts_to.size()) != count))) {
    return absl::InternalError(
        absl::StrCat("grad_weight_parts_to: ", spec.grad_weight_parts_to.size(),
                     " parts, expected those of WeightParts"));
  }
  auto into = [weight_parts](HostTensor& tensor, DType dtype, std::vector<int64_t> shape,
                             std::optional<GradientDestination>& to) {
    if (to || weight_parts) {
      tensor.dtype = dtype;
      tensor.shape = std::move(shape);
    } else {
      tensor = HostTensor(dtype, std::move(shape));
      to = GradientDestination{tensor.data.data()};
    }
  };
  if (!spec.hidden_grad_only) {
    into(out.grad_weight, w_dtype, {v, h}, weight_to);
    if (state->has_bias) into(out.grad_bias.emplace(), w_dtype, {v}, bias_to);
  }
  auto at = [](const std::optional<GradientDestination>& to, int64_t offset) {
    std::optional<GradientDestination> part = to;
    if (part) part->data = static_cast<char*>(part->data) + offset;
    return part;
  };
  auto run = [&](int k) -> absl::Status {
    const int e = k % engines;
    // dW and db: into the weight's part k, or at the shard's rows of the
    // whole's destination.
    BackwardSpec part_spec = weight_parts ? BackwardOnPart(spec, k) : spec;
    if (!weight_parts) {
      part_spec.grad_weight_to = at(weight_to, state->firsts[k] * h * w_elem);
      part_spec.grad_bias_to = at(bias_to, state->firsts[k] * w_elem);
    }
    part_spec.global_lse = state->lse.view();
    part_spec.weight_grad_dtype = w_dtype;
    part_spec.grad_hidden_addend.reset();
    part_spec.grad_hidden_addend_ready = nullptr;
    if (sum_dx && k >= engines) part_spec.grad_hidden_addend = sum_views[e];
    if (sum_dx && k == final_shard) {
      part_spec.grad_hidden_addend = sum_views[0];
      if (engines > 1) part_spec.grad_hidden_addend_ready = collect;
    }
    if (sum_dx && k != final_shard) {
      part_spec.grad_dtype = DType::kFloat32;
      part_spec.grad_hidden_to = GradientDestination{sums[e], sum_views[e].space};
    } else {
      part_spec.grad_dtype = dx_dtype;
      part_spec.grad_hidden_to = spec.grad_hidden_to;
    }
    FLCE_ASSIGN_OR_RETURN(Gradients g,
                          EngineOf(k).Backward(*state->parts[k], part_spec, cancelled));
    if (k == final_shard && !spec.weight_grads_only) out.grad_hidden = std::move(g.grad_hidden);
    return absl::OkStatus();
  };
  FLCE_RETURN_IF_ERROR(ForEachEngine(count, [&](int k) -> absl::Status {
    const int e = k % engines;
    absl::Status status = run(k);
    // An engine other than 0 is done after its last shard, or at its first error.
    const bool last_of_engine = k + engines >= count;
    if (e != 0 && (!status.ok() || last_of_engine)) {
      other_status[e] = status;
      others.DecrementCount();
    }
    return status;
  }));
  return out;
}

}  // namespace flce
