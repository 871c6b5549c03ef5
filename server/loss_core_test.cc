#include "server/loss_core.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/reference/random_problem.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

class LossCoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Remake(SessionLimits{}); }

  void Remake(SessionLimits limits) {
    sessions_ = std::make_unique<SessionStore>(limits);
    core_ = std::make_unique<LossCore>(&engine_, sessions_.get(), &weights_);
  }

  ForwardCall Call(Reduction reduction, BackwardMode mode) {
    RandomProblemSpec spec;
    spec.rows = 9;
    spec.hidden = 8;
    spec.vocab = 50;
    spec.dtype = DType::kBFloat16;
    spec.options.reduction = reduction;
    problem_ = MakeRandomProblem(spec);
    ForwardCall call;
    call.problem = problem_.view();
    call.need_backward = true;
    call.requested_mode = mode;
    return call;
  }

  CpuEngine engine_;
  WeightRegistry weights_{int64_t{1} << 30};
  std::unique_ptr<SessionStore> sessions_;
  std::unique_ptr<LossCore> core_;
  OwnedProblem problem_;
};

TEST_F(LossCoreTest, AutoPicksStoreGradsUnlessReductionNone) {
  EXPECT_EQ(
      core_->ResolveMode(Call(Reduction::kMean, BackwardMode::kAuto).problem, BackwardMode::kAuto),
      BackwardMode::kStoreGrads);
  EXPECT_EQ(
      core_->ResolveMode(Call(Reduction::kNone, BackwardMode::kAuto).problem, BackwardMode::kAuto),
      BackwardMode::kRecompute);
  EXPECT_EQ(core_->ResolveMode(Call(Reduction::kSum, BackwardMode::kRecompute).problem,
                               BackwardMode::kRecompute),
            BackwardMode::kRecompute);
}

TEST_F(LossCoreTest, AutoPicksRecomputeWhenStoreGradsWouldNotFit) {
  ForwardCall call = Call(Reduction::kMean, BackwardMode::kAuto);
  const int64_t store = engine_.SavedStateBytes(call.problem, BackwardMode::kStoreGrads);
  const int64_t recompute = engine_.SavedStateBytes(call.problem, BackwardMode::kRecompute);
  ASSERT_LT(recompute, store);
  Remake(SessionLimits{16, recompute, absl::Minutes(1)});
  call = Call(Reduction::kMean, BackwardMode::kAuto);
  EXPECT_EQ(core_->ResolveMode(call.problem, call.requested_mode), BackwardMode::kRecompute);
  auto outcome = core_->Forward(call, "", nullptr);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->mode, BackwardMode::kRecompute);
  EXPECT_EQ(sessions_->bytes_in_use(), recompute);
}

TEST_F(LossCoreTest, OverBudgetIsResourceExhaustedAndComputesNothing) {
  Remake(SessionLimits{16, 100, absl::Minutes(1)});
  auto outcome = core_->Forward(Call(Reduction::kMean, BackwardMode::kAuto), "", [] {
    ADD_FAILURE() << "engine ran";
    return false;
  });
  EXPECT_THAT(outcome, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstr("of the budget of 100 bytes")));
  EXPECT_EQ(sessions_->bytes_in_use(), 0);
}

TEST_F(LossCoreTest, EvaluationKeepsNoSession) {
  ForwardCall call = Call(Reduction::kMean, BackwardMode::kAuto);
  call.need_backward = false;
  auto outcome = core_->Forward(call, "", nullptr);
  ASSERT_TRUE(outcome.ok());
  EXPECT_TRUE(outcome->session_id.empty());
  EXPECT_EQ(sessions_->live_sessions(), 0);
}

TEST_F(LossCoreTest, BadGradOutputLeavesTheSessionUsable) {
  auto outcome = core_->Forward(Call(Reduction::kNone, BackwardMode::kAuto), "", nullptr);
  ASSERT_TRUE(outcome.ok());
  BackwardCall call;
  call.session_id = outcome->session_id;
  call.grad_output = HostTensor(DType::kFloat32, {3});
  EXPECT_THAT(core_->Backward(call, "", nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grad_output")));
  call.grad_output = HostTensor(DType::kFloat32, {9});
  for (int64_t i = 0; i < 9; ++i) call.grad_output->mutable_data<float>()[i] = 1.0f;
  auto grads = core_->Backward(call, "", nullptr);
  ASSERT_TRUE(grads.ok());
  core_->Answered(*grads);
  core_->Settle(*grads, /*delivered=*/true);
  EXPECT_THAT(core_->Backward(call, "", nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("consumed")));
  EXPECT_EQ(sessions_->bytes_in_use(), 0);
}

// Gradients that never reached the client leave the session as it was: the
// same Backward runs again and gives the same bits.
TEST_F(LossCoreTest, AnUndeliveredBackwardLeavesTheSessionAsItWas) {
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    auto outcome = core_->Forward(Call(Reduction::kSum, mode), "", nullptr);
    ASSERT_TRUE(outcome.ok());
    BackwardCall call;
    call.session_id = outcome->session_id;
    auto lost = core_->Backward(call, "", nullptr);
    ASSERT_TRUE(lost.ok());
    const std::string first = lost->grad_weight->data;
    core_->Answered(*lost);
    EXPECT_EQ(sessions_->live_sessions(), 0);  // consumed, pending its delivery
    core_->Settle(*lost, /*delivered=*/false);
    EXPECT_EQ(sessions_->live_sessions(), 1);
    auto again = core_->Backward(call, "", nullptr);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->grad_weight->data, first);
    core_->Answered(*again);
    core_->Settle(*again, /*delivered=*/true);
    EXPECT_EQ(sessions_->live_sessions(), 0);
  }
}

