#include "kernels/engine_conformance.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reference/accuracy.h"
#include "kernels/shard_combine.h"
#include "kernels/tensor.h"

namespace flce {

namespace {

std::vector<double> RandomGradOutput(const RandomProblemSpec& spec) {
  std::mt19937_64 rng(spec.seed + 99);
  std::uniform_real_distribution<double> dist(-2.0, 2.0);
  if (spec.options.reduction == Reduction::kNone) {
    std::vector<double> g(spec.rows);
    for (double& value : g) value = dist(rng);
    return g;
  }
  return {dist(rng)};
}

HostTensor GradOutputTensor(const std::vector<double>& g, Reduction reduction) {
  HostTensor t(DType::kFloat32, reduction == Reduction::kNone
                                    ? std::vector<int64_t>{static_cast<int64_t>(g.size())}
                                    : std::vector<int64_t>{});
  for (size_t i = 0; i < g.size(); ++i) {
    t.mutable_data<float>()[i] = static_cast<float>(g[i]);
  }
  return t;
}

}  // namespace

void RunConformanceCase(LossEngine& engine, const ConformanceCase& c) {
  SCOPED_TRACE(c.name);
  OwnedProblem p = MakeRandomProblem(c.spec);
  const LossProblem problem = p.view();
  ForwardSpec fs;
  fs.need_backward = true;
  fs.mode = c.mode;
  fs.want_lse = true;
  fs.want_per_row_loss = true;
  absl::StatusOr<ForwardResult> fwd = engine.Forward(problem, fs, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_NE(fwd->saved, nullptr);
  EXPECT_GT(fwd->saved->bytes(), 0);
  EXPECT_EQ(fwd->saved->bytes(), engine.SavedStateBytes(problem, c.mode));

  std::vector<double> g = RandomGradOutput(c.spec);
  // grad_output is sent as fp32: judge against the value actually sent.
  for (double& value : g) value = static_cast<float>(value);
  const HostTensor g_tensor = GradOutputTensor(g, c.spec.options.reduction);
  BackwardSpec bs;
  bs.grad_output = g_tensor.view();
  absl::StatusOr<Gradients> grads = engine.Backward(*fwd->saved, bs, nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();

  const EngineOutputs out = CollectOutputs(*fwd, &*grads);
  EXPECT_EQ(grads->grad_bias.has_value(), c.spec.bias);
  EXPECT_EQ(grads->grad_hidden.dtype, c.spec.dtype);
  const AccuracyReport report = CheckAccuracy(problem, g, out);
  EXPECT_TRUE(report.ok()) << report.ToString();

  // Backward leaves the state as it was: a second call gives the same bits.
  absl::StatusOr<Gradients> again = engine.Backward(*fwd->saved, bs, nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->grad_weight.data, grads->grad_weight.data);
  EXPECT_EQ(again->grad_hidden.data, grads->grad_hidden.data);

  // Written into caller memory instead, with dW and db in fp32 (as the
  // server's accumulator asks) and dX in the input dtype: the same values.
  BackwardSpec to = bs;
  to.weight_grad_dtype = DType::kFloat32;
  std::string dx(grads->grad_hidden.data.size(), '\0');
  std::vector<float> dw(static_cast<size_t>(grads->grad_weight.num_elements()));
  std::vector<float> db(static_cast<size_t>(c.spec.vocab));
  to.grad_hidden_to = GradientDestination{dx.data()};
  to.grad_weight_to = GradientDestination{dw.data()};
  if (c.spec.bias) to.grad_bias_to = GradientDestination{db.data()};
  absl::StatusOr<Gradients> written = engine.Backward(*fwd->saved, to, nullptr);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(written->grad_hidden.data.empty());
  EXPECT_TRUE(written->grad_weight.data.empty());
  EXPECT_EQ(written->grad_hidden.dtype, c.spec.dtype);
  EXPECT_EQ(written->grad_weight.dtype, DType::kFloat32);
  EXPECT_EQ(dx, grads->grad_hidden.data);
  auto narrow = [&](const std::vector<float>& values, int64_t count) {
    std::string out(static_cast<size_t>(count * DTypeSize(c.spec.dtype)), '\0');
    FromFloat(c.spec.dtype, values.data(), count, out.data());
    return out;
  };
  // dW may come from a GEMM rounding straight to the input dtype (the CUDA
  // engine's RECOMPUTE backward), whose fp32 twin can sum in another order:
  // within one unit in the last place of that dtype, element by element.
  {
    const int64_t count = grads->grad_weight.num_elements();
    const std::vector<float> rounded = TensorToFloats(grads->grad_weight.view());
    std::vector<float> mine(static_cast<size_t>(count));
    const std::string narrowed = narrow(dw, count);
    ToFloat(c.spec.dtype, narrowed.data(), count, mine.data());
    const int mantissa_bits = c.spec.dtype == DType::kBFloat16  ? 8
                              : c.spec.dtype == DType::kFloat16 ? 11
                                                                : 24;
    int mismatches = 0;
    for (int64_t i = 0; i < count; ++i) {
      const float a = mine[i], b = rounded[i];
      if (a == b) continue;
      // fp16's subnormals are spaced 2^-24 apart.
      const float ulp = std::fmax(
          std::ldexp(1.0f, std::ilogb(std::fmax(std::fabs(a), std::fabs(b))) -
                               (mantissa_bits - 1)),
          c.spec.dtype == DType::kFloat16 ? std::ldexp(1.0f, -24) : 0.0f);
      if (!(std::fabs(a - b) <= ulp) && ++mismatches <= 5) {
        ADD_FAILURE() << "dW[" << i << "]: fp32 destination narrows to " << a
                      << ", the input-dtype result is " << b;
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
  if (c.spec.bias) {
    EXPECT_TRUE(written->grad_bias->data.empty());
    EXPECT_EQ(narrow(db, c.spec.vocab), grads->grad_bias->data);
  }
}

ConformanceCase MakeCase(std::string name, int64_t n, int64_t h, int64_t v, DType dtype,
          Reduction reduction, BackwardMode mode) {
  ConformanceCase c;
  c.name = std::move(name);
  c.spec.rows = n;
  c.spec.hidden = h;
  c.spec.vocab = v;
  c.spec.dtype = dtype;
  c.spec.options.reduction = reduction;
  c.spec.seed = static_cast<uint64_t>(n * 131 + h * 17 + v);
  c.mode = mode;
  return c;
}

std::vector<ConformanceCase> OddSizeCases(DType dtype) {
  std::vector<ConformanceCase> cases;
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    for (Reduction reduction : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      if (mode == BackwardMode::kStoreGrads && reduction == Reduction::kNone) continue;
      const std::string tag = std::string(BackwardModeName(mode)) + "/" +
                              ReductionName(reduction) + "/" + DTypeName(dtype);
      cases.push_back(MakeCase("1x1x1 " + tag, 1, 1, 1, dtype, reduction, mode));
      cases.push_back(MakeCase("3x5x7 " + tag, 3, 5, 7, dtype, reduction, mode));
      cases.push_back(MakeCase("17x64x1000 " + tag, 17, 64, 1000, dtype, reduction, mode));
      cases.push_back(MakeCase("733x64x257 " + tag, 733, 64, 257, dtype, reduction, mode));
    }
  }
  return cases;
}

namespace {

double RelativeL2(const std::vector<double>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

}  // namespace

double ShardGradientTolerance(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 1.5 * std::ldexp(1.0, -8);
    case DType::kFloat16:
      return 1.5 * std::ldexp(1.0, -11);
    default:
      return 1e-5;
  }
}

void RunShardConformanceCase(LossEngine& engine, const ConformanceCase& c,
                             const std::vector<int64_t>& shard_sizes, double gradient_tolerance) {
  SCOPED_TRACE(c.name + " in " + std::to_string(shard_sizes.size()) + " shards");
  OwnedProblem p = MakeRandomProblem(c.spec);
  const LossProblem whole = p.view();
  const int64_t n = c.spec.rows, h = c.spec.hidden, v = c.spec.vocab;
  const LossOptions& o = c.spec.options;
  std::vector<double> g = RandomGradOutput(c.spec);
  for (double& value : g) value = static_cast<float>(value);
  const HostTensor g_tensor = GradOutputTensor(g, o.reduction);
  BackwardSpec bs;
  bs.grad_output = g_tensor.view();
  bs.grad_dtype = DType::kFloat32;

  // The whole vocabulary at once.
  ForwardSpec fs;
  fs.need_backward = true;
  fs.mode = o.reduction == Reduction::kNone ? BackwardMode::kRecompute : c.mode;
  absl::StatusOr<ForwardResult> fwd = engine.Forward(whole, fs, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  absl::StatusOr<Gradients> grads = engine.Backward(*fwd->saved, bs, nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();

  // Each shard's statistics.
  ForwardSpec shard_fs;
  shard_fs.need_backward = true;
  shard_fs.mode = c.mode;
  std::vector<ForwardResult> shards;
  std::vector<int64_t> firsts;
  int64_t first = 0;
  for (int64_t size : shard_sizes) {
    LossProblem part = whole;
    part.weight = RowSlice(whole.weight, first, size);
    if (whole.bias) part.bias = RowSlice(*whole.bias, first, size);
    part.shard = VocabShard{first, v};
    absl::StatusOr<ForwardResult> r = engine.Forward(part, shard_fs, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->shard_stats.has_value());
    EXPECT_EQ(r->num_valid, fwd->num_valid);
    EXPECT_EQ(r->saved->bytes(), engine.SavedStateBytes(part, c.mode));
    firsts.push_back(first);
    shards.push_back(*std::move(r));
    first += size;
  }
  ASSERT_EQ(first, v);

  // The combine (fp64), against the whole vocabulary's call.
  std::vector<const ShardStats*> stats;
  for (const ForwardResult& s : shards) stats.push_back(&*s.shard_stats);
  absl::StatusOr<CombinedShards> combined = CombineShards(whole, v, stats);
  ASSERT_TRUE(combined.ok()) << combined.status();
  const HostTensor& lse = combined->lse;
  EXPECT_EQ(combined->num_valid, fwd->num_valid);
  EXPECT_EQ(combined->num_correct, fwd->num_correct);
  const std::vector<float> loss = TensorToFloats(fwd->loss.view());
  if (o.reduction == Reduction::kNone) {
    EXPECT_LE(RelativeL2(combined->loss, loss), 1e-5);
  } else {
    double total = 0;
    for (double row : combined->loss) total += row;
    const double value = o.reduction == Reduction::kMean ? total / combined->denom : total;
    EXPECT_LE(std::fabs(value - loss[0]), 1e-5 * std::max(1.0, std::fabs(double{loss[0]})))
        << value << " against " << loss[0];
  }

  // Each shard's backward with the global lse: dX summed, dW and db placed.
  bs.global_lse = lse.view();
  std::vector<double> dx(static_cast<size_t>(n * h), 0.0), dw(static_cast<size_t>(v * h)),
      db(static_cast<size_t>(v));
  for (size_t s = 0; s < shards.size(); ++s) {
    absl::StatusOr<Gradients> part = engine.Backward(*shards[s].saved, bs, nullptr);
    ASSERT_TRUE(part.ok()) << part.status();
    const std::vector<float> pdx = TensorToFloats(part->grad_hidden.view());
    for (size_t k = 0; k < pdx.size(); ++k) dx[k] += pdx[k];
    const std::vector<float> pdw = TensorToFloats(part->grad_weight.view());
    std::copy(pdw.begin(), pdw.end(), dw.begin() + firsts[s] * h);
    if (part->grad_bias) {
      const std::vector<float> pdb = TensorToFloats(part->grad_bias->view());
      std::copy(pdb.begin(), pdb.end(), db.begin() + firsts[s]);
    }
  }
  EXPECT_LE(RelativeL2(dx, TensorToFloats(grads->grad_hidden.view())), gradient_tolerance);
  EXPECT_LE(RelativeL2(dw, TensorToFloats(grads->grad_weight.view())), gradient_tolerance);
  if (grads->grad_bias) {
    EXPECT_LE(RelativeL2(db, TensorToFloats(grads->grad_bias->view())), gradient_tolerance);
  }
  // Without the global lse a shard's state cannot make its gradients.
  BackwardSpec no_lse = bs;
  no_lse.global_lse.reset();
  EXPECT_EQ(engine.Backward(*shards[0].saved, no_lse, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::vector<ConformanceCase> EveryOptionCases(DType dtype) {
  std::vector<ConformanceCase> cases;
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    ConformanceCase c = MakeCase("all options", 37, 33, 1001, dtype, Reduction::kMean, mode);
    c.spec.bias = true;
    c.spec.class_weight = true;
    c.spec.ignore_fraction = 0.25;
    c.spec.target_dtype = DType::kInt32;
    c.spec.options.ignore_index = 5;
    c.spec.options.label_smoothing = 0.1f;
    c.spec.options.logit_softcap = 15.0f;
    c.spec.options.z_loss_scale = 1e-3f;
    cases.push_back(c);
  }
  return cases;
}

std::vector<ConformanceCase> EachOptionCases(DType dtype) {
  std::vector<ConformanceCase> cases;
  for (int option = 0; option < 6; ++option) {
    ConformanceCase c =
        MakeCase("option " + std::to_string(option), 29, 19, 503, dtype,
                 option % 2 ? Reduction::kSum : Reduction::kMean,
                 option % 3 ? BackwardMode::kStoreGrads : BackwardMode::kRecompute);
    switch (option) {
      case 0: c.spec.bias = true; break;
      case 1: c.spec.class_weight = true; break;
      case 2: c.spec.ignore_fraction = 0.5; break;
      case 3: c.spec.options.label_smoothing = 0.3f; break;
      case 4: c.spec.options.logit_softcap = 3.0f; break;
      case 5: c.spec.options.z_loss_scale = 0.1f; break;
    }
    cases.push_back(c);
  }
  return cases;
}

std::vector<ConformanceCase> SoftmaxShapeCases(DType dtype) {
  std::vector<ConformanceCase> cases;
  for (double scale : {0.01, 30.0}) {
    ConformanceCase c = MakeCase("scale " + std::to_string(scale), 41, 16, 777, dtype,
                                 Reduction::kMean, BackwardMode::kStoreGrads);
    c.spec.logit_scale = scale;
    cases.push_back(c);
  }
  return cases;
}

std::vector<ConformanceCase> LargeVocabularyCases(DType dtype) {
  std::vector<ConformanceCase> cases = {
      MakeCase("17x5x32003", 17, 5, 32003, dtype, Reduction::kMean, BackwardMode::kRecompute),
      // Long rows of whole 16-byte packs through STORE_GRADS.
      MakeCase("19x7x180000", 19, 7, 180000, dtype, Reduction::kSum,
               BackwardMode::kStoreGrads)};
  ConformanceCase all = MakeCase("all options 13x9x80000", 13, 9, 80000, dtype,
                                 Reduction::kMean, BackwardMode::kStoreGrads);
  all.spec.bias = true;
  all.spec.class_weight = true;
  all.spec.ignore_fraction = 0.25;
  all.spec.options.label_smoothing = 0.1f;
  all.spec.options.logit_softcap = 15.0f;
  all.spec.options.z_loss_scale = 1e-3f;
  cases.push_back(all);
  ConformanceCase ignored = MakeCase("half ignored 23x6x80000", 23, 6, 80000, dtype,
                                     Reduction::kMean, BackwardMode::kStoreGrads);
  ignored.spec.ignore_fraction = 0.5;
  ignored.spec.options.z_loss_scale = 1e-2f;
  cases.push_back(ignored);
  return cases;
}

}  // namespace flce
