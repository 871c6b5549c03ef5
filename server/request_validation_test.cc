// Every malformed request of DESIGN.md §1 gets its code and a message naming
// the field and the values.

#include "server/request_validation.h"

#include <cmath>
#include <algorithm>
#include <functional>
#include <memory>
#include <string>

#include "client/loss_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/random_problem.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

class RequestValidationTest : public ::testing::Test {
 protected:
  RequestValidationTest() {
    RandomProblemSpec spec;
    spec.rows = 5;
    spec.hidden = 4;
    spec.vocab = 7;
    spec.dtype = DType::kBFloat16;
    spec.bias = true;
    spec.class_weight = true;
    problem_ = MakeRandomProblem(spec);
    ForwardArgs args;
    args.problem = problem_.view();
    args.need_backward = true;
    valid_ = BuildForwardRequest(args);
  }

  // Applies `mutate` to a copy of the valid request and decodes it.
  absl::Status Decode(const std::function<void(v1::ForwardRequest&)>& mutate) {
    v1::ForwardRequest r = valid_;
    mutate(r);
    return DecodeForward(r, weights_, "").status();
  }

  OwnedProblem problem_;
  v1::ForwardRequest valid_;
  WeightRegistry weights_{int64_t{1} << 30};
};

TEST_F(RequestValidationTest, ValidRequestDecodes) {
  auto call = DecodeForward(valid_, weights_, "");
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->problem.rows(), 5);
  EXPECT_EQ(call->problem.vocab(), 7);
  EXPECT_TRUE(call->problem.bias.has_value());
  EXPECT_TRUE(call->need_backward);
  EXPECT_EQ(call->problem.options.ignore_index, -100);
}

// A resolver of one region: `memory`, which the test may change.
class OneRegion : public SliceResolver {
 public:
  explicit OneRegion(std::string* memory) : memory_(memory) {}
  absl::StatusOr<SliceMemory> Resolve(const SliceRef& slice, int64_t bytes,
                                      const std::string&) const override {
    if (slice.offset + bytes > static_cast<int64_t>(memory_->size())) {
      return absl::InvalidArgumentError("out of the region");
    }
    return SliceMemory{&(*memory_)[slice.offset], MemorySpace::kHost};
  }

 private:
  std::string* memory_;
};

// Targets and class weights in shared memory are validated on a private
// copy, which is what the engine reads: rewriting the region afterwards
// changes nothing.
TEST_F(RequestValidationTest, ValidatedSharedMemoryIsCopied) {
  std::string region = valid_.target().data() + valid_.options().class_weight().data() +
                       valid_.hidden().data();
  v1::ForwardRequest r = valid_;
  const int64_t t = static_cast<int64_t>(valid_.target().data().size());
  auto place = [&](v1::Tensor* tensor, int64_t offset) {
    tensor->clear_data();
    tensor->mutable_shm()->set_region_id("r");
    tensor->mutable_shm()->set_offset(offset);
  };
  place(r.mutable_target(), 0);
  place(r.mutable_options()->mutable_class_weight(), t);
  place(r.mutable_hidden(), t + static_cast<int64_t>(valid_.options().class_weight().data().size()));
  auto call = DecodeForward(r, weights_, "", std::make_shared<OneRegion>(&region));
  ASSERT_TRUE(call.ok()) << call.status();
  const std::string targets(static_cast<const char*>(call->problem.target.data),
                            static_cast<size_t>(t));
  EXPECT_EQ(targets, valid_.target().data());
  EXPECT_NE(call->problem.target.data, region.data());
  EXPECT_NE(call->problem.class_weight->data, region.data() + t);
  // Hidden states are read in place (their values are not checked).
  EXPECT_EQ(call->problem.hidden.data, region.data() + t + valid_.options().class_weight().data().size());
  std::fill(region.begin(), region.end(), '\xff');
  EXPECT_EQ(std::string(static_cast<const char*>(call->problem.target.data), static_cast<size_t>(t)),
            valid_.target().data());
}