// An accumulating Backward whose dX was lost added its dW already: only its
// retry may run, which returns the same dX and adds nothing.
TEST_F(LossCoreTest, AnUndeliveredAccumulationIsRetriedNotAddedTwice) {
  RandomProblemSpec spec;
  spec.rows = 9;
  spec.hidden = 8;
  spec.vocab = 50;
  spec.options.reduction = Reduction::kSum;
  OwnedProblem p = MakeRandomProblem(spec);
  HostTensor w(DType::kFloat32, {50, 8});
  std::memcpy(w.mutable_data<float>(), p.view().weight.data, w.data.size());
  auto weight = *weights_.Put("head", "", std::move(w), std::nullopt);
  ForwardCall forward;
  forward.problem = p.view();
  forward.problem.weight = weight->weight().view();
  forward.weight_ref = weight;
  forward.need_backward = true;
  auto session = core_->Forward(forward, "", nullptr);
  ASSERT_TRUE(session.ok()) << session.status();
  BackwardCall call;
  call.session_id = session->session_id;
  call.accumulate_weight_grad = true;
  call.grad_output = HostTensor(DType::kFloat32, {});
  call.grad_output->mutable_data<float>()[0] = 0.5f;
  auto lost = core_->Backward(call, "", nullptr);
  ASSERT_TRUE(lost.ok()) << lost.status();
  const std::string dx = lost->grad_hidden.data;
  core_->Answered(*lost);
  core_->Settle(*lost, /*delivered=*/false);
  EXPECT_EQ(weight->accumulated_backwards(), 1);
  // Anything but the same call is refused.
  BackwardCall other = call;
  other.grad_output->mutable_data<float>()[0] = 1.0f;
  EXPECT_THAT(core_->Backward(other, "", nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("retry of that call")));
  BackwardCall plain = call;
  plain.accumulate_weight_grad = false;
  EXPECT_THAT(core_->Backward(plain, "", nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("did not reach")));
  auto retry = core_->Backward(call, "", nullptr);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->grad_hidden.data, dx);
  core_->Answered(*retry);
  core_->Settle(*retry, /*delivered=*/true);
  EXPECT_EQ(weight->accumulated_backwards(), 1);
  EXPECT_EQ(sessions_->live_sessions(), 0);
}

TEST_F(LossCoreTest, CancelledForwardKeepsNoSession) {
  auto outcome =
      core_->Forward(Call(Reduction::kMean, BackwardMode::kStoreGrads), "", [] { return true; });
  EXPECT_THAT(outcome, StatusIs(absl::StatusCode::kCancelled, HasSubstr("cancelled")));
  EXPECT_EQ(sessions_->live_sessions(), 0);
  EXPECT_EQ(sessions_->bytes_in_use(), 0);
}

// StageAhead on an engine whose "device" is host memory: a staged copy is
// a plain copy, and Forward reads X from it (checking that it was told to
// wait for the copy's event), on the CPU engine.
class HostStaging : public DeviceMemory {
 public:
  class Block : public DeviceBlock {
   public:
    Block(const void* host, int64_t bytes) : bytes_(static_cast<const char*>(host), bytes) {}
    void* data() const override { return const_cast<char*>(bytes_.data()); }
    int64_t bytes() const override { return static_cast<int64_t>(bytes_.size()); }

   private:
    std::string bytes_;
  };
  class Event : public DeviceEvent {
   public:
    void* native() const override { return nullptr; }
  };

