#ifndef FLCE_KERNELS_ENGINE_CONFORMANCE_H_
#define FLCE_KERNELS_ENGINE_CONFORMANCE_H_

// The checks every LossEngine must pass, shared by the CPU and CUDA engine
// tests: Forward + Backward on random problems (odd sizes, every option,
// both backward modes, peaked and flat softmaxes) judged against the fp64
// reference with DESIGN.md's accuracy bar.

#include <string>
#include <vector>

#include "kernels/loss_engine.h"
#include "kernels/reference/random_problem.h"

namespace flce {

struct ConformanceCase {
  std::string name;
  RandomProblemSpec spec;
  BackwardMode mode = BackwardMode::kStoreGrads;
};

// A case of shape rows×hidden×vocab in `dtype` with `reduction` and `mode`.
ConformanceCase MakeCase(std::string name, int64_t n, int64_t h, int64_t v, DType dtype,
                         Reduction reduction, BackwardMode mode);

// Runs Forward (need_backward, lse, per-row loss) and Backward with a random
// grad_output, checks the results against the fp64 reference, the saved
// state's size against SavedStateBytes, and that a second Backward on a kept
// state gives the same bits. Reports through gtest assertions.
void RunConformanceCase(LossEngine& engine, const ConformanceCase& c);

// The same problem split into vocabulary shards of `shard_sizes` (summing
// to the case's vocabulary): each shard's Forward and Backward (with the
// global lse and a random grad_output; gradients in fp32), their statistics
// combined as VocabShard says, must equal the unsharded call of the same
// engine within fp32 rounding: the loss (every reduction), the valid and
// correct counts, dX summed over the shards, and each shard's rows of dW
// and db. A shard's Backward without global_lse is INVALID_ARGUMENT.
// `gradient_tolerance` bounds the gradients' relative L2 difference: fp32
// rounding (the default) for an engine whose logit gradient is fp32; an
// engine that rounds it to a half input dtype (the CUDA engine, in place
// over the logits) differs from its unsharded call by that rounding
// (ShardGradientTolerance).
void RunShardConformanceCase(LossEngine& engine, const ConformanceCase& c,
                             const std::vector<int64_t>& shard_sizes,
                             double gradient_tolerance = 1e-5);

// 1.5 units of roundoff of `dtype` for bf16 and fp16 (an element's logit
// gradient rounded differently by the shard's and the unsharded path:
// their lse differ in the last fp32 place, and the unsharded STORE_GRADS
// may round a rescaled form, the one-pass rows), 1e-5 for fp32.
double ShardGradientTolerance(DType dtype);

// Case lists, each for one dtype.
std::vector<ConformanceCase> OddSizeCases(DType dtype);     // 1x1x1 … 733x64x257
std::vector<ConformanceCase> EveryOptionCases(DType dtype); // all options at once
std::vector<ConformanceCase> EachOptionCases(DType dtype);  // one option at a time
std::vector<ConformanceCase> SoftmaxShapeCases(DType dtype);// peaked and flat
std::vector<ConformanceCase> LargeVocabularyCases(DType dtype);

}  // namespace flce

#endif  // FLCE_KERNELS_ENGINE_CONFORMANCE_H_
