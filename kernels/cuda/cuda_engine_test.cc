// The CUDA engine against the fp64 reference and the CPU engine. Tagged
// `gpu`: skips without a device, fails without one when REQUIRE_GPU=1.

#include "kernels/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/cuda/cuda_test_support.h"
#include "kernels/dtype.h"
#include "kernels/engine_conformance.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"
#include "kernels/reference/reference_loss.h"
#include "kernels/tensor.h"

namespace flce {
namespace {

using cuda_test::DeviceBytes;
using cuda_test::Engine;
using cuda_test::Layout;
using cuda_test::RequireGpu;

class CudaEngineTest : public ::testing::TestWithParam<std::tuple<DType, Layout>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  void RunAll(const std::vector<ConformanceCase>& cases) {
    FLCE_GET_ENGINE_OR_SKIP(engine, std::get<1>(GetParam()));
    for (const ConformanceCase& c : cases) RunConformanceCase(*engine, c);
  }
};

TEST_P(CudaEngineTest, OddSizesBothModesAllReductions) { RunAll(OddSizeCases(dtype())); }
TEST_P(CudaEngineTest, EveryOptionTogether) { RunAll(EveryOptionCases(dtype())); }
TEST_P(CudaEngineTest, EachOptionAlone) { RunAll(EachOptionCases(dtype())); }
TEST_P(CudaEngineTest, PeakedAndFlatSoftmaxes) { RunAll(SoftmaxShapeCases(dtype())); }
TEST_P(CudaEngineTest, LargeVocabulary) { RunAll(LargeVocabularyCases(dtype())); }

INSTANTIATE_TEST_SUITE_P(
    AllDTypes, CudaEngineTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(Layout::kTokenChunks, Layout::kVocabularySlices,
                                         Layout::kOneChunk)),
    [](const auto& info) {
      return cuda_test::DTypeLayoutName(std::get<0>(info.param), std::get<1>(info.param));
    });

// The benchmark's stage timing names every stage of a run and times each.
TEST(CudaEngineSemanticsTest, DeviceRunTimesItsStages) {
  for (Layout layout : {Layout::kTokenChunks, Layout::kVocabularySlices}) {
    FLCE_GET_ENGINE_OR_SKIP(engine, layout);
    RandomProblemSpec spec;
    spec.rows = 300;
    spec.hidden = 32;
    spec.vocab = 2000;
    spec.dtype = DType::kBFloat16;
    const OwnedProblem p = MakeRandomProblem(spec);
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      SCOPED_TRACE(BackwardModeName(mode));
      auto run = engine->PrepareDeviceRun(p.view(), mode);
      ASSERT_TRUE(run.ok()) << run.status();
      auto stages = (*run)->RunStages();
      ASSERT_TRUE(stages.ok()) << stages.status();
      for (const char* stage : {"logits GEMM", "row kernel", "dX GEMM", "narrowing dX"}) {
        ASSERT_EQ(stages->count(stage), 1u) << stage;
        EXPECT_GT(stages->at(stage), 0.0) << stage;
      }
      const char* dw = mode == BackwardMode::kStoreGrads     ? "dW GEMM, fp32, beta 1"
                       : layout == Layout::kVocabularySlices ? "dW GEMM, final dtype"
                                                             : "dW GEMM, fp32, beta 1";
      EXPECT_EQ(stages->count(dw), 1u) << dw;
      absl::StatusOr<double> ms = (*run)->Run();
      ASSERT_TRUE(ms.ok()) << ms.status();
      EXPECT_GT(*ms, 0.0);  // device milliseconds
    }
  }
}

