// The engine that spreads requests over several engines, over CPU engines:
// the conformance suite against the fp64 reference (every session's
// Backward on the engine of its Forward), and Forwards taken in turn.

#include "kernels/spread_engine.h"

#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/engine_conformance.h"
#include "kernels/reference/random_problem.h"

namespace flce {
namespace {

// A CPU engine that counts its Forward calls.
class CountingEngine : public CpuEngine {
 public:
  explicit CountingEngine(int* forwards)
      : CpuEngine(CpuEngineOptions{/*chunk_bytes=*/4096}), forwards_(forwards) {}
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override {
    ++*forwards_;
    return CpuEngine::Forward(problem, spec, cancelled);
  }

 private:
  int* forwards_;
};

TEST(SpreadEngineTest, ConformsWithEverySessionOnItsEngine) {
  int forwards[3] = {0, 0, 0};
  std::vector<std::unique_ptr<LossEngine>> engines;
  for (int& count : forwards) engines.push_back(std::make_unique<CountingEngine>(&count));
  SpreadEngine spread(std::move(engines));
  std::vector<ConformanceCase> cases = OddSizeCases(DType::kBFloat16);
  for (const ConformanceCase& c : EveryOptionCases(DType::kFloat32)) cases.push_back(c);
  for (const ConformanceCase& c : cases) RunConformanceCase(spread, c);
  // One call at a time: taken in turn.
  EXPECT_GT(forwards[0], 0);
  EXPECT_LE(std::abs(forwards[0] - forwards[1]), 1);
  EXPECT_LE(std::abs(forwards[1] - forwards[2]), 1);
  EXPECT_EQ(spread.devices().size(), 3u);
}

TEST(SpreadEngineTest, VocabularyShardsPassThrough) {
  std::vector<std::unique_ptr<LossEngine>> engines;
  engines.push_back(std::make_unique<CpuEngine>());
  engines.push_back(std::make_unique<CpuEngine>());
  SpreadEngine spread(std::move(engines));
  ASSERT_TRUE(spread.supports_vocab_shards());
  ConformanceCase c = EveryOptionCases(DType::kFloat32)[0];
  const int64_t v = c.spec.vocab;
  RunShardConformanceCase(spread, c, {v / 2, v - v / 2});
}

// A registered weight kept whole on every engine (WeightParts: a replica
// each): a request reads its engine's replica and writes dW and db into
// that replica's destination alone; the same bits as from the weight.
TEST(SpreadEngineTest, ReplicasStandForTheWeight) {
  std::vector<std::unique_ptr<LossEngine>> engines;
  engines.push_back(std::make_unique<CpuEngine>());
  engines.push_back(std::make_unique<CpuEngine>());
  SpreadEngine spread(std::move(engines));
  RandomProblemSpec spec;
  spec.rows = 9;
  spec.hidden = 5;
  spec.vocab = 11;
  spec.bias = true;
  const OwnedProblem p = MakeRandomProblem(spec);
  const std::vector<WeightPart> layout = spread.WeightParts(11);
  ASSERT_EQ(layout.size(), 2u);
  for (const WeightPart& part : layout) {
    EXPECT_EQ(part.first, 0);
    EXPECT_EQ(part.rows, 11);
  }
  ForwardSpec fs;
  fs.need_backward = true;
  auto want_fwd = spread.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(want_fwd.ok()) << want_fwd.status();
  auto want = spread.Backward(*want_fwd->saved, {}, nullptr);
  ASSERT_TRUE(want.ok()) << want.status();

  const HostTensor replica0 = CopyTensor(p.weight.view()), replica1 = CopyTensor(p.weight.view());
  LossProblem problem = p.view();
  problem.weight_parts = {replica0.view(), replica1.view()};
  const HostTensor poison(p.weight.dtype, p.weight.shape);  // the replicas must be what is read
  problem.weight = poison.view();
  std::vector<HostTensor> dw, db;
  for (int k = 0; k < 2; ++k) {
    dw.emplace_back(p.weight.dtype, p.weight.shape);
    db.emplace_back(p.weight.dtype, std::vector<int64_t>{11});
  }
  BackwardSpec bs;
  for (int k = 0; k < 2; ++k) {
    bs.grad_weight_parts_to.push_back(GradientDestination{dw[k].data.data()});
    bs.grad_bias_parts_to.push_back(GradientDestination{db[k].data.data()});
  }
  const std::string untouched = dw[0].data;
  // Forwards go in turn: the next call runs on the other engine than the
  // call above, then the one after it on the first again.
  for (int call = 0; call < 2; ++call) {
    auto fwd = spread.Forward(problem, fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->loss.data, want_fwd->loss.data);
    auto grads = spread.Backward(*fwd->saved, bs, nullptr);
    ASSERT_TRUE(grads.ok()) << grads.status();
    EXPECT_EQ(grads->grad_hidden.data, want->grad_hidden.data);
    const int e = call == 0 ? 1 : 0;
    EXPECT_EQ(dw[e].data, want->grad_weight.data) << call;
    EXPECT_EQ(db[e].data, want->grad_bias->data) << call;
    if (call == 0) EXPECT_EQ(dw[0].data, untouched);  // the other replica's sums: left alone
  }
  // Parts that are not a replica per engine are a broken invariant.
  LossProblem wrong = p.view();
  wrong.weight_parts = {replica0.view()};
  EXPECT_EQ(spread.Forward(wrong, fs, nullptr).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace flce
