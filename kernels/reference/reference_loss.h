#ifndef FLCE_KERNELS_REFERENCE_REFERENCE_LOSS_H_
#define FLCE_KERNELS_REFERENCE_REFERENCE_LOSS_H_

// The fp64 oracle: the loss and gradients of kernels/loss_engine.h computed
// in double precision, without tricks or shortcuts: the three matrix products
// by OpenBLAS's dgemm (fp64 throughout), the softmax row by row. Used by the
// tests, `flce smoke` and the benchmarks to judge the engines.

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/loss_engine.h"

namespace flce {

struct ReferenceResult {
  std::vector<double> loss;    // 1 value (mean/sum) or N (none)
  std::vector<double> z_loss;  // shaped like loss
  std::vector<double> lse;     // N
  std::vector<double> per_row_loss;  // N
  int64_t num_valid = 0;
  int64_t num_correct = 0;
  std::vector<double> grad_hidden;  // N*H
  std::vector<double> grad_weight;  // V*H
  std::vector<double> grad_bias;    // V (empty without bias)
};

// Computes everything in fp64 from the input values (exactly upcast).
// `grad_output`: empty means 1 everywhere; else 1 value (mean/sum) or N (none).
// With `plain_dtype` set, rounds where a plain same-dtype framework
// computation rounds (logits after the GEMM, the logits gradient, and every
// returned gradient), so its error against the exact result is the "plain
// computation" bar the engines must meet.
// `progress`, when given, is called with the fraction of rows done after
// each block of rows.
// REQUIRES: `problem` satisfies LossProblem's requirements.
ReferenceResult ComputeReference(const LossProblem& problem,
                                 const std::vector<double>& grad_output,
                                 std::optional<DType> plain_dtype = std::nullopt,
                                 const std::function<void(double)>& progress = {});

// ‖actual − expected‖₂ / ‖expected‖₂ (the absolute norm when ‖expected‖ is 0).
// NaN or infinite whenever a NaN appears on one side only or in the error.
double RelativeL2Error(const std::vector<float>& actual,
                       const std::vector<double>& expected);

}  // namespace flce

#endif  // FLCE_KERNELS_REFERENCE_REFERENCE_LOSS_H_
