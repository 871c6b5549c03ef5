#include "kernels/reference/accuracy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "kernels/reference/reference_loss.h"

namespace flce {

double AccuracyBar(DType dtype, double plain_error) {
  if (std::isnan(plain_error)) plain_error = 0;
  switch (dtype) {
    case DType::kBFloat16:
      return std::max(1.5 * plain_error, std::ldexp(1.0, -8));
    case DType::kFloat16:
      return std::max(1.5 * plain_error, std::ldexp(1.0, -11));
    default:
      return 1e-5;
  }
}

bool AccuracyReport::ok() const {
  if (!mismatches.empty()) return false;
  for (const Entry& e : entries) {
    if (!e.ok()) return false;
  }
  return true;
}

std::string AccuracyReport::ToString() const {
  std::string out;
  char line[160];
  for (const Entry& e : entries) {
    std::snprintf(line, sizeof(line), "%-8s err %.3e  bar %.3e  %s\n",
                  e.name.c_str(), e.error, e.bar, e.ok() ? "ok" : "FAIL");
    out += line;
  }
  for (const std::string& m : mismatches) out += m + "\n";
  return out;
}

AccuracyReport CheckAccuracy(const LossProblem& problem,
                             const std::vector<double>& grad_output,
                             const EngineOutputs& outputs,
                             const std::function<void(double)>& progress) {
  const DType dtype = problem.hidden.dtype;
  const bool two = dtype != DType::kFloat32;
  auto part = [&](double offset) -> std::function<void(double)> {
    if (!progress) return {};
    return [&progress, offset, two](double f) { progress(two ? offset + f / 2 : f); };
  };
  const ReferenceResult exact = ComputeReference(problem, grad_output, std::nullopt, part(0));
  std::optional<ReferenceResult> plain;
  if (two) plain = ComputeReference(problem, grad_output, dtype, part(0.5));
  AccuracyReport report;
  auto add = [&](const char* name, const std::vector<float>& actual,
                 const std::vector<double>& expected,
                 const std::vector<double>* plain_values, DType result_dtype) {
    AccuracyReport::Entry e;
    e.name = name;
    e.error = RelativeL2Error(actual, expected);
    double plain_error = 0;
    if (plain_values) {
      std::vector<float> p(plain_values->begin(), plain_values->end());
      plain_error = RelativeL2Error(p, expected);
    }
    e.bar = AccuracyBar(result_dtype, plain_error);
    e.plain = plain_error;
    report.entries.push_back(e);
  };
  // The loss is fp32 whatever the input dtype; its bar still follows the
  // plain computation in the input dtype.
  add("loss", outputs.loss, exact.loss, plain ? &plain->loss : nullptr, dtype);
  add("z_loss", outputs.z_loss, exact.z_loss, plain ? &plain->z_loss : nullptr,
      dtype);
  if (!outputs.lse.empty()) {
    add("lse", outputs.lse, exact.lse, plain ? &plain->lse : nullptr, dtype);
  }
  if (outputs.num_valid != exact.num_valid) {
    report.mismatches.push_back("num_valid " + std::to_string(outputs.num_valid) +
                                " != " + std::to_string(exact.num_valid));
  }
  if (outputs.has_gradients) {
    add("dX", outputs.grad_hidden, exact.grad_hidden,
        plain ? &plain->grad_hidden : nullptr, dtype);
    add("dW", outputs.grad_weight, exact.grad_weight,
        plain ? &plain->grad_weight : nullptr, dtype);
    if (problem.bias) {
      add("db", outputs.grad_bias, exact.grad_bias,
          plain ? &plain->grad_bias : nullptr, dtype);
    }
  }
  return report;
}

}  // namespace flce
