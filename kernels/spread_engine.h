#ifndef FLCE_KERNELS_SPREAD_ENGINE_H_
#define FLCE_KERNELS_SPREAD_ENGINE_H_

// A LossEngine over several engines (one per device) that gives each
// request to one of them whole: a Forward to the engine with the fewest
// calls in flight (ties taken in turn, so that sessions spread when calls
// come one at a time), its session's Backward to the same engine. The
// other way a server uses several devices, beside sharding every problem
// over them (kernels/sharded_engine.h): more requests at once, each at one
// device's speed. Offers no device memory (its engines' devices differ),
// so a server over it reads and writes tensors in host memory; but a
// registered weight is kept whole on every device (WeightParts: a replica
// per engine), each request reading its engine's replica and adding its dW
// into that replica's sums (the take adds the replicas' sums together).

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "kernels/loss_engine.h"

namespace flce {

class SpreadEngine : public LossEngine {
 public:
  // REQUIRES: engines non-empty, of one backend.
  explicit SpreadEngine(std::vector<std::unique_ptr<LossEngine>> engines);

  std::string backend() const override { return engines_[0]->backend(); }
  std::vector<DeviceInfo> devices() const override;
  int64_t device_memory_bytes() const override;
  int64_t forward_reruns() const override;
  bool supports_vocab_shards() const override;
  absl::Status health() const override;
  DeviceMemory* host_locker() const override { return engines_[0]->host_locker(); }

  // A part per engine, each the whole vocabulary, in its engine's memory.
  std::vector<WeightPart> WeightParts(int64_t vocab) const override;

  int64_t SavedStateBytes(const LossProblem& problem, BackwardMode mode) const override;
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override;
  absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                     const CancelFn& cancelled) override;

 private:
  // The engine for the next Forward.
  int Pick();

  std::vector<std::unique_ptr<LossEngine>> engines_;
  std::unique_ptr<std::atomic<int>[]> in_flight_;
  std::atomic<int> next_{0};
};

}  // namespace flce

#endif  // FLCE_KERNELS_SPREAD_ENGINE_H_
