#include "server/call_channel.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/call_channel_layout.h"
#include "tests/shm_object.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

namespace cc = call_channel;
using ::testing::HasSubstr;
using Code = absl::StatusCode;

constexpr int64_t kArea = 4096;

// Serves every channel call by a function of the test's (by default: OK,
// num_valid = the hidden rows, answered at once).
class FakeService : public CallChannelService {
 public:
  std::function<void(Call*, const v1::ForwardRequest*, v1::ForwardResponse*)> forward =
      [](Call* call, const v1::ForwardRequest* request, v1::ForwardResponse* response) {
        response->set_num_valid(request->hidden().shape_size() > 0 ? request->hidden().shape(0)
                                                                  : 0);
        call->Reply(absl::OkStatus());
      };
  std::string last_principal;

  void ChannelForward(Call* call, const std::string& principal, const v1::ForwardRequest* request,
                      v1::ForwardResponse* response) override {
    last_principal = principal;
    forward(call, request, response);
  }
  void ChannelBackward(Call* call, const std::string&, const v1::BackwardRequest*,
                       v1::BackwardResponse*) override {
    call->Reply(absl::OkStatus());
  }
  void ChannelReleaseSession(Call* call, const std::string&, const v1::ReleaseSessionRequest*,
                             v1::ReleaseSessionResponse* response) override {
    response->set_released(true);
    call->Reply(absl::OkStatus());
  }
};

// The client's side of the protocol, written out as the layout says.
class Peer {
 public:
  explicit Peer(char* base) : base_(base) {
    std::memcpy(base_ + cc::kMagicOffset, &cc::kMagic, sizeof(cc::kMagic));
  }

  uint32_t* Word(int64_t offset) const { return reinterpret_cast<uint32_t*>(base_ + offset); }
  uint32_t Load(int64_t offset) const { return __atomic_load_n(Word(offset), __ATOMIC_ACQUIRE); }
  void Store(int64_t offset, uint32_t v) { __atomic_store_n(Word(offset), v, __ATOMIC_SEQ_CST); }

  // Writes a call and makes it; its number.
  uint32_t Send(uint32_t method, const std::string& payload, uint32_t length,
                uint64_t timeout_us = 0) {
    std::memcpy(base_ + cc::kHeaderBytes, payload.data(), std::min<size_t>(payload.size(), kArea));
    Store(cc::kRequestMethodOffset, method);
    Store(cc::kRequestLengthOffset, length);
    std::memcpy(base_ + cc::kRequestTimeoutUsOffset, &timeout_us, sizeof(timeout_us));
    const uint32_t seq = ++seq_;
    Store(cc::kRequestSeqOffset, seq);
    syscall(SYS_futex, Word(cc::kRequestSeqOffset), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    return seq;
  }
  uint32_t Send(uint32_t method, const google::protobuf::Message& request) {
    const std::string payload = request.SerializeAsString();
    return Send(method, payload, static_cast<uint32_t>(payload.size()));
  }

  // Waits for the answer to `seq` (true) or the channel's close (false).
  bool Wait(uint32_t seq, absl::Duration timeout = absl::Seconds(10)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (Load(cc::kResponseSeqOffset) == seq) return true;
      if (Load(cc::kClosedOffset) != 0) return false;
      absl::SleepFor(absl::Microseconds(50));
    }
    ADD_FAILURE() << "no answer to call " << seq;
    return false;
  }

  // The answer: the status, with the response parsed on OK.
  absl::Status Answer(google::protobuf::Message* response = nullptr) const {
    const uint32_t code = Load(cc::kResponseCodeOffset);
    const std::string body(base_ + cc::kHeaderBytes + kArea, Load(cc::kResponseLengthOffset));
    if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), body);
    if (response != nullptr && !response->ParseFromString(body)) {
      return absl::InternalError("the answer does not parse");
    }
    return absl::OkStatus();
  }

 private:
  char* const base_;
  uint32_t seq_ = 0;
};

v1::ForwardRequest ForwardWithRows(int64_t rows) {
  v1::ForwardRequest request;
  request.mutable_hidden()->add_shape(rows);
  request.mutable_hidden()->add_shape(8);
  return request;
}

