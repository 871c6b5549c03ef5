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
  explicit CountingEngine(int* forwards) : CpuEngine(CpuEngineOptions{/*chunk_bytes=*/4096}),
                                           forwards_(forwards) {}
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

}  // namespace
}  // namespace flce