// STORE_GRADS of a problem whose rows fit one token chunk keeps its logits
// (N·V in the input dtype), not fp32 gradients, and its Backward runs the
// gradient GEMMs: dX alone and then dW alone on the kept state give the
// bits of one Backward with both, for grad_output 1 and 3, and the results
// equal those of the same problem cut into several chunks (fp32 gradients
// summed over the chunks) within the dtype's rounding.
TEST(CudaEngineSemanticsTest, StoreGradsOfOneChunkKeepsTheLogits) {
  // The suite's engine cuts these 300 rows into chunks of 64; one with the
  // default budget takes them in one.
  FLCE_GET_ENGINE_OR_SKIP(chunked_engine);
  CudaEngine* const chunked = chunked_engine;
  auto whole = CudaEngine::Create(CudaEngineOptions());
  ASSERT_TRUE(whole.ok()) << whole.status();
  CudaEngine* const engine = whole->get();
  RandomProblemSpec spec;
  spec.rows = 300;
  spec.hidden = 48;
  spec.vocab = 2003;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  spec.options.z_loss_scale = 1e-3f;
  const OwnedProblem p = MakeRandomProblem(spec);
  const int64_t n = spec.rows, h = spec.hidden, v = spec.vocab;
  ForwardSpec fs;
  fs.need_backward = true;
  fs.mode = BackwardMode::kStoreGrads;
  auto kept = engine->Forward(p.view(), fs, nullptr);
  auto several = chunked->Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(kept.ok() && several.ok());
  EXPECT_EQ(kept->loss.data, several->loss.data);
  EXPECT_EQ(kept->saved->bytes(), engine->SavedStateBytes(p.view(), fs.mode));
  EXPECT_GE(kept->saved->bytes(), n * v * 2);
  EXPECT_LT(kept->saved->bytes(), (n * h + v * h + v) * 4 + n * v * 2);
  EXPECT_EQ(several->saved->bytes(), (n * h + v * h + v) * int64_t{4});  // the fp32 gradients
  for (float g : {1.0f, 3.0f}) {
    SCOPED_TRACE(g);
    HostTensor g_tensor(DType::kFloat32, {});
    g_tensor.mutable_data<float>()[0] = g;
    BackwardSpec all;
    all.grad_output = g_tensor.view();
    BackwardSpec hidden = all, weight = all;
    hidden.hidden_grad_only = true;
    weight.weight_grads_only = true;
    auto both = engine->Backward(*kept->saved, all, nullptr);
    auto dx = engine->Backward(*kept->saved, hidden, nullptr);
    auto dw = engine->Backward(*kept->saved, weight, nullptr);
    auto fp32 = chunked->Backward(*several->saved, all, nullptr);
    ASSERT_TRUE(both.ok() && dx.ok() && dw.ok() && fp32.ok());
    EXPECT_EQ(dx->grad_hidden.data, both->grad_hidden.data);
    EXPECT_EQ(dw->grad_weight.data, both->grad_weight.data);
    ASSERT_TRUE(dw->grad_bias && both->grad_bias);
    EXPECT_EQ(dw->grad_bias->data, both->grad_bias->data);
    // The same gradients as the chunked engine's, to bf16's rounding.
    auto close = [](const HostTensor& got, const HostTensor& want) {
      const std::vector<float> a = TensorToFloats(got.view()), b = TensorToFloats(want.view());
      return RelativeL2Error(a, std::vector<double>(b.begin(), b.end()));
    };
    EXPECT_LT(close(both->grad_hidden, fp32->grad_hidden), 4e-3);
    EXPECT_LT(close(both->grad_weight, fp32->grad_weight), 4e-3);
    EXPECT_LT(close(*both->grad_bias, *fp32->grad_bias), 4e-3);
  }
}

// The bytes of every result of a Forward + Backward of `p` per upstream
// gradient in `grad_outputs`, one call each, in turn: loss, dX, dW, db
// ("" without a bias). Empty where a call failed (the test fails too).
std::vector<std::string> ResultBytes(CudaEngine& engine, const OwnedProblem& p,
                                     const ForwardSpec& fs, const std::vector<float>& grad_outputs) {
  std::vector<std::string> out;
  for (float g : grad_outputs) {
    HostTensor g_tensor(DType::kFloat32, {});
    g_tensor.mutable_data<float>()[0] = g;
    BackwardSpec backward;
    backward.grad_output = g_tensor.view();
    auto fwd = engine.Forward(p.view(), fs, nullptr);
    EXPECT_TRUE(fwd.ok()) << fwd.status();
    if (!fwd.ok()) return {};
    auto grads = engine.Backward(*fwd->saved, backward, nullptr);
    EXPECT_TRUE(grads.ok()) << grads.status();
    if (!grads.ok()) return {};
    out.push_back(fwd->loss.data);
    out.push_back(grads->grad_hidden.data);
    out.push_back(grads->grad_weight.data);
    out.push_back(grads->grad_bias ? grads->grad_bias->data : "");
  }
  return out;
}

