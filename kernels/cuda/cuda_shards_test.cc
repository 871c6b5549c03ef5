// Vocabulary shards on the CUDA engine: a shard's statistics and its
// Backward with the whole vocabulary's lse (both modes, every option) combine
// to the unsharded call, and the sharded engine over the CUDA engine (several
// shards on one GPU) passes the conformance suite against the fp64
// reference, with gradients in host or device memory. Tagged `gpu`: skips
// without a device, fails without one when REQUIRE_GPU=1.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_engine.h"
#include "kernels/cuda/cuda_test_support.h"
#include "kernels/cuda/partial_sums.h"
#include "kernels/dtype.h"
#include "kernels/engine_conformance.h"
#include "kernels/reference/random_problem.h"
#include "kernels/sharded_engine.h"

namespace flce {
namespace {

using cuda_test::DeviceBytes;
using cuda_test::Layout;
using cuda_test::RequireGpu;

// Every option together and one at a time, plus sum and none in both modes.
std::vector<ConformanceCase> ShardCases(DType dtype) {
  std::vector<ConformanceCase> cases = EveryOptionCases(dtype);
  for (const ConformanceCase& c : EachOptionCases(dtype)) cases.push_back(c);
  for (Reduction r : {Reduction::kSum, Reduction::kNone}) {
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      ConformanceCase c = EveryOptionCases(dtype)[0];
      c.spec.options.reduction = r;
      c.mode = mode;
      c.name += std::string(" reduction ") + ReductionName(r) + " " + BackwardModeName(mode);
      cases.push_back(c);
    }
  }
  return cases;
}

class CudaShardTest : public ::testing::TestWithParam<std::tuple<DType, Layout>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
};

// 2 uneven and 3 shards of one CUDA engine combine to its unsharded call
// (loss and counts within fp32 rounding; the gradients, which the engine
// rounds to the input dtype over the logits, within that rounding).
TEST_P(CudaShardTest, ShardsCombineToTheWhole) {
  FLCE_GET_ENGINE_OR_SKIP(engine, std::get<1>(GetParam()));
  ASSERT_TRUE(engine->supports_vocab_shards());
  for (const ConformanceCase& c : ShardCases(dtype())) {
    const int64_t v = c.spec.vocab;
    const double tolerance = ShardGradientTolerance(dtype());
    RunShardConformanceCase(*engine, c, {v / 3, v - v / 3}, tolerance);
    RunShardConformanceCase(*engine, c, {v / 3, v / 3, v - 2 * (v / 3)}, tolerance);
  }
}

// A CUDA engine of its own for a sharded engine to own, with the test
// engines' small chunk budget and RECOMPUTE layout.
std::unique_ptr<LossEngine> OwnEngine(Layout layout, std::string* why) {
  CudaEngineOptions options;
  options.chunk_bytes = 64 << 10;
  options.min_slice_columns = layout == Layout::kTokenChunks ? int64_t{1} << 40 : 16;
  auto engine = CudaEngine::Create(options);
  if (!engine.ok()) {
    *why = engine.status().ToString();
    return nullptr;
  }
  return std::move(*engine);
}

#define FLCE_SHARDED_ENGINE_OR_SKIP(sharded, layout, shards)   \
  std::string why_;                                            \
  std::unique_ptr<LossEngine> own_ = OwnEngine(layout, &why_); \
  if (own_ == nullptr) {                                       \
    if (RequireGpu()) FAIL() << "REQUIRE_GPU=1 but " << why_;  \
    GTEST_SKIP() << "no CUDA device: " << why_;                \
  }                                                            \
  std::vector<std::unique_ptr<LossEngine>> list_;              \
  list_.push_back(std::move(own_));                            \
  ShardedEngine sharded(std::move(list_), shards)

// Two CUDA engines sharing the GPU under one sharded engine, their dX sums
// added on the device: the several-device path on one GPU.
#define FLCE_TWO_ENGINES_OR_SKIP(sharded, layout, shards)               \
  std::string why_;                                                     \
  std::vector<std::unique_ptr<LossEngine>> list_;                       \
  for (int i_ = 0; i_ < 2; ++i_) {                                      \
    list_.push_back(OwnEngine(layout, &why_));                          \
    if (list_.back() == nullptr) {                                      \
      if (RequireGpu()) FAIL() << "REQUIRE_GPU=1 but " << why_;         \
      GTEST_SKIP() << "no CUDA device: " << why_;                       \
    }                                                                   \
  }                                                                     \
  absl::StatusOr<std::unique_ptr<PartialSum>> sum_ = DeviceLocalSum(0); \
  ASSERT_TRUE(sum_.ok()) << sum_.status();                              \
  ShardedEngine sharded(std::move(list_), shards, std::move(*sum_))

