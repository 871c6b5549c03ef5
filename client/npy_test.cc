#include "client/npy.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace flce {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

TEST(NpyTest, RoundTripsEveryDType) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kInt32, DType::kInt64}) {
    HostTensor t(dtype, {3, 2});
    for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = static_cast<char>(i * 7);
    const std::string path = TempPath(std::string("t_") + DTypeName(dtype) + ".npy");
    ASSERT_TRUE(WriteNpy(path, t.view()).ok());
    auto back = ReadNpy(path);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype, dtype);
    EXPECT_EQ(back->shape, t.shape);
    EXPECT_EQ(back->data, t.data);
  }
}

TEST(NpyTest, ScalarsAndVectors) {
  HostTensor scalar(DType::kFloat32, {});
  scalar.mutable_data<float>()[0] = 2.5f;
  ASSERT_TRUE(WriteNpy(TempPath("s.npy"), scalar.view()).ok());
  auto s = ReadNpy(TempPath("s.npy"));
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->data_as<float>()[0], 2.5f);
  HostTensor vec(DType::kInt64, {5});
  ASSERT_TRUE(WriteNpy(TempPath("v.npy"), vec.view()).ok());
  EXPECT_EQ(ReadNpy(TempPath("v.npy"))->shape, std::vector<int64_t>({5}));
}

TEST(NpyTest, BFloat16IsWrittenAsExactFloat32) {
  HostTensor t(DType::kBFloat16, {2});
  t.mutable_data<uint16_t>()[0] = FloatToBFloat16(1.5f);
  t.mutable_data<uint16_t>()[1] = FloatToBFloat16(-3.0f);
  ASSERT_TRUE(WriteNpy(TempPath("b.npy"), t.view()).ok());
  auto back = ReadNpy(TempPath("b.npy"));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->dtype, DType::kFloat32);
  EXPECT_EQ(back->data_as<float>()[1], -3.0f);
}

TEST(NpyTest, RejectsMalformedFiles) {
  const std::string path = TempPath("bad.npy");
  std::ofstream(path) << "not numpy";
  EXPECT_EQ(ReadNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadNpy(TempPath("missing.npy")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace flce
