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

// Over several engines the weight's parts (a registered weight's rows kept
// on each engine's device) stand for the weight, and dW and db go to each
// part's own destination: the same bits as from the whole weight.
TEST(ShardedEngineEdgeTest, WeightPartsStandForTheWeight) {
  auto engine = Sharded(2, 3);
  RandomProblemSpec spec;
  spec.rows = 9;
  spec.hidden = 5;
  spec.vocab = 11;
  spec.bias = true;
  OwnedProblem p = MakeRandomProblem(spec);
  const std::vector<WeightPart> layout = engine->WeightParts(11);
  ASSERT_EQ(layout.size(), 3u);
  EXPECT_EQ(layout[0].first, 0);
  EXPECT_EQ(layout[2].first + layout[2].rows, 11);
  EXPECT_EQ(Sharded(1, 3)->WeightParts(11).size(), 1u);  // one engine: slices of one part
  ForwardSpec fs;
  fs.need_backward = true;
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    fs.mode = mode;
    auto want_fwd = engine->Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(want_fwd.ok()) << want_fwd.status();
    auto want = engine->Backward(*want_fwd->saved, {}, nullptr);
    ASSERT_TRUE(want.ok()) << want.status();

    // The parts in memory of their own; the whole weight's bytes poisoned.
    std::vector<HostTensor> rows;
    rows.reserve(layout.size());
    LossProblem problem = p.view();
    for (const WeightPart& part : layout) {
      rows.push_back(CopyTensor(RowSlice(problem.weight, part.first, part.rows)));
      problem.weight_parts.push_back(rows.back().view());
    }
    HostTensor poison(p.weight.dtype, p.weight.shape);
    problem.weight = poison.view();
    auto fwd = engine->Forward(problem, fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->loss.data, want_fwd->loss.data);

    std::vector<HostTensor> dw, db;
    dw.reserve(layout.size());  // (their bytes must not move: short ones live inline)
    db.reserve(layout.size());
    BackwardSpec bs;
    for (const WeightPart& part : layout) {
      dw.emplace_back(p.weight.dtype, std::vector<int64_t>{part.rows, 5});
      db.emplace_back(p.weight.dtype, std::vector<int64_t>{part.rows});
      bs.grad_weight_parts_to.push_back(GradientDestination{dw.back().data.data()});
      bs.grad_bias_parts_to.push_back(GradientDestination{db.back().data.data()});
    }
    auto grads = engine->Backward(*fwd->saved, bs, nullptr);
    ASSERT_TRUE(grads.ok()) << grads.status();
    EXPECT_EQ(grads->grad_hidden.data, want->grad_hidden.data);
    EXPECT_EQ(grads->grad_weight.shape, (std::vector<int64_t>{11, 5}));
    EXPECT_TRUE(grads->grad_weight.data.empty());  // written into the parts
    const int64_t elem = DTypeSize(p.weight.dtype);
    for (size_t k = 0; k < layout.size(); ++k) {
      EXPECT_EQ(dw[k].data, want->grad_weight.data.substr(layout[k].first * 5 * elem,
                                                          layout[k].rows * 5 * elem));
      EXPECT_EQ(db[k].data,
                want->grad_bias->data.substr(layout[k].first * elem, layout[k].rows * elem));
    }
  }
  // Parts that are not the engine's layout are a broken invariant.
  LossProblem wrong = p.view();
  wrong.weight_parts = {p.weight.view()};
  EXPECT_EQ(engine->Forward(wrong, fs, nullptr).status().code(), absl::StatusCode::kInternal);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, ShardedEngineTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace flce