// The sharded engine over one CUDA engine (3 shards on one GPU): the
// conformance suite against the fp64 reference.
TEST_P(CudaShardTest, ShardedEngineOnOneGpuConforms) {
  FLCE_SHARDED_ENGINE_OR_SKIP(sharded, std::get<1>(GetParam()), 3);
  std::vector<ConformanceCase> cases = OddSizeCases(dtype());
  for (const ConformanceCase& c : EveryOptionCases(dtype())) cases.push_back(c);
  for (const ConformanceCase& c : cases) RunConformanceCase(sharded, c);
}

// Two CUDA engines sharing the GPU, their shards at once (a thread each),
// their dX sums added on the device: the several-device path on one GPU,
// against the fp64 reference.
TEST_P(CudaShardTest, TwoEnginesOnOneGpuConform) {
  FLCE_TWO_ENGINES_OR_SKIP(sharded, std::get<1>(GetParam()), 3);
  std::vector<ConformanceCase> cases = OddSizeCases(dtype());
  for (const ConformanceCase& c : EveryOptionCases(dtype())) cases.push_back(c);
  for (const ConformanceCase& c : cases) RunConformanceCase(sharded, c);
}

INSTANTIATE_TEST_SUITE_P(
    AllDTypes, CudaShardTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(Layout::kTokenChunks, Layout::kVocabularySlices)),
    [](const auto& info) {
      return cuda_test::DTypeLayoutName(std::get<0>(info.param), std::get<1>(info.param));
    });

// The sharded engine on one GPU with X and W in device memory and the
// gradients written into device memory (dW also added into an fp32 sum, as a
// registered weight's): the bits of its host results, both modes.
TEST(CudaShardSemanticsTest, ShardedEngineWritesDeviceDestinations) {
  FLCE_SHARDED_ENGINE_OR_SKIP(sharded, Layout::kVocabularySlices, 3);
  RandomProblemSpec spec = cuda_test::DestinationSpec();
  spec.options.label_smoothing = 0.1f;
  const OwnedProblem p = MakeRandomProblem(spec);
  const cuda_test::ProblemOnDevice on_device(p);
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    auto host_fwd = sharded.Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(host_fwd.ok()) << host_fwd.status();
    auto fwd = sharded.Forward(on_device.view, fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->loss.data, host_fwd->loss.data);
    auto want = sharded.Backward(*host_fwd->saved, {}, nullptr);
    ASSERT_TRUE(want.ok()) << want.status();
    DeviceBytes dx(want->grad_hidden.data.size()), dw(want->grad_weight.data.size()),
        db(want->grad_bias->data.size());
    BackwardSpec device;
    device.grad_hidden_to = GradientDestination{dx.data, MemorySpace::kCuda};
    device.grad_weight_to = GradientDestination{dw.data, MemorySpace::kCuda};
    device.grad_bias_to = GradientDestination{db.data, MemorySpace::kCuda};
    auto got = sharded.Backward(*fwd->saved, device, nullptr);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->grad_hidden.data.empty());
    EXPECT_TRUE(got->grad_weight.data.empty());
    EXPECT_EQ(got->grad_weight.shape, want->grad_weight.shape);
    EXPECT_EQ(dx.Read(), want->grad_hidden.data);
    EXPECT_EQ(dw.Read(), want->grad_weight.data);
    EXPECT_EQ(db.Read(), want->grad_bias->data);
  }
}

