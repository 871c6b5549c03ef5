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

INSTANTIATE_TEST_SUITE_P(AllDTypes, ShardedEngineTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace flce