TEST_F(RequestValidationTest, MissingTensors) {
  EXPECT_THAT(Decode([](auto& r) { r.clear_hidden(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden: required")));
  EXPECT_THAT(Decode([](auto& r) { r.clear_weight(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight: required")));
  EXPECT_THAT(Decode([](auto& r) { r.clear_target(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target: required")));
}

TEST_F(RequestValidationTest, ByteLengthMismatch) {
  EXPECT_THAT(Decode([](auto& r) { r.mutable_hidden()->mutable_data()->pop_back(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden: expected 5×4 bf16 = 40 bytes, got 39")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_weight()->mutable_data()->append("xx"); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight: expected 7×4 bf16 = 56 bytes, got 58")));
}

TEST_F(RequestValidationTest, UnknownAndUnsupportedDTypes) {
  EXPECT_THAT(Decode([](auto& r) { r.mutable_hidden()->set_dtype(v1::DType(42)); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden: unknown dtype 42")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_hidden()->set_dtype(v1::DTYPE_INT32);
                    r.mutable_hidden()->mutable_data()->append(40, '\0');
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden: dtype int32 not supported")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_weight()->set_dtype(v1::DTYPE_FLOAT16);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight: dtype fp16 differs from hidden's bf16")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_target()->set_dtype(v1::DTYPE_FLOAT32);
                    r.mutable_target()->mutable_data()->resize(20);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target: dtype fp32 not supported")));
}

TEST_F(RequestValidationTest, ShapeMismatches) {
  EXPECT_THAT(Decode([](auto& r) { r.mutable_hidden()->add_shape(1); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden: expected rank 2 [N, H], got shape 5×4×1")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_weight()->set_shape(1, 2);
                    r.mutable_weight()->set_shape(0, 14);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight: expected [V, H=4] to match hidden 5×4, got 14×2")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_target()->set_shape(0, 4);
                    r.mutable_target()->mutable_data()->resize(32);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target: expected shape [N] = 5, got 4")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_bias()->set_shape(0, 6);
                    r.mutable_bias()->mutable_data()->resize(12);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bias: expected shape [V] = 7, got 6")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_options()->mutable_class_weight()->set_shape(0, 3);
                    r.mutable_options()->mutable_class_weight()->mutable_data()->resize(12);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.class_weight: expected shape [V] = 7, got 3")));
}

TEST_F(RequestValidationTest, ZeroSizedDimensions) {
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_hidden()->set_shape(1, 0);
                    r.mutable_hidden()->clear_data();
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden: H is 0")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_weight()->set_shape(0, 0);
                    r.mutable_weight()->clear_data();
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight: V is 0")));
  // N = 0 is valid.
  EXPECT_TRUE(Decode([](auto& r) {
                r.mutable_hidden()->set_shape(0, 0);
                r.mutable_hidden()->clear_data();
                r.mutable_target()->set_shape(0, 0);
                r.mutable_target()->clear_data();
              }).ok());
}

TEST_F(RequestValidationTest, TargetOutOfRangeNamesFirstBadRow) {
  EXPECT_THAT(Decode([](auto& r) {
                    int64_t* t = reinterpret_cast<int64_t*>(&(*r.mutable_target()->mutable_data())[0]);
                    t[2] = 7;
                    t[4] = -3;
                  }),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("target[2] = 7 is outside [0, 7) and is not ignore_index (-100)")));
  EXPECT_THAT(Decode([](auto& r) {
                    int64_t* t = reinterpret_cast<int64_t*>(&(*r.mutable_target()->mutable_data())[0]);
                    t[1] = -1;
                  }),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("target[1] = -1")));
  // ignore_index itself is fine, even outside [0, V).
  EXPECT_TRUE(Decode([](auto& r) {
                int64_t* t = reinterpret_cast<int64_t*>(&(*r.mutable_target()->mutable_data())[0]);
                t[0] = -100;
              }).ok());
}

TEST_F(RequestValidationTest, BadOptionValues) {
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_label_smoothing(1.0f); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.label_smoothing: 1 is not in [0, 1)")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_label_smoothing(-0.1f); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.label_smoothing")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_label_smoothing(NAN); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.label_smoothing: nan")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_logit_softcap(0.0f); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.logit_softcap: 0 must be finite and > 0")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_logit_softcap(INFINITY); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.logit_softcap: inf")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_z_loss_scale(-1.0f); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.z_loss_scale: -1 must be finite and >= 0")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_z_loss_scale(NAN); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.z_loss_scale: nan")));
  EXPECT_THAT(Decode([](auto& r) { r.mutable_options()->set_reduction(v1::Reduction(9)); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.reduction: unknown value 9")));
  EXPECT_THAT(Decode([](auto& r) { r.set_backward_mode(v1::BackwardMode(5)); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backward_mode: unknown value 5")));
  EXPECT_THAT(Decode([](auto& r) {
                    float* w = reinterpret_cast<float*>(
                        &(*r.mutable_options()->mutable_class_weight()->mutable_data())[0]);
                    w[3] = -1.0f;
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.class_weight[3] = -1")));
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_options()->mutable_class_weight()->set_dtype(v1::DTYPE_BFLOAT16);
                    r.mutable_options()->mutable_class_weight()->mutable_data()->resize(14);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.class_weight: dtype bf16 not supported")));
}

TEST_F(RequestValidationTest, StoreGradsCannotServeReductionNone) {
  EXPECT_THAT(Decode([](auto& r) {
                    r.mutable_options()->set_reduction(v1::REDUCTION_NONE);
                    r.set_backward_mode(v1::BACKWARD_MODE_STORE_GRADS);
                  }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backward_mode: STORE_GRADS cannot serve reduction none")));
  // Without need_backward the mode is irrelevant.
  EXPECT_TRUE(Decode([](auto& r) {
                r.mutable_options()->set_reduction(v1::REDUCTION_NONE);
                r.set_backward_mode(v1::BACKWARD_MODE_STORE_GRADS);
                r.set_need_backward(false);
              }).ok());
}

TEST_F(RequestValidationTest, WeightRefIsResolvedAndChecked) {
  auto registered = weights_.Put("head", "", HostTensor(problem_.weight), problem_.bias);
  ASSERT_TRUE(registered.ok());
  v1::ForwardRequest r = valid_;
  r.mutable_weight_ref()->set_name("head");
  EXPECT_THAT(DecodeForward(r, weights_, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bias: must be absent")));
  r.clear_bias();
  auto call = DecodeForward(r, weights_, "");
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->weight_ref, *registered);
  EXPECT_EQ(call->problem.weight.data, (*registered)->weight().data.data());
  EXPECT_TRUE(call->problem.bias.has_value());
  r.mutable_weight_ref()->set_version(7);
  EXPECT_THAT(DecodeForward(r, weights_, ""),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("version 7")));
  r.mutable_weight_ref()->set_name("other");
  EXPECT_THAT(DecodeForward(r, weights_, ""),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no weight named 'other'")));
  // Another principal does not see it.
  r.mutable_weight_ref()->set_name("head");
  r.mutable_weight_ref()->set_version(0);
  EXPECT_THAT(DecodeForward(r, weights_, "mallory"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no weight named")));
}

TEST(DecodeBackwardTest, ChecksSessionIdAndGradDType) {
  v1::BackwardRequest r;
  EXPECT_THAT(DecodeBackward(r).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("session_id: required")));
  r.set_session_id("abc");
  r.set_grad_dtype(v1::DTYPE_BFLOAT16);
  EXPECT_THAT(DecodeBackward(r).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grad_dtype: DTYPE_BFLOAT16 not supported")));
  r.set_grad_dtype(v1::DTYPE_FLOAT32);
  EXPECT_TRUE(DecodeBackward(r).ok());
}

TEST(DecodeBackwardTest, GradOutputIsConvertedToFloat32AndShapeChecked) {
  v1::BackwardRequest r;
  r.set_session_id("abc");
  v1::Tensor* g = r.mutable_grad_output();
  g->set_dtype(v1::DTYPE_BFLOAT16);
  g->add_shape(3);
  const uint16_t values[3] = {FloatToBFloat16(1.0f), FloatToBFloat16(-2.0f),
                              FloatToBFloat16(0.5f)};
  g->set_data(reinterpret_cast<const char*>(values), sizeof(values));
  auto call = DecodeBackward(r);
  ASSERT_TRUE(call.ok());
  EXPECT_EQ(call->grad_output->dtype, DType::kFloat32);
  EXPECT_EQ(call->grad_output->data_as<float>()[1], -2.0f);
  SessionInfo none{Reduction::kNone, 3};
  EXPECT_TRUE(CheckGradOutput(*call, none).ok());
  none.rows = 4;
  EXPECT_THAT(CheckGradOutput(*call, none),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grad_output: expected shape [N] = 4 for reduction none, got 3")));
  SessionInfo mean{Reduction::kMean, 3};
  EXPECT_THAT(CheckGradOutput(*call, mean),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grad_output: expected a scalar (shape [] or [1]) for reduction mean, got 3")));
}

}  // namespace
}  // namespace flce