// Tuning the GEMMs' algorithms changes no bit of any result: an engine
// that tunes and one that runs cuBLAS's defaults agree exactly, both modes,
// several token chunks (their logits GEMMs tuned at the first call).
TEST(CudaEngineSemanticsTest, TunedGemmsChangeNoBit) {
  FLCE_GET_ENGINE_OR_SKIP(any_engine);
  auto make = [](bool tune) {
    CudaEngineOptions options;
    options.chunk_bytes = 32 << 20;  // 838 rows of 20011 bf16 logits: 3 chunks
    options.tune_gemms = tune;
    return CudaEngine::Create(options);
  };
  auto tuned = make(true), plain = make(false);
  ASSERT_TRUE(tuned.ok() && plain.ok());
  RandomProblemSpec spec;
  spec.rows = 2000;  // chunk GEMMs of 2.7e10 FLOP: above GemmTuning::min_flop
  spec.hidden = 1024;
  spec.vocab = 20011;
  spec.dtype = DType::kBFloat16;
  spec.options.z_loss_scale = 1e-4f;
  const OwnedProblem p = MakeRandomProblem(spec);
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    // The first call tunes, the second reuses.
    const std::vector<std::string> want = ResultBytes(**plain, p, fs, {1.0f, 1.0f}),
                                   got = ResultBytes(**tuned, p, fs, {1.0f, 1.0f});
    EXPECT_GT((*tuned)->tuned_gemm_shapes(), 0);
    EXPECT_EQ((*plain)->tuned_gemm_shapes(), 0);
    ASSERT_EQ(want.size(), 8u);
    ASSERT_EQ(got.size(), 8u);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(want[i] == got[i]) << "result " << i;
  }
}

// flce's Hopper GEMM for the logits, dX and dW GEMMs changes no bit of any
// result (it runs a shape only where its output is cuBLAS's default's,
// checked at the shape's first call): against cuBLAS alone, both modes,
// token chunks (dW summed over them, added by the TMA), one kept chunk (dW
// in bf16 from its GEMM) and RECOMPUTE's vocabulary slices, upstream
// gradients 1 and 0.5, two calls each (the first checks, the second runs
// the choice). Skips off Hopper.
TEST(CudaEngineSemanticsTest, HopperGemmsChangeNoBit) {
  FLCE_SKIP_OFF_HOPPER();
  RandomProblemSpec spec;
  spec.rows = 2048;
  spec.hidden = 1024;
  spec.vocab = 32000;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  spec.options.z_loss_scale = 1e-4f;
  spec.fast_fill = true;
  const OwnedProblem p = MakeRandomProblem(spec);
  struct Layouts {
    const char* name;
    int64_t chunk_bytes, min_slice_columns;
  };
  const Layouts layouts[] = {
      {"token chunks", 32 << 20, int64_t{1} << 40},  // 524 rows of 32000 bf16 logits
      {"one chunk", CudaEngineOptions().chunk_bytes, int64_t{1} << 40},
      {"vocabulary slices", 32 << 20, 2048},
  };
  for (const Layouts& layout : layouts) {
    SCOPED_TRACE(layout.name);
    auto make = [&](bool hopper) {
      CudaEngineOptions options;
      options.chunk_bytes = layout.chunk_bytes;
      options.min_slice_columns = layout.min_slice_columns;
      options.tune_gemms = false;
      options.hopper_gemms = {hopper, hopper, hopper};
      return CudaEngine::Create(options);
    };
    auto own = make(true), plain = make(false);
    ASSERT_TRUE(own.ok() && plain.ok());
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      SCOPED_TRACE(BackwardModeName(mode));
      ForwardSpec fs;
      fs.need_backward = true;
      fs.mode = mode;
      const std::vector<std::string> want = ResultBytes(**plain, p, fs, {1.0f, 0.5f, 1.0f}),
                                     got = ResultBytes(**own, p, fs, {1.0f, 0.5f, 1.0f});
      ASSERT_EQ(want.size(), 12u);
      ASSERT_EQ(got.size(), 12u);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(want[i] == got[i]) << "result " << i;
    }
    EXPECT_EQ((*plain)->hopper_gemm_shapes(), 0);
    // Some shapes must have been the kernel's, or the test compared cuBLAS
    // with itself.
    EXPECT_GT((*own)->hopper_gemm_shapes(), 0);
    std::printf("%s: %d GEMM shapes on flce's Hopper GEMM\n", layout.name,
                (*own)->hopper_gemm_shapes());
  }
}