TEST(CallGapsTest, EachMethodsGapIsExpectedAfterItsOwnCalls) {
  CallGaps gaps;
  EXPECT_EQ(gaps.Expected(cc::kForward), absl::ZeroDuration());  // none seen: poll at once
  // A training step: Backward comes soon after Forward, the next Forward
  // after the rest of the step.
  for (int step = 0; step < 4; ++step) {
    gaps.Observe(cc::kForward, absl::Microseconds(300));
    gaps.Observe(cc::kBackward, absl::Milliseconds(5));
  }
  EXPECT_EQ(gaps.Expected(cc::kForward), absl::Microseconds(300));
  EXPECT_EQ(gaps.Expected(cc::kBackward), absl::Milliseconds(5));
  EXPECT_EQ(gaps.Expected(cc::kReleaseSession), absl::ZeroDuration());
  // Gaps that vary are expected two deviations early: the average of the
  // last gaps (the newest weighing half) less twice the average of their
  // distance from it.
  gaps.Observe(cc::kForward, absl::Microseconds(700));  // average 500, deviation 200
  EXPECT_EQ(gaps.Expected(cc::kForward), absl::Microseconds(100));
  gaps.Observe(cc::kForward, absl::Microseconds(500));  // average 500, deviation 100
  EXPECT_EQ(gaps.Expected(cc::kForward), absl::Microseconds(300));
  gaps.Observe(cc::kForward, absl::Microseconds(100));  // average 300, deviation 250
  EXPECT_EQ(gaps.Expected(cc::kForward), absl::ZeroDuration());
  // A method number no call has (a client's garbage) has a slot of its own.
  gaps.Observe(77, absl::Seconds(3));
  EXPECT_EQ(gaps.Expected(77), absl::Seconds(3));
  EXPECT_EQ(gaps.Expected(0), absl::Seconds(3));
  EXPECT_EQ(gaps.Expected(cc::kBackward), absl::Milliseconds(5));
}

class CallChannelTest : public ::testing::Test {
 protected:
  static constexpr int64_t kBytes = cc::kHeaderBytes + 2 * kArea;

  CallChannelTest() : object_(kBytes), admission_(RequestLimits()) {}

  void MakeChannels(CallChannelLimits limits = CallChannelLimits()) {
    channels_ = std::make_unique<CallChannels>(limits, int64_t{1} << 20, &service_, &admission_,
                                               &metrics_);
  }

  std::shared_ptr<SharedRegion> Region(const std::string& principal = "p") {
    auto id = registry_.Register(object_.name(), kBytes, principal);
    EXPECT_TRUE(id.ok()) << id.status();
    return *registry_.Find(id->region_id, principal);
  }

  ShmObject object_;
  SharedMemoryRegistry registry_;
  RequestAdmission admission_;
  ServiceMetrics metrics_;
  FakeService service_;
  std::unique_ptr<CallChannels> channels_;
};

TEST_F(CallChannelTest, ACallIsServedAsItsPrincipalAndAnswered) {
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region("alice"), kArea, kArea, "alice").ok());
  for (int64_t rows : {3, 17, 733}) {
    const uint32_t seq = peer.Send(cc::kForward, ForwardWithRows(rows));
    ASSERT_TRUE(peer.Wait(seq));
    v1::ForwardResponse response;
    ASSERT_TRUE(peer.Answer(&response).ok());
    EXPECT_EQ(response.num_valid(), rows);
  }
  EXPECT_EQ(service_.last_principal, "alice");
  const uint32_t seq = peer.Send(cc::kReleaseSession, v1::ReleaseSessionRequest());
  ASSERT_TRUE(peer.Wait(seq));
  v1::ReleaseSessionResponse released;
  ASSERT_TRUE(peer.Answer(&released).ok());
  EXPECT_TRUE(released.released());
}

TEST_F(CallChannelTest, AStartedCallIsAcceptedBeforeItsAnswerAndFencedAfterIt) {
  absl::Notification accepted_seen, release;
  service_.forward = [&](Call* call, const v1::ForwardRequest*, v1::ForwardResponse*) {
    call->Started();
    release.WaitForNotification();
    call->Reply(absl::OkStatus());
  };
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region(), kArea, kArea, "p").ok());
  const uint32_t seq = peer.Send(cc::kForward, ForwardWithRows(1));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (peer.Load(cc::kAcceptedSeqOffset) != seq && absl::Now() < deadline) {
    absl::SleepFor(absl::Microseconds(50));
  }
  EXPECT_EQ(peer.Load(cc::kAcceptedSeqOffset), seq);
  EXPECT_NE(peer.Load(cc::kResponseSeqOffset), seq);
  EXPECT_NE(peer.Load(cc::kFenceSeqOffset), seq);
  // The heart beats while the call runs.
  const uint32_t beat = peer.Load(cc::kHeartbeatOffset);
  absl::SleepFor(absl::Milliseconds(350));
  EXPECT_GE(peer.Load(cc::kHeartbeatOffset) - beat, 2u);
  release.Notify();
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_EQ(peer.Load(cc::kFenceSeqOffset), seq);
  // A refusal is answered, and fenced, without being accepted.
  service_.forward = [](Call* call, const v1::ForwardRequest*, v1::ForwardResponse*) {
    call->Reply(absl::OutOfRangeError("target[0] = 9 is outside [0, 3)"));
  };
  const uint32_t refused = peer.Send(cc::kForward, ForwardWithRows(1));
  ASSERT_TRUE(peer.Wait(refused));
  EXPECT_EQ(peer.Load(cc::kAcceptedSeqOffset), seq);
  EXPECT_EQ(peer.Load(cc::kFenceSeqOffset), refused);
  EXPECT_THAT(peer.Answer(), StatusIs(Code::kOutOfRange, HasSubstr("target[0]")));
}

