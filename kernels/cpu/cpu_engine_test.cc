// The CPU engine against the fp64 reference on odd sizes and every option.

#include "kernels/cpu/cpu_engine.h"

#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/engine_conformance.h"
#include "kernels/reference/random_problem.h"
#include "kernels/tensor.h"

namespace flce {
namespace {

class CpuEngineTest : public ::testing::TestWithParam<DType> {
 protected:
  void RunAll(const std::vector<ConformanceCase>& cases) {
    for (const ConformanceCase& c : cases) RunConformanceCase(engine_, c);
  }
  // A small chunk budget so that every case runs several chunks; bf16 GEMMs
  // wherever the CPU has them (faster than fp32 or not), so that they are
  // tested there.
  static CpuEngineOptions Options() {
    CpuEngineOptions options;
    options.chunk_bytes = 4096;
    options.bf16_gemms = Bf16Gemms::kWhereNative;
    return options;
  }
  CpuEngine engine_{Options()};
};

TEST_P(CpuEngineTest, OddSizesBothModesAllReductions) { RunAll(OddSizeCases(GetParam())); }
TEST_P(CpuEngineTest, EveryOptionTogether) { RunAll(EveryOptionCases(GetParam())); }
TEST_P(CpuEngineTest, EachOptionAlone) { RunAll(EachOptionCases(GetParam())); }
TEST_P(CpuEngineTest, PeakedAndFlatSoftmaxes) { RunAll(SoftmaxShapeCases(GetParam())); }
TEST_P(CpuEngineTest, LargeVocabulary) { RunAll(LargeVocabularyCases(GetParam())); }

// bf16 inputs on fp32 GEMMs (a CPU without bf16 dot products or where they
// are slower, or bf16 GEMMs off) meet the same bar.
TEST(CpuEngineWidenedTest, Bf16OnFp32Gemms) {
  CpuEngineOptions options;
  options.chunk_bytes = 4096;
  options.bf16_gemms = Bf16Gemms::kNever;
  CpuEngine engine(options);
  std::vector<ConformanceCase> cases = OddSizeCases(DType::kBFloat16);
  for (const ConformanceCase& c : EveryOptionCases(DType::kBFloat16)) cases.push_back(c);
  for (const ConformanceCase& c : cases) RunConformanceCase(engine, c);
}

// fp32 GEMMs on OpenBLAS (--cpu_onednn_fp32=false) meet the same bar, fp16
// inputs (widened to them) too.
TEST(CpuEngineOpenBlasTest, Fp32GemmsOnOpenBlas) {
  CpuEngineOptions options;
  options.chunk_bytes = 4096;
  options.onednn_fp32 = false;
  CpuEngine engine(options);
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    std::vector<ConformanceCase> cases = OddSizeCases(dtype);
    for (const ConformanceCase& c : EveryOptionCases(dtype)) cases.push_back(c);
    for (const ConformanceCase& c : cases) RunConformanceCase(engine, c);
  }
}

// Vocabulary shards (2 uneven, 3) combine to the whole: every option, every
// reduction, both modes.
TEST_P(CpuEngineTest, VocabularyShardsCombineToTheWhole) {
  std::vector<ConformanceCase> cases = EveryOptionCases(GetParam());
  for (const ConformanceCase& c : EachOptionCases(GetParam())) cases.push_back(c);
  for (Reduction r : {Reduction::kSum, Reduction::kNone}) {
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      ConformanceCase c = EveryOptionCases(GetParam())[0];
      c.spec.options.reduction = r;
      c.mode = mode;
      c.name += std::string(" reduction ") + ReductionName(r) + " " + BackwardModeName(mode);
      cases.push_back(c);
    }
  }
  for (const ConformanceCase& c : cases) {
    const int64_t v = c.spec.vocab;
    // (bf16 gradients are rounded for the GEMMs, the unsharded STORE_GRADS
    // before its upstream gradient scales them: ShardGradientTolerance.)
    const double tolerance = ShardGradientTolerance(GetParam());
    RunShardConformanceCase(engine_, c, {v / 3, v - v / 3}, tolerance);
    RunShardConformanceCase(engine_, c, {v / 3, v / 3, v - 2 * (v / 3)}, tolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CpuEngineTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Without a device: no device memory to allocate or copy, and a
// destination that asks to accumulate is refused.
TEST(CpuEngineSemanticsTest, HasNoDeviceMemoryAndDoesNotAccumulate) {
  CpuEngine engine;
  EXPECT_EQ(engine.device_memory(), nullptr);
  RandomProblemSpec spec;
  spec.rows = 4;
  OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.need_backward = true;
  auto fwd = engine.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok());
  std::vector<float> dw(static_cast<size_t>(p.weight.num_elements()));
  BackwardSpec bs;
  bs.weight_grad_dtype = DType::kFloat32;
  bs.grad_weight_to = GradientDestination{dw.data(), MemorySpace::kHost, /*accumulate=*/true};
  EXPECT_EQ(engine.Backward(*fwd->saved, bs, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CpuEngineSemanticsTest, MeanOverAllIgnoredRowsIsNaNWithZeroGradients) {
  CpuEngine engine;
  RandomProblemSpec spec;
  spec.rows = 6;
  spec.ignore_fraction = 1.0;
  OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.need_backward = true;
  auto fwd = engine.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok());
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  EXPECT_EQ(fwd->num_valid, 0);
  auto grads = engine.Backward(*fwd->saved, {}, nullptr);
  ASSERT_TRUE(grads.ok());
  for (float v : TensorToFloats(grads->grad_weight.view())) EXPECT_EQ(v, 0.0f);
  for (float v : TensorToFloats(grads->grad_hidden.view())) EXPECT_EQ(v, 0.0f);
}

TEST(CpuEngineSemanticsTest, NoRowsSumIsZero) {
  CpuEngine engine;
  RandomProblemSpec spec;
  spec.rows = 0;
  spec.options.reduction = Reduction::kSum;
  OwnedProblem p = MakeRandomProblem(spec);
  auto fwd = engine.Forward(p.view(), {}, nullptr);
  ASSERT_TRUE(fwd.ok());
  EXPECT_EQ(fwd->loss.data_as<float>()[0], 0.0f);
  EXPECT_EQ(fwd->saved, nullptr);
}

TEST(CpuEngineSemanticsTest, NonFiniteInputsGiveNaNLossNotACrash) {
  CpuEngine engine;
  RandomProblemSpec spec;
  spec.rows = 4;
  OwnedProblem p = MakeRandomProblem(spec);
  p.hidden.mutable_data<float>()[3] = std::nanf("");
  ForwardSpec fs;
  fs.need_backward = true;
  auto fwd = engine.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok());
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
}

TEST(CpuEngineSemanticsTest, CancellationStopsBetweenChunks) {
  CpuEngine engine{CpuEngineOptions{/*chunk_bytes=*/4096}};
  RandomProblemSpec spec;
  spec.rows = 100;
  OwnedProblem p = MakeRandomProblem(spec);
  auto fwd = engine.Forward(p.view(), {}, [] { return true; });
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kCancelled);
}

TEST(CpuEngineSemanticsTest, Float32GradientsOnRequest) {
  CpuEngine engine;
  RandomProblemSpec spec;
  spec.dtype = DType::kBFloat16;
  OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.need_backward = true;
  auto fwd = engine.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok());
  BackwardSpec bs;
  bs.grad_dtype = DType::kFloat32;
  auto grads = engine.Backward(*fwd->saved, bs, nullptr);
  ASSERT_TRUE(grads.ok());
  EXPECT_EQ(grads->grad_weight.dtype, DType::kFloat32);
  EXPECT_EQ(grads->grad_weight.data.size(), 1000u * 64 * 4);
}

TEST(CpuEngineSemanticsTest, ChunkRowsFollowTheBudget) {
  CpuEngine engine{CpuEngineOptions{/*chunk_bytes=*/int64_t{64} << 20}};
  // 126 rows fit the budget: 8192 rows go in 66 even chunks of at most 125.
  EXPECT_EQ(engine.ChunkRows(8192, 128256, 4096), 125);
  EXPECT_EQ(engine.ChunkRows(252, 128256, 4096), 126);
  EXPECT_EQ(engine.ChunkRows(5, 128256, 4096), 5);
  EXPECT_EQ(engine.ChunkRows(8192, int64_t{1} << 30, 1), CpuEngine::kMinChunkRows);
  // A wide hidden size bounds the chunk too (its fp32 copy of X).
  EXPECT_EQ(engine.ChunkRows(8192, 3, int64_t{1} << 20), CpuEngine::kMinChunkRows);
}

}  // namespace
}  // namespace flce