// Two CUDA engines sharing the GPU keep a weight in parts, a part per shard
// in its engine's device memory (a registered weight on a server with
// several devices): Forward reads W from the parts, Backward writes and then
// adds dW and db into fp32 sums beside them; the bits of the host path's.
TEST(CudaShardSemanticsTest, TwoEnginesKeepTheWeightInParts) {
  FLCE_TWO_ENGINES_OR_SKIP(sharded, Layout::kVocabularySlices, 3);
  RandomProblemSpec spec = cuda_test::DestinationSpec();
  spec.options.z_loss_scale = 1e-3f;
  const OwnedProblem p = MakeRandomProblem(spec);
  const std::vector<WeightPart> parts = sharded.WeightParts(spec.vocab);
  ASSERT_EQ(parts.size(), 3u);
  // Host memory is page-locked (portably) through the first engine's.
  EXPECT_EQ(sharded.device_memory(), nullptr);
  EXPECT_EQ(sharded.host_locker(), parts[0].memory);
  const int64_t row_bytes = spec.hidden * 2;
  std::vector<std::unique_ptr<DeviceBlock>> w, dw, db;
  LossProblem on_parts = p.view();
  BackwardSpec add;
  add.weight_grad_dtype = DType::kFloat32;
  for (const WeightPart& part : parts) {
    ASSERT_NE(part.memory, nullptr);
    w.push_back(*part.memory->Allocate(part.rows * row_bytes));
    ASSERT_TRUE(part.memory
                    ->CopyToDevice(p.weight.data.data() + part.first * row_bytes, w.back()->data(),
                                   part.rows * row_bytes)
                    .ok());
    on_parts.weight_parts.push_back(TensorView{
        DType::kBFloat16, {part.rows, spec.hidden}, w.back()->data(), MemorySpace::kCuda});
    dw.push_back(*part.memory->Allocate(part.rows * spec.hidden * 4));
    db.push_back(*part.memory->Allocate(part.rows * 4));
    add.grad_weight_parts_to.push_back(GradientDestination{dw.back()->data(), MemorySpace::kCuda});
    add.grad_bias_parts_to.push_back(GradientDestination{db.back()->data(), MemorySpace::kCuda});
  }
  HostTensor poison(p.weight.dtype, p.weight.shape);  // (the parts must be what is read)
  on_parts.weight.data = poison.data.data();
  auto read = [](const std::unique_ptr<DeviceBlock>& block) {
    std::string out(static_cast<size_t>(block->bytes()), '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), block->data(), out.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  };
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    auto host_fwd = sharded.Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(host_fwd.ok()) << host_fwd.status();
    BackwardSpec fp32;
    fp32.weight_grad_dtype = DType::kFloat32;
    auto want = sharded.Backward(*host_fwd->saved, fp32, nullptr);
    ASSERT_TRUE(want.ok()) << want.status();
    for (bool accumulate : {false, true}) {
      auto fwd = sharded.Forward(on_parts, fs, nullptr);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      EXPECT_EQ(fwd->loss.data, host_fwd->loss.data);
      BackwardSpec b = add;
      for (auto* to : {&b.grad_weight_parts_to, &b.grad_bias_parts_to}) {
        for (GradientDestination& d : *to) d.accumulate = accumulate;
      }
      auto got = sharded.Backward(*fwd->saved, b, nullptr);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->grad_hidden.data, want->grad_hidden.data);
      EXPECT_TRUE(got->grad_weight.data.empty());
    }
    // Written once, then added once: twice the host path's fp32 rows, exactly.
    for (size_t k = 0; k < parts.size(); ++k) {
      const std::string sum_w = read(dw[k]), sum_b = read(db[k]);
      const float* got_w = reinterpret_cast<const float*>(sum_w.data());
      const float* got_b = reinterpret_cast<const float*>(sum_b.data());
      const float* want_w = want->grad_weight.data_as<float>() + parts[k].first * spec.hidden;
      const float* want_b = want->grad_bias->data_as<float>() + parts[k].first;
      for (int64_t i = 0; i < parts[k].rows * spec.hidden; ++i) {
        ASSERT_EQ(got_w[i], 2.0f * want_w[i]) << "part " << k << " element " << i;
      }
      for (int64_t i = 0; i < parts[k].rows; ++i) ASSERT_EQ(got_b[i], 2.0f * want_b[i]);
    }
  }
}

// NCCL loads, and a communicator over the one device sums its one part (the
// reduce of a server with several devices, which needs more GPUs to run
// whole: issue 23's run).
TEST(CudaShardSemanticsTest, NcclSumOverOneDevice) {
  std::string why;
  if (cuda_test::Engine(&why) == nullptr) {
    if (RequireGpu()) FAIL() << "REQUIRE_GPU=1 but " << why;
    GTEST_SKIP() << "no CUDA device: " << why;
  }
  absl::StatusOr<std::unique_ptr<PartialSum>> sum = NcclSum({0});
  ASSERT_TRUE(sum.ok()) << sum.status();
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  DeviceBytes part(values.size() * 4);
  ASSERT_EQ(cudaMemcpy(part.data, values.data(), part.size, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE((*sum)->SumIntoFirst({static_cast<float*>(part.data)}, 3).ok());
  std::vector<float> back(3);
  ASSERT_EQ(cudaMemcpy(back.data(), part.data, part.size, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, values);
}

}  // namespace
}  // namespace flce