TEST_F(CallChannelTest, MalformedCallsAreRefusedNamingTheFieldAndTheChannelServesOn) {
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region(), kArea, kArea, "p").ok());
  uint32_t seq = peer.Send(7, "", 0);
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_THAT(peer.Answer(), StatusIs(Code::kInvalidArgument, HasSubstr("request method 7")));
  seq = peer.Send(cc::kForward, "", kArea + 1);
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_THAT(peer.Answer(), StatusIs(Code::kInvalidArgument,
                                      HasSubstr("request length 4097 bytes, over the request area")));
  seq = peer.Send(cc::kForward, std::string(64, '\xff'), 64);
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_THAT(peer.Answer(),
              StatusIs(Code::kInvalidArgument, HasSubstr("do not parse as flce.v1.ForwardRequest")));
  seq = peer.Send(cc::kForward, ForwardWithRows(5));
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_TRUE(peer.Answer().ok());
}

TEST_F(CallChannelTest, AnAnswerOverTheResponseAreaIsResourceExhausted) {
  service_.forward = [](Call* call, const v1::ForwardRequest*, v1::ForwardResponse* response) {
    response->set_session_id(std::string(2 * kArea, 'x'));
    call->Reply(absl::OkStatus());
  };
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region(), kArea, kArea, "p").ok());
  const uint32_t seq = peer.Send(cc::kForward, ForwardWithRows(1));
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_THAT(peer.Answer(), StatusIs(Code::kResourceExhausted,
                                      HasSubstr("over the call channel's response area of 4096")));
}

