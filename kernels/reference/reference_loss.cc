#include "kernels/reference/reference_loss.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace flce {
namespace {

double Round(std::optional<DType> dtype, double value) {
  if (!dtype.has_value()) return value;
  return RoundTo(*dtype, static_cast<float>(value));
}

std::vector<double> ToDoubles(const TensorView& view) {
  std::vector<float> f = TensorToFloats(view);
  return std::vector<double>(f.begin(), f.end());
}

int64_t TargetAt(const TensorView& target, int64_t i) {
  if (target.dtype == DType::kInt32) {
    return static_cast<const int32_t*>(target.data)[i];
  }
  return static_cast<const int64_t*>(target.data)[i];
}

}  // namespace

ReferenceResult ComputeReference(const LossProblem& p,
                                 const std::vector<double>& grad_output,
                                 std::optional<DType> plain_dtype,
                                 const std::function<void(double)>& progress) {
  const int64_t n = p.rows(), h = p.hidden_size(), v = p.vocab();
  const LossOptions& o = p.options;
  const std::vector<double> x = ToDoubles(p.hidden);
  const std::vector<double> w = ToDoubles(p.weight);
  const std::vector<double> b =
      p.bias ? ToDoubles(*p.bias) : std::vector<double>();
  const std::vector<double> cw =
      p.class_weight ? ToDoubles(*p.class_weight) : std::vector<double>(v, 1.0);
  const double eps = o.label_smoothing;
  const double s = o.z_loss_scale;
  double cw_sum = 0;
  for (double c : cw) cw_sum += c;

  ReferenceResult r;
  r.lse.assign(n, 0.0);
  r.per_row_loss.assign(n, 0.0);
  std::vector<double> z_row(n, 0.0);
  double denom = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = TargetAt(p.target, i);
    if (t != o.ignore_index) {
      ++r.num_valid;
      denom += cw[t];
    }
  }
  if (o.reduction != Reduction::kMean) denom = 1.0;

  r.grad_hidden.assign(n * h, 0.0);
  r.grad_weight.assign(v * h, 0.0);
  if (p.bias) r.grad_bias.assign(v, 0.0);
  // A block of rows at a time: its logits Z = X Wᵀ (+ b) and their gradient
  // dZ, each [rows, V] in fp64.
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(n, (int64_t{8} << 20) / v));
  std::vector<double> z(block * v), dz(block * v), zc(v);
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    const int64_t rows = std::min(block, n - i0);
    // Row-major Z[rows, V] = X[i0 : i0 + rows, H] · W[V, H]ᵀ.
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, v, h, 1.0, &x[i0 * h], h,
                w.data(), h, 0.0, z.data(), v);
    std::fill(dz.begin(), dz.begin() + rows * v, 0.0);
    for (int64_t r_i = 0; r_i < rows; ++r_i) {
      const int64_t i = i0 + r_i;
      double* zi = &z[r_i * v];
      double* dzi = &dz[r_i * v];
      for (int64_t j = 0; j < v; ++j) {
        zi[j] = Round(plain_dtype, p.bias ? zi[j] + b[j] : zi[j]);
        zc[j] = o.logit_softcap ? *o.logit_softcap * std::tanh(zi[j] / *o.logit_softcap)
                                : zi[j];
      }
      double m = -std::numeric_limits<double>::infinity();
      int64_t argmax = 0;
      for (int64_t j = 0; j < v; ++j) {
        if (zc[j] > m) {
          m = zc[j];
          argmax = j;
        }
      }
      double se = 0;
      for (int64_t j = 0; j < v; ++j) se += std::exp(zc[j] - m);
      const double lse = m + std::log(se);
      r.lse[i] = lse;
      const int64_t t = TargetAt(p.target, i);
      if (t == o.ignore_index) continue;  // its dZ row stays 0
      if (argmax == t) ++r.num_correct;
      double smooth = 0;
      for (int64_t j = 0; j < v; ++j) smooth += cw[j] * (lse - zc[j]);
      const double wt = cw[t];
      z_row[i] = s * lse * lse;
      r.per_row_loss[i] = (1 - eps) * wt * (lse - zc[t]) + eps / v * smooth + z_row[i];

      double g = 1.0;
      if (!grad_output.empty()) {
        g = grad_output.size() == 1 ? grad_output[0] : grad_output[i];
      }
      g /= denom;
      for (int64_t j = 0; j < v; ++j) {
        const double prob = std::exp(zc[j] - lse);
        double d = (1 - eps) * wt * (prob - (j == t ? 1.0 : 0.0)) +
                   eps / v * (cw_sum * prob - cw[j]) + 2 * s * lse * prob;
        if (o.logit_softcap) {
          const double q = zc[j] / *o.logit_softcap;
          d *= 1 - q * q;
        }
        dzi[j] = Round(plain_dtype, d * g);
      }
      if (p.bias) {
        for (int64_t j = 0; j < v; ++j) r.grad_bias[j] += dzi[j];
      }
    }
    // dX[i0 : i0 + rows, H] = dZ[rows, V] · W[V, H].
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, h, v, 1.0, dz.data(), v,
                w.data(), h, 0.0, &r.grad_hidden[i0 * h], h);
    // dW[V, H] += dZ[rows, V]ᵀ · X[i0 : i0 + rows, H].
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, rows, 1.0, dz.data(), v,
                &x[i0 * h], h, 1.0, r.grad_weight.data(), h);
    if (progress) progress(static_cast<double>(i0 + rows) / n);
  }
  for (double& value : r.grad_hidden) value = Round(plain_dtype, value);
  for (double& value : r.grad_weight) value = Round(plain_dtype, value);
  for (double& value : r.grad_bias) value = Round(plain_dtype, value);

  if (o.reduction == Reduction::kNone) {
    r.loss = r.per_row_loss;
    r.z_loss = z_row;
  } else {
    double total = 0, z_total = 0;
    for (int64_t i = 0; i < n; ++i) {
      total += r.per_row_loss[i];
      z_total += z_row[i];
    }
    r.loss = {total / denom};
    r.z_loss = {z_total / denom};
  }
  return r;
}

double RelativeL2Error(const std::vector<float>& actual,
                       const std::vector<double>& expected) {
  if (actual.size() != expected.size()) {
    return std::numeric_limits<double>::infinity();
  }
  double err = 0, ref = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const bool a_nan = std::isnan(actual[i]), e_nan = std::isnan(expected[i]);
    if (a_nan && e_nan) continue;
    if (a_nan != e_nan) return std::numeric_limits<double>::quiet_NaN();
    if (std::isinf(actual[i]) || std::isinf(expected[i])) {
      if (actual[i] == expected[i]) continue;
      return std::numeric_limits<double>::infinity();
    }
    const double d = actual[i] - expected[i];
    err += d * d;
    ref += expected[i] * expected[i];
  }
  return ref > 0 ? std::sqrt(err / ref) : std::sqrt(err);
}

}  // namespace flce
