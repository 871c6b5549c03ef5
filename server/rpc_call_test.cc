#include "server/rpc_call.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/flce/v1/loss_service.pb.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

TEST(LogSafeTest, KeepsPrintableTextAndEscapesTheRest) {
  EXPECT_EQ(LogSafe("lm_head-1.v2"), "lm_head-1.v2");
  EXPECT_EQ(LogSafe("a\nrpc=Forward code=OK"), "a\\x0arpc=Forward code=OK");
  EXPECT_EQ(LogSafe("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(LogSafe("back\\slash"), "back\\x5cslash");
  EXPECT_EQ(LogSafe("\xc3\xa9"), "\\xc3\\xa9");
}

TEST(LogSafeTest, BoundsLongText) {
  const std::string huge(1 << 20, 'x');
  const std::string safe = LogSafe(huge, 16);
  EXPECT_EQ(safe, std::string(16, 'x') + "…(+1048560 bytes)");
}

TEST(ParseMessageTest, GarbageIsInvalidArgumentNamingTheType) {
  const std::string garbage = "\xff\xff\xff\xff\x0f";
  grpc::Slice slice(garbage);
  grpc::ByteBuffer bytes(&slice, 1);
  v1::ForwardRequest request;
  absl::Status status = ParseMessage(bytes, &request);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("flce.v1.ForwardRequest"));
}

TEST(ParseMessageTest, RoundTripsAndBoundsTheSize) {
  v1::ReleaseSessionRequest request;
  request.set_session_id(std::string(100, 'a'));
  grpc::ByteBuffer bytes;
  ASSERT_TRUE(SerializeMessage(request, 1 << 20, "test", &bytes).ok());
  v1::ReleaseSessionRequest back;
  ASSERT_TRUE(ParseMessage(bytes, &back).ok());
  EXPECT_EQ(back.session_id(), request.session_id());
  absl::Status over = SerializeMessage(request, 10, "Backward response", &bytes);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.message()), HasSubstr("--max_message_bytes"));
}

TEST(GuardMemoryTest, AnAllocationFailureIsResourceExhausted) {
  absl::Status status = GuardMemory([]() -> absl::Status { throw std::bad_alloc(); }, "Forward");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("Forward: out of host memory"));
}

}  // namespace
}  // namespace flce