// The one-pass rows (STORE_GRADS, bf16/fp32 rows without label smoothing,
// V a multiple of the 16-byte pack) against the fp64 reference: rows of
// several tiles, flat to peaked softmaxes, z-loss, ignored rows, both
// reductions STORE_GRADS takes, then bias, class weights and softcap alone
// and together. None of them leaves the kernel's range, so none runs again
// with two passes: the one-pass results are what was judged.
TEST(CudaEngineSemanticsTest, OnePassRowsMeetTheBar) {
  FLCE_GET_ENGINE_OR_SKIP(engine, Layout::kTokenChunks, /*one_pass_rows=*/true);
  const int64_t reruns = engine->forward_reruns();
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    auto one_pass = [&](const std::string& name, Reduction reduction) {
      ConformanceCase c =
          MakeCase("one pass, " + name, 67, 24, 20008, dtype, reduction, BackwardMode::kStoreGrads);
      c.spec.ignore_fraction = 0.2;
      c.spec.options.z_loss_scale = 1e-3f;
      return c;
    };
    for (double scale : {0.1, 2.0, 30.0}) {
      for (Reduction reduction : {Reduction::kMean, Reduction::kSum}) {
        ConformanceCase c = one_pass("logit scale " + std::to_string(scale), reduction);
        c.spec.logit_scale = scale;
        RunConformanceCase(*engine, c);
      }
    }
    for (int options = 1; options < 8; ++options) {
      ConformanceCase c = one_pass("options " + std::to_string(options), Reduction::kMean);
      c.spec.bias = (options & 1) != 0;
      c.spec.class_weight = (options & 2) != 0;
      if ((options & 4) != 0) c.spec.options.logit_softcap = 5.0f;
      RunConformanceCase(*engine, c);
    }
  }
  EXPECT_EQ(engine->forward_reruns(), reruns);
}

