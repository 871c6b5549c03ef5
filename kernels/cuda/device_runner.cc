#include "kernels/cuda/device_runner.h"

#include <optional>
#include <utility>

#include "kernels/cuda/stage_clock.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {
namespace {

class DeviceRunner : public DeviceRun {
 public:
  DeviceRunner(const PipelineParts& parts, BackwardMode mode) : parts_(parts), mode_(mode) {}

  absl::Status Prepare(const LossProblem& problem) {
    LanePool::Lease lane(parts_.lanes);
    problem_ = problem;
    for (auto [view, copy] : {std::pair{&problem_.hidden, &x_}, std::pair{&problem_.weight, &w_}}) {
      FLCE_ASSIGN_OR_RETURN(*copy, lane->Allocate(view->bytes()));
      FLCE_RETURN_IF_ERROR(lane->Check(cudaMemcpyAsync(copy->data(), view->data, view->bytes(),
                                                       cudaMemcpyDefault, lane->stream()),
                                       "upload"));
      view->data = copy->data();
      view->space = MemorySpace::kCuda;
    }
    const int64_t elem = DTypeSize(problem_.hidden.dtype);
    const int64_t n = problem_.rows(), h = problem_.hidden_size(), v = problem_.vocab();
    FLCE_ASSIGN_OR_RETURN(dx_, lane->Allocate(n * h * elem));
    FLCE_ASSIGN_OR_RETURN(dw_, lane->Allocate(v * h * elem));
    if (problem_.bias) {
      FLCE_ASSIGN_OR_RETURN(db_, lane->Allocate(v * elem));
    }
    // The fp32 sums the gradients are made from: STORE_GRADS' state (dX,
    // dW) over several chunks; dX alone in one chunk (dW comes out of its
    // GEMM in its final dtype) and in RECOMPUTE.
    const bool fp32_dw = mode_ == BackwardMode::kStoreGrads &&
                         !KeepsChunkLogits(parts_.options, n, v, problem_.hidden.dtype);
    sums_bytes_ = fp32_dw ? (n * h + v * h) * 4 : n * h * 4;
    return lane->Synchronize("prepare");
  }

  absl::StatusOr<double> Run() override { return RunWith(nullptr); }

  absl::StatusOr<std::map<std::string, double>> RunStages() override {
    std::map<std::string, double> stages;
    FLCE_RETURN_IF_ERROR(RunWith(&stages).status());
    return stages;
  }

  int64_t gradient_bytes() const override {
    return dx_.bytes() + dw_.bytes() + db_.bytes() + sums_bytes_;
  }

 private:
  // One Forward + Backward as served, its device milliseconds; with
  // `stages`, also timed stage by stage into it.
  absl::StatusOr<double> RunWith(std::map<std::string, double>* stages) {
    LanePool::Lease lane(parts_.lanes);
    FLCE_RETURN_IF_ERROR(lane->health().status());
    std::optional<StageClock> clock;
    if (stages != nullptr) clock.emplace(lane->stream(), lane->health());
    const CancelFn no_cancel;
    const CallContext call{parts_.options, parts_.gemms, *lane, no_cancel,
                           clock ? &*clock : nullptr};
    EventTimer timer(lane->health());
    absl::StatusOr<float> ms = timer.Time(lane->stream(), [&]() -> absl::Status {
      Mark(call.clock, "start");
      FLCE_ASSIGN_OR_RETURN(DeviceInputs in, MakeDeviceInputs(*lane, problem_));
      ForwardSpec forward;
      forward.need_backward = true;
      forward.mode = mode_;
      FLCE_ASSIGN_OR_RETURN(
          DeviceForward fwd,
          ForwardOnDevice(call, std::make_shared<const DeviceInputs>(std::move(in)), forward));
      BackwardSpec backward;
      backward.last_use = true;
      backward.grad_hidden_to = GradientDestination{dx_.data(), MemorySpace::kCuda};
      backward.grad_weight_to = GradientDestination{dw_.data(), MemorySpace::kCuda};
      if (db_.bytes() > 0) {
        backward.grad_bias_to = GradientDestination{db_.data(), MemorySpace::kCuda};
      }
      return BackwardOnDevice(call, *fwd.result.saved, backward).status();
    });
    FLCE_RETURN_IF_ERROR(ms.status());
    if (stages != nullptr) *stages = clock->Totals();
    return static_cast<double>(*ms);
  }

  const PipelineParts parts_;
  const BackwardMode mode_;
  LossProblem problem_;        // X and W pointing at x_ and w_
  DeviceBuffer x_, w_;         // the inputs, uploaded once
  DeviceBuffer dx_, dw_, db_;  // the gradients' destinations (db_ with a bias only)
  int64_t sums_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRun>> PrepareDeviceRun(const PipelineParts& parts,
                                                            const LossProblem& problem,
                                                            BackwardMode mode) {
  auto run = std::make_unique<DeviceRunner>(parts, mode);
  FLCE_RETURN_IF_ERROR(run->Prepare(problem));
  return std::unique_ptr<DeviceRun>(std::move(run));
}

}  // namespace internal_cuda
}  // namespace flce