  absl::StatusOr<StagedCopy> StageToDevice(const void* host, int64_t bytes) override {
    if (refuse) return absl::ResourceExhaustedError("no room");
    ++staged;
    return StagedCopy{std::make_unique<Block>(host, bytes), std::make_unique<Event>()};
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpc(const std::string&) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<std::unique_ptr<DeviceEvent>> ImportCudaIpcEvent(const std::string&) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> Allocate(int64_t) override {
    return absl::UnimplementedError("");
  }
  absl::Status CopyToHost(const void*, void*, int64_t) override {
    return absl::UnimplementedError("");
  }
  absl::Status CopyToDevice(const void*, void*, int64_t) override {
    return absl::UnimplementedError("");
  }
  absl::Status Zero(void*, int64_t) override { return absl::UnimplementedError(""); }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> PinHostMemory(void*, int64_t) override {
    return absl::UnimplementedError("");
  }

  int staged = 0;
  bool refuse = false;
};

class HostStagingEngine : public LossEngine {
 public:
  std::string backend() const override { return cpu_.backend(); }
  std::vector<DeviceInfo> devices() const override { return {}; }
  int64_t SavedStateBytes(const LossProblem& p, BackwardMode mode) const override {
    return cpu_.SavedStateBytes(p, mode);
  }
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override {
    LossProblem p = problem;
    if (p.hidden.space == MemorySpace::kCuda) {
      ++staged_forwards;
      EXPECT_NE(p.ready, nullptr) << "the call must wait for the copy";
      EXPECT_NE(p.device_owner, nullptr) << "the copy must live as long as the call's state";
      p.hidden.space = MemorySpace::kHost;
    }
    return cpu_.Forward(p, spec, cancelled);
  }
  absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                     const CancelFn& cancelled) override {
    return cpu_.Backward(state, spec, cancelled);
  }
  DeviceMemory* device_memory() const override { return &device; }

  mutable HostStaging device;
  int staged_forwards = 0;

 private:
  CpuEngine cpu_;
};

class StageAheadTest : public LossCoreTest {
 protected:
  // The sessions (state of the engine's) go before the engine.
  void TearDown() override {
    staging_core_.reset();
    sessions_.reset();
  }
  void Make(int64_t budget) {
    sessions_ = std::make_unique<SessionStore>(SessionLimits{});
    staging_core_ = std::make_unique<LossCore>(&staging_, sessions_.get(), &weights_, budget);
  }
  int64_t XBytes() {
    return Call(Reduction::kMean, BackwardMode::kStoreGrads).problem.hidden.bytes();
  }

  HostStagingEngine staging_;
  std::unique_ptr<LossCore> staging_core_;
};

TEST_F(StageAheadTest, TheCallReadsXAsItWasWhenItArrived) {
  ForwardCall call = Call(Reduction::kMean, BackwardMode::kStoreGrads);
  auto plain = core_->Forward(call, "", nullptr);
  ASSERT_TRUE(plain.ok()) << plain.status();
  Make(int64_t{1} << 20);
  std::shared_ptr<LossCore::Staged> staged = staging_core_->StageAhead(call);
  ASSERT_NE(staged, nullptr);
  // The region's bytes change after the copy: the call computes on the copy.
  std::memset(const_cast<void*>(call.problem.hidden.data), 0, call.problem.hidden.bytes());
  auto outcome = staging_core_->Forward(call, "", nullptr, nullptr, std::move(staged));
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(staging_.staged_forwards, 1);
  EXPECT_EQ(outcome->result.loss.data, plain->result.loss.data);
  // Its session's state holds the copy; its Backward runs.
  BackwardCall backward;
  backward.session_id = outcome->session_id;
  auto grads = staging_core_->Backward(backward, "", nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();
}

TEST_F(StageAheadTest, StagingHoldsItsBudgetOnlyUntilTheCallRuns) {
  const int64_t x = XBytes();
  Make(2 * x);
  ForwardCall a = Call(Reduction::kMean, BackwardMode::kStoreGrads);
  std::shared_ptr<LossCore::Staged> first = staging_core_->StageAhead(a);
  std::shared_ptr<LossCore::Staged> second = staging_core_->StageAhead(a);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(staging_core_->StageAhead(a), nullptr) << "over the budget: uploaded in its call";
  second.reset();  // a call dropped before it ran gives its part back
  std::shared_ptr<LossCore::Staged> third = staging_core_->StageAhead(a);
  ASSERT_NE(third, nullptr);
  // A call that runs gives its part back while its session keeps the copy.
  auto outcome = staging_core_->Forward(a, "", nullptr, nullptr, std::move(first));
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(sessions_->live_sessions(), 1);
  EXPECT_NE(staging_core_->StageAhead(a), nullptr);
  EXPECT_EQ(staging_.device.staged, 4);
  EXPECT_EQ(staging_core_->forwards_staged(), 4);
}

TEST_F(StageAheadTest, NoStagingWithoutBudgetOrWhereTheCopyIsRefused) {
  ForwardCall call = Call(Reduction::kMean, BackwardMode::kStoreGrads);
  Make(0);
  EXPECT_EQ(staging_core_->StageAhead(call), nullptr);
  Make(int64_t{1} << 20);
  staging_.device.refuse = true;
  EXPECT_EQ(staging_core_->StageAhead(call), nullptr);
  staging_.device.refuse = false;
  // The refused copy gave its part back: the whole budget stages again.
  const int64_t x = call.problem.hidden.bytes();
  Make(x);
  EXPECT_NE(staging_core_->StageAhead(call), nullptr);
  EXPECT_EQ(core_->StageAhead(call), nullptr) << "an engine without a device stages nothing";
}

}  // namespace
}  // namespace flce