// A target whose class weight is 0 (no z-loss) has an all-zero gradient
// row: the one-pass rows give it a zero factor without a rerun, and the
// results meet the bar.
TEST(CudaEngineSemanticsTest, ZeroClassWeightRowsStayOnePass) {
  FLCE_GET_ENGINE_OR_SKIP(engine, Layout::kTokenChunks, /*one_pass_rows=*/true);
  RandomProblemSpec spec;
  spec.rows = 50;
  spec.hidden = 24;
  spec.vocab = 9000;
  spec.dtype = DType::kBFloat16;
  spec.class_weight = true;
  OwnedProblem p = MakeRandomProblem(spec);
  const int64_t* target = p.target.data_as<int64_t>();
  for (int i = 0; i < 10; ++i) p.class_weight->mutable_data<float>()[target[i]] = 0.0f;
  const int64_t reruns = engine->forward_reruns();
  ForwardSpec fs;
  fs.need_backward = true;
  fs.want_lse = true;
  fs.want_per_row_loss = true;
  auto fwd = engine->Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto grads = engine->Backward(*fwd->saved, {}, nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();
  const AccuracyReport report = CheckAccuracy(p.view(), {}, CollectOutputs(*fwd, &*grads));
  EXPECT_TRUE(report.ok()) << report.ToString();
  EXPECT_EQ(engine->forward_reruns(), reruns);
}

// Forward (STORE_GRADS) and Backward of `p`: the loss, per-row loss, lse,
// dX and dW bits.
std::vector<std::string> StoreGradsBits(CudaEngine& engine, const OwnedProblem& p) {
  ForwardSpec fs;
  fs.need_backward = true;
  fs.want_lse = true;
  fs.want_per_row_loss = true;
  auto fwd = engine.Forward(p.view(), fs, nullptr);
  EXPECT_TRUE(fwd.ok()) << fwd.status();
  if (!fwd.ok()) return {};
  auto grads = engine.Backward(*fwd->saved, {}, nullptr);
  EXPECT_TRUE(grads.ok()) << grads.status();
  if (!grads.ok()) return {};
  return {fwd->loss.data, fwd->per_row_loss->data, fwd->lse->data, grads->grad_hidden.data,
          grads->grad_weight.data};
}

// A row whose largest logit lies far above the maximum of its first tile
// (here ~300 nats past the first 8192 columns), or holds a NaN, is outside
// the one-pass kernel's range: Forward runs again with two passes, and its
// results are those of an engine that always reads twice, bit for bit.
TEST(CudaEngineSemanticsTest, RowsOutOfOnePassRangeRunAgainWithTwoPasses) {
  FLCE_SKIP_WITHOUT_DEVICE();
  CudaEngineOptions options;
  options.chunk_bytes = 64 << 10;
  options.one_pass_rows = false;
  auto two_pass = CudaEngine::Create(options);
  ASSERT_TRUE(two_pass.ok()) << two_pass.status();
  options.one_pass_rows = true;
  auto one_pass = CudaEngine::Create(options);
  ASSERT_TRUE(one_pass.ok()) << one_pass.status();
  CudaEngine* engine = one_pass->get();
  RandomProblemSpec spec;
  spec.rows = 40;
  spec.hidden = 16;
  spec.vocab = 12000;
  spec.dtype = DType::kBFloat16;
  spec.options.z_loss_scale = 1e-4f;
  const OwnedProblem plain = MakeRandomProblem(spec);

  // W's last row along X's row 3: that logit is 300, the others a few units.
  OwnedProblem far = MakeRandomProblem(spec);
  const int64_t h = spec.hidden, v = spec.vocab;
  std::vector<float> x3(h), w(v * h);
  ToFloat(spec.dtype, far.hidden.data.data() + 3 * h * 2, h, x3.data());
  double norm2 = 0;
  for (float e : x3) norm2 += double{e} * e;
  for (int64_t j = 0; j < h; ++j) w[j] = static_cast<float>(300.0 * x3[j] / norm2);
  FromFloat(spec.dtype, w.data(), h, far.weight.data.data() + (v - 1) * h * 2);

  OwnedProblem nan = MakeRandomProblem(spec);
  const float not_a_number = std::nanf("");
  FromFloat(spec.dtype, &not_a_number, 1, nan.hidden.data.data() + 5 * h * 2);

  const int64_t reruns = engine->forward_reruns();
  const std::vector<std::string> ok = StoreGradsBits(*engine, plain);
  EXPECT_EQ(engine->forward_reruns(), reruns) << "in-range rows ran again";
  for (const OwnedProblem* p : {&far, &nan}) {
    SCOPED_TRACE(p == &far ? "a logit far above its first tile" : "a NaN");
    const int64_t before = engine->forward_reruns();
    const std::vector<std::string> got = StoreGradsBits(*engine, *p);
    const std::vector<std::string> want = StoreGradsBits(**two_pass, *p);
    EXPECT_EQ(engine->forward_reruns(), before + 1);
    ASSERT_EQ(got.size(), 5u);
    ASSERT_EQ(want.size(), 5u);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "result " << i;
  }
  EXPECT_EQ((*two_pass)->forward_reruns(), 0);
  EXPECT_TRUE(engine->health().ok());
}

TEST(CudaEngineSemanticsTest, AgreesWithTheCpuEngine) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  CpuEngine cpu;
  RandomProblemSpec spec;
  spec.rows = 300;
  spec.hidden = 96;
  spec.vocab = 5003;
  spec.bias = true;
  spec.options.label_smoothing = 0.05f;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.want_lse = true;
  auto gpu = engine->Forward(p.view(), fs, nullptr);
  auto host = cpu.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE(host.ok()) << host.status();
  const float a = gpu->loss.data_as<float>()[0], b = host->loss.data_as<float>()[0];
  EXPECT_NEAR(a, b, 1e-5 * std::fabs(b));
  EXPECT_EQ(gpu->num_valid, host->num_valid);
  EXPECT_EQ(gpu->num_correct, host->num_correct);
  for (int64_t i = 0; i < spec.rows; ++i) {
    ASSERT_NEAR(gpu->lse->data_as<float>()[i], host->lse->data_as<float>()[i], 1e-4) << i;
  }
}

