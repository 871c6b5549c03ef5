#ifndef FLCE_KERNELS_REFERENCE_ACCURACY_H_
#define FLCE_KERNELS_REFERENCE_ACCURACY_H_

// Judges an engine's results against the fp64 reference with DESIGN.md §3's
// bar: relative L2 error no worse than 1.5× that of the plain same-dtype
// computation (and ≤ 1e-5 for fp32 inputs).

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/loss_engine.h"

namespace flce {

// An engine's results as floats (from any transport).
struct EngineOutputs {
  std::vector<float> loss;  // 1 value (mean/sum) or N (none)
  std::vector<float> z_loss;
  std::vector<float> lse;   // N, or empty if not requested
  int64_t num_valid = 0;
  bool has_gradients = false;
  std::vector<float> grad_hidden, grad_weight, grad_bias;
};

inline std::vector<float> FloatsOf(const HostTensor& t) { return TensorToFloats(t.view()); }
inline std::vector<float> FloatsOf(const std::optional<HostTensor>& t) {
  return t ? TensorToFloats(t->view()) : std::vector<float>();
}

// Collects the floats of a Forward result and, when given, its gradients.
// Works for any result types with the engine's field names (ForwardResult
// and Gradients, or the client's RemoteForward and RemoteGradients).
template <typename ForwardLike, typename GradientsLike>
EngineOutputs CollectOutputs(const ForwardLike& fwd, const GradientsLike* grads) {
  EngineOutputs out;
  out.loss = TensorToFloats(fwd.loss.view());
  out.z_loss = TensorToFloats(fwd.z_loss.view());
  if (fwd.lse) out.lse = TensorToFloats(fwd.lse->view());
  out.num_valid = fwd.num_valid;
  if (grads != nullptr) {
    out.has_gradients = true;
    out.grad_hidden = FloatsOf(grads->grad_hidden);
    out.grad_weight = FloatsOf(grads->grad_weight);
    out.grad_bias = FloatsOf(grads->grad_bias);
  }
  return out;
}

struct AccuracyReport {
  struct Entry {
    std::string name;
    double error = 0;  // relative L2 error against fp64
    double bar = 0;
    // The plain same-dtype computation's error (PyTorch eager's rounding;
    // 0 for fp32 inputs, which have none).
    double plain = 0;
    bool ok() const { return error <= bar; }
    // error / plain: 1 = as accurate as eager; 0 when plain is 0.
    double vs_plain() const { return plain > 0 ? error / plain : 0.0; }
  };
  std::vector<Entry> entries;
  std::vector<std::string> mismatches;  // non-numeric disagreements

  bool ok() const;
  // One line per entry: "dX  err 1.2e-03  bar 3.9e-03  ok".
  std::string ToString() const;
};

// The bar for a result in `dtype` given the plain computation's error:
// fp32 1e-5; bf16/fp16 max(1.5 × plain_error, the dtype's unit roundoff).
double AccuracyBar(DType dtype, double plain_error);

// Compares `outputs` for `problem` and upstream `grad_output` (empty = 1)
// with the fp64 reference. `progress`, when given, is called with the
// fraction of the reference work done (it runs twice for bf16 and fp16: the
// exact values and the plain computation's).
AccuracyReport CheckAccuracy(const LossProblem& problem,
                             const std::vector<double>& grad_output,
                             const EngineOutputs& outputs,
                             const std::function<void(double)>& progress = {});

}  // namespace flce

#endif  // FLCE_KERNELS_REFERENCE_ACCURACY_H_
