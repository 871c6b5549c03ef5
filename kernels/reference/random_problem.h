#ifndef FLCE_KERNELS_REFERENCE_RANDOM_PROBLEM_H_
#define FLCE_KERNELS_REFERENCE_RANDOM_PROBLEM_H_

// Random loss problems for tests, `flce smoke` and benchmarks.

#include <cstdint>
#include <optional>

#include "kernels/loss_engine.h"
#include "kernels/tensor.h"

namespace flce {

struct RandomProblemSpec {
  int64_t rows = 17;
  int64_t hidden = 64;
  int64_t vocab = 1000;
  DType dtype = DType::kFloat32;
  DType target_dtype = DType::kInt64;
  // Standard deviation of the logits: small is a flat softmax, large
  // (e.g. 30) a peaked one.
  double logit_scale = 2.0;
  double ignore_fraction = 0.0;  // rows whose target is ignore_index
  bool bias = false;
  bool class_weight = false;     // random weights in [0.25, 2)
  LossOptions options;
  uint64_t seed = 1;
  // Uniform values of the same standard deviation from a counter-based
  // generator: about 20× faster, for benchmark-sized tensors.
  bool fast_fill = false;
};

OwnedProblem MakeRandomProblem(const RandomProblemSpec& spec);

}  // namespace flce

#endif  // FLCE_KERNELS_REFERENCE_RANDOM_PROBLEM_H_
