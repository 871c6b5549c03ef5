// The vocabulary-sharded engine over the CPU engine: the whole conformance
// suite against the fp64 reference (every option, both modes, odd sizes),
// with 3 shards on one engine and 2 shards over two engines.

#include "kernels/sharded_engine.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/engine_conformance.h"
#include "kernels/reference/random_problem.h"

namespace flce {
namespace {

std::unique_ptr<LossEngine> Cpu() {
  // A small chunk budget so that every shard runs several chunks.
  return std::make_unique<CpuEngine>(CpuEngineOptions{/*chunk_bytes=*/4096});
}

std::unique_ptr<ShardedEngine> Sharded(int engines, int shards) {
  std::vector<std::unique_ptr<LossEngine>> list;
  for (int i = 0; i < engines; ++i) list.push_back(Cpu());
  return std::make_unique<ShardedEngine>(std::move(list), shards);
}

class ShardedEngineTest : public ::testing::TestWithParam<DType> {
 protected:
  void RunAll(const std::vector<ConformanceCase>& cases) {
    for (const ConformanceCase& c : cases) {
      RunConformanceCase(*one_engine_, c);
      RunConformanceCase(*two_engines_, c);
    }
  }
  std::unique_ptr<ShardedEngine> one_engine_ = Sharded(1, 3);
  std::unique_ptr<ShardedEngine> two_engines_ = Sharded(2, 2);
};

TEST_P(ShardedEngineTest, OddSizesBothModesAllReductions) { RunAll(OddSizeCases(GetParam())); }
TEST_P(ShardedEngineTest, EveryOptionTogether) { RunAll(EveryOptionCases(GetParam())); }
TEST_P(ShardedEngineTest, EachOptionAlone) { RunAll(EachOptionCases(GetParam())); }
TEST_P(ShardedEngineTest, PeakedAndFlatSoftmaxes) { RunAll(SoftmaxShapeCases(GetParam())); }

// No rows: the loss 0 (sum), dX [0, H], dW and db zero; and more shards
// asked for than the vocabulary has ids: one per id.
TEST(ShardedEngineEdgeTest, NoRowsAndTinyVocabularies) {
  auto engine = Sharded(1, 8);
  for (int64_t rows : {0, 5}) {
    RandomProblemSpec spec;
    spec.rows = rows;
    spec.hidden = 4;
    spec.vocab = 3;
    spec.bias = true;
    spec.options.reduction = Reduction::kSum;
    OwnedProblem p = MakeRandomProblem(spec);
    ForwardSpec fs;
    fs.need_backward = true;
    auto fwd = engine->Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    if (rows == 0) {
      EXPECT_EQ(fwd->loss.data_as<float>()[0], 0.0f);
    }
    auto grads = engine->Backward(*fwd->saved, {}, nullptr);
    ASSERT_TRUE(grads.ok()) << grads.status();
    EXPECT_EQ(grads->grad_hidden.shape, (std::vector<int64_t>{rows, 4}));
    EXPECT_EQ(grads->grad_weight.shape, (std::vector<int64_t>{3, 4}));
    ASSERT_TRUE(grads->grad_bias.has_value());
    if (rows == 0) {
      for (float w : TensorToFloats(grads->grad_weight.view())) EXPECT_EQ(w, 0.0f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, ShardedEngineTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace flce
