#ifndef FLCE_KERNELS_SHARD_COMBINE_H_
#define FLCE_KERNELS_SHARD_COMBINE_H_

// The shards' statistics combined into the whole vocabulary's (VocabShard
// says the math): each row's lse, its loss terms and argmax, and the
// reduction's normaliser. In fp64; whoever holds every shard's statistics
// calls it (the sharded engine, tests; the Python helper does the same
// over a process group).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/loss_engine.h"

namespace flce {

struct CombinedShards {
  HostTensor lse;               // fp32 [N], for the shards' Backward
  std::vector<double> loss;     // [N] per row, z-loss included; 0 for ignored rows
  std::vector<double> z_loss;   // [N] the z-loss term alone
  double denom = 0;             // Σ w_t over non-ignored rows (mean's divisor)
  int64_t num_valid = 0;
  int64_t num_correct = 0;      // rows whose argmax over every shard is the target
};

// `shards`' statistics for `problem` (the whole one: targets, class
// weights [full_vocab], options; its weight's size is not used), in shard
// order. INVALID_ARGUMENT when they do not all have N rows.
absl::StatusOr<CombinedShards> CombineShards(const LossProblem& problem, int64_t full_vocab,
                                             const std::vector<const ShardStats*>& shards);

}  // namespace flce

#endif  // FLCE_KERNELS_SHARD_COMBINE_H_
