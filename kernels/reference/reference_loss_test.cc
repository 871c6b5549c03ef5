// Checks the fp64 oracle itself: hand-computed cases, PyTorch's definitions
// of the reductions and label smoothing with class weights, and gradients
// against central finite differences of its own loss.

#include "kernels/reference/reference_loss.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reference/random_problem.h"

namespace flce {
namespace {

OwnedProblem TwoClassProblem() {
  // X = [1], W = [[0], [log 3]]: logits [0, log 3], softmax [1/4, 3/4].
  OwnedProblem p;
  p.hidden = HostTensor(DType::kFloat32, {1, 1});
  p.hidden.mutable_data<float>()[0] = 1.0f;
  p.weight = HostTensor(DType::kFloat32, {2, 1});
  p.weight.mutable_data<float>()[0] = 0.0f;
  p.weight.mutable_data<float>()[1] = static_cast<float>(std::log(3.0));
  p.target = HostTensor(DType::kInt64, {1});
  p.target.mutable_data<int64_t>()[0] = 1;
  return p;
}

TEST(ReferenceLossTest, TwoClassesByHand) {
  OwnedProblem p = TwoClassProblem();
  const double log3 = static_cast<float>(std::log(3.0));
  const ReferenceResult r = ComputeReference(p.view(), {});
  const double lse = std::log(1.0 + 3.0);
  EXPECT_NEAR(r.lse[0], std::log(1.0 + std::exp(log3)), 1e-12);
  EXPECT_NEAR(r.loss[0], lse - log3, 1e-6);
  const double p0 = 1.0 / (1.0 + std::exp(log3));
  EXPECT_NEAR(r.grad_weight[0], p0, 1e-12);
  EXPECT_NEAR(r.grad_weight[1], -p0, 1e-12);
  EXPECT_NEAR(r.grad_hidden[0], -p0 * log3, 1e-12);
  EXPECT_EQ(r.num_valid, 1);
  EXPECT_EQ(r.num_correct, 1);
}

// PyTorch: (1-ε)·nll_loss(logp, t, w, mean) + ε/V · Σ_rows Σ_j w_j·(−logp_j)
// / Σ_valid w_t, written out directly from log-softmax here.
TEST(ReferenceLossTest, LabelSmoothingWithClassWeightsFollowsPyTorch) {
  RandomProblemSpec spec;
  spec.rows = 9;
  spec.hidden = 5;
  spec.vocab = 7;
  spec.class_weight = true;
  spec.ignore_fraction = 0.3;
  spec.options.label_smoothing = 0.2f;
  spec.seed = 7;
  OwnedProblem p = MakeRandomProblem(spec);
  const ReferenceResult r = ComputeReference(p.view(), {});
  const float* x = p.hidden.data_as<float>();
  const float* w = p.weight.data_as<float>();
  const float* cw = p.class_weight->data_as<float>();
  const int64_t* t = p.target.data_as<int64_t>();
  double nll = 0, smooth = 0, denom = 0;
  for (int i = 0; i < 9; ++i) {
    if (t[i] == -100) continue;
    std::vector<double> z(7);
    double mx = -1e300;
    for (int j = 0; j < 7; ++j) {
      z[j] = 0;
      for (int k = 0; k < 5; ++k) z[j] += double{x[i * 5 + k]} * w[j * 5 + k];
      mx = std::max(mx, z[j]);
    }
    double se = 0;
    for (int j = 0; j < 7; ++j) se += std::exp(z[j] - mx);
    const double lse = mx + std::log(se);
    nll += cw[t[i]] * (lse - z[t[i]]);
    for (int j = 0; j < 7; ++j) smooth += cw[j] * (lse - z[j]);
    denom += cw[t[i]];
  }
  const double eps = 0.2f;  // the option travels as fp32
  const double expected = (1 - eps) * nll / denom + eps / 7 * smooth / denom;
  EXPECT_NEAR(r.loss[0], expected, 1e-12);
}

TEST(ReferenceLossTest, MeanOverNoValidRowsIsNaNAndSumIsZero) {
  RandomProblemSpec spec;
  spec.rows = 4;
  spec.ignore_fraction = 1.0;
  OwnedProblem p = MakeRandomProblem(spec);
  EXPECT_TRUE(std::isnan(ComputeReference(p.view(), {}).loss[0]));
  p.options.reduction = Reduction::kSum;
  const ReferenceResult r = ComputeReference(p.view(), {});
  EXPECT_EQ(r.loss[0], 0.0);
  for (double g : r.grad_hidden) EXPECT_EQ(g, 0.0);
}

TEST(ReferenceLossTest, NoRowsSumIsZero) {
  RandomProblemSpec spec;
  spec.rows = 0;
  spec.options.reduction = Reduction::kSum;
  OwnedProblem p = MakeRandomProblem(spec);
  const ReferenceResult r = ComputeReference(p.view(), {});
  EXPECT_EQ(r.loss[0], 0.0);
  for (double g : r.grad_weight) EXPECT_EQ(g, 0.0);
}

// Loss as a function of one perturbed input element, in fp64 throughout.
double LossWith(OwnedProblem& p, float* element, float value,
                const std::vector<double>& grad_output) {
  const float saved = *element;
  *element = value;
  const ReferenceResult r = ComputeReference(p.view(), {});
  *element = saved;
  double total = 0;
  for (size_t i = 0; i < r.loss.size(); ++i) {
    total += r.loss[i] * (grad_output.empty() ? 1.0 : grad_output[i]);
  }
  return total;
}

void ExpectGradientsMatchFiniteDifferences(Reduction reduction) {
  RandomProblemSpec spec;
  spec.rows = 5;
  spec.hidden = 3;
  spec.vocab = 6;
  spec.bias = true;
  spec.class_weight = true;
  spec.ignore_fraction = 0.2;
  spec.options.reduction = reduction;
  spec.options.label_smoothing = 0.1f;
  spec.options.logit_softcap = 2.5f;
  spec.options.z_loss_scale = 0.01f;
  spec.seed = 11;
  OwnedProblem p = MakeRandomProblem(spec);
  std::vector<double> grad_output;
  if (reduction == Reduction::kNone) {
    for (int i = 0; i < 5; ++i) grad_output.push_back(0.5 + 0.25 * i);
  } else {
    grad_output = {1.7};
  }
  const ReferenceResult r = ComputeReference(p.view(), grad_output);
  struct Case {
    HostTensor* tensor;
    const std::vector<double>* grad;
  };
  for (Case c : {Case{&p.hidden, &r.grad_hidden}, Case{&p.weight, &r.grad_weight},
                 Case{&*p.bias, &r.grad_bias}}) {
    float* data = c.tensor->mutable_data<float>();
    for (int64_t e = 0; e < c.tensor->num_elements(); ++e) {
      const float up = data[e] + 1e-3f, down = data[e] - 1e-3f;
      const double fd = (LossWith(p, &data[e], up, grad_output) -
                         LossWith(p, &data[e], down, grad_output)) /
                        (double{up} - double{down});
      EXPECT_NEAR((*c.grad)[e], fd, 1e-5 + 1e-4 * std::fabs(fd))
          << "element " << e;
    }
  }
}

TEST(ReferenceLossTest, GradientsMatchFiniteDifferencesMean) {
  ExpectGradientsMatchFiniteDifferences(Reduction::kMean);
}
TEST(ReferenceLossTest, GradientsMatchFiniteDifferencesSum) {
  ExpectGradientsMatchFiniteDifferences(Reduction::kSum);
}
TEST(ReferenceLossTest, GradientsMatchFiniteDifferencesNone) {
  ExpectGradientsMatchFiniteDifferences(Reduction::kNone);
}

TEST(ReferenceLossTest, RelativeErrorTreatsNaNOnOneSideAsFailure) {
  EXPECT_TRUE(std::isnan(RelativeL2Error({NAN, 1.0f}, {1.0, 1.0})));
  EXPECT_EQ(RelativeL2Error({NAN, 1.0f}, {NAN, 1.0}), 0.0);
  EXPECT_NEAR(RelativeL2Error({1.1f}, {1.0}), 0.1, 1e-6);
}

}  // namespace
}  // namespace flce
