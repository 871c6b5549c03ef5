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

}  // namespace
}  // namespace flce
