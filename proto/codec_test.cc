#include "proto/codec.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

v1::Tensor Wire(v1::DType dtype, std::vector<int64_t> shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\0'));
  return t;
}

TEST(CodecTest, ViewOfChecksByteLength) {
  auto ok = ViewOf(Wire(v1::DTYPE_BFLOAT16, {3, 5}, 30), "hidden");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->dtype, DType::kBFloat16);
  EXPECT_EQ(ok->num_elements(), 15);
  auto bad = ViewOf(Wire(v1::DTYPE_BFLOAT16, {3, 5}, 29), "hidden");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "hidden: expected 3×5 bf16 = 30 bytes, got 29");
}

TEST(CodecTest, ViewOfRejectsUnknownDTypeNegativeAndHugeShapes) {
  auto unknown = ViewOf(Wire(v1::DTYPE_UNSPECIFIED, {1}, 4), "weight");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("weight: unknown dtype 0"));
  auto negative = ViewOf(Wire(v1::DTYPE_FLOAT32, {2, -1}, 0), "bias");
  EXPECT_THAT(negative.status().message(), HasSubstr("bias: dimension 1 is -1"));
  auto huge = ViewOf(Wire(v1::DTYPE_FLOAT32, {int64_t{1} << 40, int64_t{1} << 40}, 0), "hidden");
  EXPECT_THAT(huge.status().message(), HasSubstr("too large"));
}

TEST(CodecTest, ScalarShapeHasOneElement) {
  auto scalar = ViewOf(Wire(v1::DTYPE_FLOAT32, {}, 4), "grad_output");
  ASSERT_TRUE(scalar.ok());
  EXPECT_EQ(scalar->num_elements(), 1);
}

TEST(CodecTest, HostTensorRoundTrip) {
  HostTensor t(DType::kInt64, {2});
  t.mutable_data<int64_t>()[0] = 7;
  t.mutable_data<int64_t>()[1] = -9;
  v1::Tensor wire;
  MoveToProto(std::move(t), &wire);
  auto back = MoveFromProto(&wire, "target");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->shape, std::vector<int64_t>({2}));
  EXPECT_EQ(back->data_as<int64_t>()[1], -9);
}

TEST(CodecTest, StatusRoundTripKeepsCodeAndMessage) {
  const absl::Status s = absl::OutOfRangeError("target[3] = 9");
  const grpc::Status g = ToGrpcStatus(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(g.error_message(), "target[3] = 9");
  EXPECT_EQ(FromGrpcStatus(g), s);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

TEST(CodecTest, EnumsRoundTrip) {
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    EXPECT_EQ(FromProto(ToProto(r)), r);
  }
  for (BackwardMode m : {BackwardMode::kAuto, BackwardMode::kStoreGrads,
                         BackwardMode::kRecompute}) {
    EXPECT_EQ(FromProto(ToProto(m)), m);
  }
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                  DType::kInt32, DType::kInt64}) {
    EXPECT_EQ(*FromProto(ToProto(d), "x"), d);
  }
}

}  // namespace
}  // namespace flce
