#include "server/weight_registry.h"

#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

HostTensor Weight(int64_t v, int64_t h, float value) {
  HostTensor t(DType::kFloat32, {v, h});
  for (int64_t i = 0; i < v * h; ++i) t.mutable_data<float>()[i] = value;
  return t;
}

TEST(WeightRegistryTest, EachPutIsANewVersion) {
  WeightRegistry registry(1 << 20);
  auto v1 = registry.Put("lm_head", "", Weight(4, 3, 1.0f), std::nullopt);
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_EQ((*v1)->version(), 1);
  auto v2 = registry.Put("lm_head", "", Weight(4, 3, 2.0f), std::nullopt);
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ((*v2)->version(), 2);
  EXPECT_EQ((*registry.Get("lm_head", 0, ""))->version(), 2);
  EXPECT_EQ((*registry.Get("lm_head", 2, ""))->version(), 2);
  EXPECT_THAT(registry.Get("lm_head", 1, ""),
              StatusIs(Code::kNotFound, HasSubstr("version 1 is not registered (the latest is version 2)")));
  // The old version lives on while held.
  EXPECT_EQ((*v1)->weight().data_as<float>()[0], 1.0f);
  EXPECT_EQ(registry.bytes_in_use(), 48);
}

TEST(WeightRegistryTest, NamesAreCheckedAndPerPrincipal) {
  WeightRegistry registry(1 << 20);
  EXPECT_THAT(registry.Put("bad name", "", Weight(1, 1, 0), std::nullopt),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.name")));
  EXPECT_THAT(registry.Put("", "", Weight(1, 1, 0), std::nullopt),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.name")));
  ASSERT_TRUE(registry.Put("w", "alice", Weight(1, 1, 0), std::nullopt).ok());
  EXPECT_THAT(registry.Get("w", 0, "bob"), StatusIs(Code::kNotFound, HasSubstr("no weight named")));
  EXPECT_FALSE(registry.Delete("w", "bob"));
  EXPECT_EQ(registry.List("alice").size(), 1u);
  EXPECT_TRUE(registry.List("bob").empty());
}

TEST(WeightRegistryTest, BudgetIsResourceExhaustedAndReplacingCountsOnce) {
  WeightRegistry registry(100);
  ASSERT_TRUE(registry.Put("w", "", Weight(5, 4, 0), std::nullopt).ok());  // 80 bytes
  // Replacing w frees its 80 bytes first.
  ASSERT_TRUE(registry.Put("w", "", Weight(5, 4, 0), std::nullopt).ok());
  EXPECT_THAT(registry.Put("x", "", Weight(2, 4, 0), std::nullopt),
              StatusIs(Code::kResourceExhausted, HasSubstr("needs 32 bytes, 80 of the budget of 100")));
}

TEST(WeightRegistryTest, DeleteIsIdempotentAndVersionsAreNeverReused) {
  WeightRegistry registry(1 << 20);
  ASSERT_TRUE(registry.Put("w", "", Weight(1, 1, 0), std::nullopt).ok());
  EXPECT_TRUE(registry.Delete("w", ""));
  EXPECT_FALSE(registry.Delete("w", ""));
  EXPECT_EQ(registry.bytes_in_use(), 0);
  EXPECT_EQ((*registry.Put("w", "", Weight(1, 1, 0), std::nullopt))->version(), 2);
}

TEST(WeightRegistryTest, GradientAccumulatesTakesAndRestores) {
  WeightRegistry registry(1 << 20);
  HostTensor bias(DType::kFloat32, {2});
  auto w = *registry.Put("w", "", Weight(2, 2, 0), bias);
  EXPECT_THAT(w->TakeGrad(), StatusIs(Code::kFailedPrecondition, HasSubstr("no gradient")));
  HostTensor db(DType::kFloat32, {2});
  db.mutable_data<float>()[0] = db.mutable_data<float>()[1] = 0.5f;
  w->AccumulateGrad(Weight(2, 2, 1.0f), db);
  w->AccumulateGrad(Weight(2, 2, 2.0f), db);
  EXPECT_EQ(w->accumulated_backwards(), 2);
  auto grad = w->TakeGrad();
  ASSERT_TRUE(grad.ok());
  EXPECT_EQ(grad->backwards, 2);
  EXPECT_EQ(grad->dw.data_as<float>()[3], 3.0f);
  EXPECT_EQ(grad->db->data_as<float>()[1], 1.0f);
  EXPECT_EQ(w->accumulated_backwards(), 0);
  w->AccumulateGrad(Weight(2, 2, 1.0f), db);
  w->RestoreGrad(*std::move(grad));
  auto again = w->TakeGrad();
  EXPECT_EQ(again->backwards, 3);
  EXPECT_EQ(again->dw.data_as<float>()[0], 4.0f);
}

// Large gradients are summed on OpenBLAS's threads: the same bits as adding
// element by element in fp32.
TEST(WeightRegistryTest, LargeGradientsSumExactlyAsPlainFloatAdds) {
  WeightRegistry registry(int64_t{1} << 30);
  auto w = *registry.Put("w", "", Weight(301, 257, 0), std::nullopt);
  HostTensor a(DType::kFloat32, {301, 257}), b(DType::kFloat32, {301, 257});
  std::vector<float> want(a.num_elements());
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    a.mutable_data<float>()[i] = 1.0f / static_cast<float>(i + 3);
    b.mutable_data<float>()[i] = static_cast<float>(i % 97) * 1e-3f - 0.04f;
    want[i] = a.data_as<float>()[i] + b.data_as<float>()[i];
  }
  w->AccumulateGrad(std::move(a), std::nullopt);
  w->AccumulateGrad(std::move(b), std::nullopt);
  auto grad = w->TakeGrad();
  ASSERT_TRUE(grad.ok());
  EXPECT_EQ(std::memcmp(grad->dw.data_as<float>(), want.data(), want.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace flce
