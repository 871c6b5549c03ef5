#include "server/rpc_call.h"

#include <memory>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/flce/v1/loss_service.pb.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

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

// The default logger writing into `out` at `level` while alive.
class CapturedLog {
 public:
  CapturedLog(std::ostringstream& out, spdlog::level::level_enum level)
      : previous_(spdlog::default_logger()) {
    auto logger = std::make_shared<spdlog::logger>(
        "captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
    logger->set_level(level);
    spdlog::set_default_logger(logger);
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }

 private:
  std::shared_ptr<spdlog::logger> previous_;
};

TEST(CallRecordTest, StampsGoOutAsATimelineAtDebugLevelOnly) {
  std::ostringstream debug, info;
  {
    CapturedLog log(debug, spdlog::level::debug);
    CallRecord record(nullptr, "Forward");
    record.Stamp("parsed");
    record.Stamp("answered");
    record.SetAnswer(absl::OkStatus());
    record.Over(nullptr);
  }
  EXPECT_THAT(debug.str(), HasSubstr("rpc=Forward code=OK"));
  EXPECT_THAT(debug.str(),
              ::testing::ContainsRegex("rpc=Forward timeline start_mono_us=[0-9]+ parsed=\\+[0-9]+ "
                                       "answered=\\+[0-9]+ over=\\+[0-9]+"));
  {
    CapturedLog log(info, spdlog::level::info);
    CallRecord record(nullptr, "Forward");
    record.Stamp("parsed");
    record.SetAnswer(absl::OkStatus());
    record.Over(nullptr);
  }
  EXPECT_THAT(info.str(), HasSubstr("rpc=Forward code=OK"));
  EXPECT_THAT(info.str(), ::testing::Not(HasSubstr("timeline")));
}

TEST(CallRecordTest, KeepsTheFirstStampsOnly) {
  std::ostringstream out;
  CapturedLog log(out, spdlog::level::debug);
  CallRecord record(nullptr, "Backward");
  for (int i = 0; i < 40; ++i) record.Stamp("again");
  record.Stamp("late");
  record.SetAnswer(absl::OkStatus());
  record.Over(nullptr);
  EXPECT_THAT(out.str(), HasSubstr("again=+"));
  EXPECT_THAT(out.str(), ::testing::Not(HasSubstr("late=")));
}

TEST(GuardMemoryTest, AnAllocationFailureIsResourceExhausted) {
  absl::Status status = GuardMemory([]() -> absl::Status { throw std::bad_alloc(); }, "Forward");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("Forward: out of host memory"));
}

}  // namespace
}  // namespace flce