TEST_F(CallChannelTest, OpeningChecksTheRegionTheAreasAndTheBounds) {
  CallChannelLimits limits;
  limits.max_channels = 3;
  limits.max_channels_per_principal = 2;
  MakeChannels(limits);
  std::shared_ptr<SharedRegion> region = Region();
  // No magic yet.
  EXPECT_THAT(channels_->Open(region, kArea, kArea, "p"),
              StatusIs(Code::kInvalidArgument, HasSubstr("magic")));
  Peer peer(object_.base());
  EXPECT_THAT(channels_->Open(region, 100, kArea, "p"),
              StatusIs(Code::kInvalidArgument, HasSubstr("request_bytes: 100")));
  EXPECT_THAT(channels_->Open(region, kArea, int64_t{2} << 20, "p"),
              StatusIs(Code::kInvalidArgument, HasSubstr("--max_message_bytes")));
  EXPECT_THAT(channels_->Open(region, kArea, 2 * kArea, "p"),
              StatusIs(Code::kInvalidArgument, HasSubstr("do not fit the region's 12288")));
  ASSERT_TRUE(channels_->Open(region, kArea, kArea, "p").ok());
  ASSERT_TRUE(channels_->Open(region, kArea, kArea, "p").ok());
  EXPECT_THAT(channels_->Open(region, kArea, kArea, "p"),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_call_channels_per_principal")));
  ASSERT_TRUE(channels_->Open(Region("q"), kArea, kArea, "q").ok());
  EXPECT_THAT(channels_->Open(Region("r"), kArea, kArea, "r"),
              StatusIs(Code::kResourceExhausted, HasSubstr("(--max_call_channels)")));
  EXPECT_EQ(channels_->size(), 3);
}

TEST_F(CallChannelTest, ClosingStopsTakingCallsAndTellsTheClient) {
  MakeChannels();
  Peer peer(object_.base());
  auto id = channels_->Open(Region(), kArea, kArea, "p");
  ASSERT_TRUE(id.ok());
  EXPECT_FALSE(channels_->Close(*id, "somebody else"));
  EXPECT_TRUE(channels_->Close(*id, "p"));
  EXPECT_FALSE(channels_->Close(*id, "p"));  // idempotent: gone
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (peer.Load(cc::kClosedOffset) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(peer.Load(cc::kClosedOffset), 1u);
  // A call made now is never taken: the client sees the close, no answer.
  const uint32_t seq = peer.Send(cc::kForward, ForwardWithRows(1));
  EXPECT_FALSE(peer.Wait(seq, absl::Milliseconds(300)));
  EXPECT_NE(peer.Load(cc::kResponseSeqOffset), seq);
}

TEST_F(CallChannelTest, AnIdleChannelIsClosedAndLeavesTheBounds) {
  CallChannelLimits limits;
  limits.max_channels = 1;
  limits.idle_timeout = absl::Milliseconds(200);
  MakeChannels(limits);
  Peer peer(object_.base());
  std::shared_ptr<SharedRegion> region = Region();
  ASSERT_TRUE(channels_->Open(region, kArea, kArea, "p").ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (peer.Load(cc::kClosedOffset) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(peer.Load(cc::kClosedOffset), 1u);
  peer.Store(cc::kClosedOffset, 0);  // the region reused for a new channel
  EXPECT_TRUE(channels_->Open(region, kArea, kArea, "p").ok());
}

TEST_F(CallChannelTest, ACallSeesItsCancelAndItsDeadline) {
  absl::Notification started, release;
  bool cancelled_before = true, cancelled_after = false;
  absl::Time deadline;
  service_.forward = [&](Call* call, const v1::ForwardRequest*, v1::ForwardResponse*) {
    cancelled_before = call->IsCancelled();
    deadline = call->deadline();
    started.Notify();
    release.WaitForNotification();
    cancelled_after = call->IsCancelled();
    call->Reply(absl::CancelledError("cancelled by the client"));
  };
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region(), kArea, kArea, "p").ok());
  const std::string payload = ForwardWithRows(1).SerializeAsString();
  const absl::Time sent = absl::Now();
  const uint32_t seq =
      peer.Send(cc::kForward, payload, static_cast<uint32_t>(payload.size()), 5'000'000);
  started.WaitForNotification();
  peer.Store(cc::kCancelSeqOffset, seq);
  release.Notify();
  ASSERT_TRUE(peer.Wait(seq));
  EXPECT_FALSE(cancelled_before);
  EXPECT_TRUE(cancelled_after);
  EXPECT_GT(deadline, sent + absl::Seconds(4));
  EXPECT_LT(deadline, absl::Now() + absl::Seconds(5));
  EXPECT_THAT(peer.Answer(), StatusIs(Code::kCancelled, HasSubstr("cancelled")));
}

TEST_F(CallChannelTest, AShrunkRegionClosesTheChannelAndTheServerLives) {
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region(), kArea, kArea, "p").ok());
  const uint32_t seq = peer.Send(cc::kForward, ForwardWithRows(2));
  ASSERT_TRUE(peer.Wait(seq));
  // The client shrinks its object: the server's next touch of the header
  // faults, is caught, and the channel goes.
  object_.Resize(0);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (channels_->size() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(channels_->size(), 0);
}

TEST_F(CallChannelTest, ShutdownCancelsACallInFlightAtItsDeadline) {
  absl::Notification started;
  service_.forward = [&](Call* call, const v1::ForwardRequest*, v1::ForwardResponse*) {
    started.Notify();
    while (!call->IsCancelled()) absl::SleepFor(absl::Milliseconds(1));
    call->Reply(absl::CancelledError("cancelled while computing"));
  };
  MakeChannels();
  Peer peer(object_.base());
  ASSERT_TRUE(channels_->Open(Region(), kArea, kArea, "p").ok());
  const uint32_t seq = peer.Send(cc::kForward, ForwardWithRows(1));
  started.WaitForNotification();
  channels_->Shutdown(absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(peer.Load(cc::kResponseSeqOffset), seq);  // answered before the channel went
  EXPECT_THAT(peer.Answer(), StatusIs(Code::kCancelled, HasSubstr("cancelled")));
  EXPECT_EQ(peer.Load(cc::kClosedOffset), 1u);
  EXPECT_THAT(channels_->Open(Region(), kArea, kArea, "p"), StatusIs(Code::kUnavailable, HasSubstr("shutting down")));
}

}  // namespace
}  // namespace flce
