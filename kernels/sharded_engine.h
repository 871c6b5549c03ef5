#ifndef FLCE_KERNELS_SHARDED_ENGINE_H_
#define FLCE_KERNELS_SHARDED_ENGINE_H_

// A LossEngine that computes every problem in vocabulary shards: the
// weight's rows split into `shards` nearly equal parts, shard k computed by
// engines[k % engines.size()] (each must support shards), their statistics
// combined here (CombineShards) into the loss, lse and counts, and Backward
// run on every shard with the global lse: dX the sum of the shards' parts
// (each shard adds its fp32 part to the sum of those before it,
// BackwardSpec::grad_hidden_addend, and the last rounds it once), dW and db
// each shard's rows written in place into the whole's. It is the path a
// server with one engine per device takes, so it runs — and is tested —
// with one engine too (several shards on it, on the CPU or on one GPU: the
// sum of dX then stays in the device's memory).
//
// Over several engines (one per device), the shards of different engines
// run at once, a thread each, and each engine sums its shards' parts of dX
// in its own memory; the sums meet through a collective (PartialSum: NCCL
// over devices, a device-local add for engines sharing one device, host
// adds for CPU engines) while engine 0's last shard makes its own part,
// which then adds the total and rounds it once. There X and W come from
// host memory and the gradients go to host memory (FAILED_PRECONDITION
// otherwise); over one engine, the caller chooses (host or device memory,
// as the engine takes them). A problem that is itself a shard goes to the
// first engine whole.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/loss_engine.h"
#include "kernels/partial_sum.h"

namespace flce {

class ShardedEngine : public LossEngine {
 public:
  // REQUIRES: engines non-empty, each supports_vocab_shards(); shards >= 1.
  // `sum`: the collective over several engines' memories (may be null for
  // one engine; for several engines without devices, host adds by default).
  ShardedEngine(std::vector<std::unique_ptr<LossEngine>> engines, int shards,
                std::unique_ptr<PartialSum> sum = nullptr);

  std::string backend() const override { return engines_[0]->backend(); }
  std::vector<DeviceInfo> devices() const override;
  int64_t device_memory_bytes() const override;
  bool supports_vocab_shards() const override { return true; }
  absl::Status health() const override;
  DeviceMemory* host_locker() const override { return engines_[0]->host_locker(); }
  // The one engine's device memory (its shards all live there); none over
  // several engines.
  DeviceMemory* device_memory() const override {
    return engines_.size() == 1 ? engines_[0]->device_memory() : nullptr;
  }
  int shards() const { return shards_; }
  // Over several engines a part per shard, in its engine's memory; over
  // one, that engine's parts (its shards are slices of them).
  std::vector<WeightPart> WeightParts(int64_t vocab) const override;

  // Wall-clock ms of the last call's combining (for benchmarks): the
  // statistics' combine in Forward; in Backward, engine 0's wait for the
  // other engines' sums of dX and the collective adding them.
  struct CombineTimes {
    double stats_ms = 0, dx_wait_ms = 0, dx_sum_ms = 0;
  };
  CombineTimes last_combine_times() const;

  int64_t SavedStateBytes(const LossProblem& problem, BackwardMode mode) const override;
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override;
  absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                     const CancelFn& cancelled) override;

 private:
  // Shard k of `problem`: its rows of the weight and bias.
  LossProblem Shard(const LossProblem& problem, int k) const;
  int Count(int64_t vocab) const;  // shards for this vocabulary
  // Shard k's rows of a vocabulary: [first, last).
  std::pair<int64_t, int64_t> Rows(int64_t vocab, int k) const;
  LossEngine& EngineOf(int k) const { return *engines_[k % engines_.size()]; }
  // run(k) for shards k < count: each engine's shards in turn, different
  // engines' at once (a thread per engine beyond the first). The first error.
  absl::Status ForEachEngine(int count, const std::function<absl::Status(int)>& run) const;

  std::vector<std::unique_ptr<LossEngine>> engines_;
  const int shards_;
  std::unique_ptr<PartialSum> sum_;
  std::atomic<double> stats_ms_{0}, dx_wait_ms_{0}, dx_sum_ms_{0};
};

}  // namespace flce

#endif  // FLCE_KERNELS_SHARDED_ENGINE_H_