TEST(CudaEngineSemanticsTest, MeanOverAllIgnoredRowsIsNaNWithZeroGradients) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 70;
  spec.ignore_fraction = 1.0;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.need_backward = true;
  auto fwd = engine->Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  auto grads = engine->Backward(*fwd->saved, {}, nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();
  for (float v : TensorToFloats(grads->grad_weight.view())) ASSERT_EQ(v, 0.0f);
}

TEST(CudaEngineSemanticsTest, NoRowsGiveZeroWeightGradient) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  std::string why;
  CudaEngine* sliced = Engine(&why, Layout::kVocabularySlices);
  ASSERT_NE(sliced, nullptr) << why;
  RandomProblemSpec spec;
  spec.rows = 0;
  spec.options.reduction = Reduction::kSum;
  spec.bias = true;
  const OwnedProblem p = MakeRandomProblem(spec);
  for (auto [mode, e] :
       {std::pair{BackwardMode::kStoreGrads, engine}, std::pair{BackwardMode::kRecompute, engine},
        std::pair{BackwardMode::kRecompute, sliced}}) {
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    auto fwd = e->Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->loss.data_as<float>()[0], 0.0f);
    auto grads = e->Backward(*fwd->saved, {}, nullptr);
    ASSERT_TRUE(grads.ok()) << grads.status();
    for (float v : TensorToFloats(grads->grad_weight.view())) ASSERT_EQ(v, 0.0f);
    for (float v : TensorToFloats(grads->grad_bias->view())) ASSERT_EQ(v, 0.0f);
  }
}

TEST(CudaEngineSemanticsTest, NonFiniteInputsGiveNaNLoss) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 5;
  OwnedProblem p = MakeRandomProblem(spec);
  p.hidden.mutable_data<float>()[7] = std::nanf("");
  auto fwd = engine->Forward(p.view(), {}, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  EXPECT_TRUE(engine->health().ok());
}

TEST(CudaEngineSemanticsTest, CancellationStopsBetweenChunks) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 500;
  const OwnedProblem p = MakeRandomProblem(spec);
  auto fwd = engine->Forward(p.view(), {}, [] { return true; });
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(engine->health().ok());
}

TEST(CudaEngineSemanticsTest, OutOfMemoryIsResourceExhaustedAndTheEngineKeepsServing) {
  std::string why;
  if (Engine(&why) == nullptr) {
    if (RequireGpu()) FAIL() << why;
    GTEST_SKIP() << why;
  }
  // A chunk budget far beyond the card: the logits chunk cannot be had.
  CudaEngineOptions options;
  options.chunk_bytes = int64_t{1} << 40;
  auto greedy = CudaEngine::Create(options);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  RandomProblemSpec spec;
  spec.rows = 1 << 20;
  spec.hidden = 1;
  spec.vocab = 100000;  // 1 Mi rows × 100000 × 4 bytes = 400 GiB of logits
  const OwnedProblem p = MakeRandomProblem(spec);
  auto fwd = (*greedy)->Forward(p.view(), {}, nullptr);
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kResourceExhausted) << fwd.status();
  EXPECT_TRUE((*greedy)->health().ok());
  RandomProblemSpec small;
  const OwnedProblem q = MakeRandomProblem(small);
  EXPECT_TRUE((*greedy)->Forward(q.view(), {}, nullptr).ok());
}

TEST(CudaEngineSemanticsTest, ReportsTheDevice) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  ASSERT_EQ(engine->devices().size(), 1u);
  EXPECT_FALSE(engine->devices()[0].name.empty());
  EXPECT_GT(engine->devices()[0].total_memory_bytes, 0);
  EXPECT_EQ(engine->backend(), "cuda");
}

}  // namespace
}  // namespace flce
