#include "server/request_admission.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

RequestLimits Limits() {
  RequestLimits l;
  l.max_streams = 3;
  l.max_streams_per_principal = 2;
  l.memory_bytes = 1000;
  l.memory_bytes_per_principal = 600;
  l.idle_timeout = absl::Hours(1);
  return l;
}

int64_t Plenty() { return int64_t{1} << 40; }

TEST(RequestAdmissionTest, StreamsAreCountedInTotalAndPerPrincipal) {
  RequestAdmission admission(Limits(), Plenty);
  auto a1 = admission.Open("a", "ForwardStream", nullptr);
  auto a2 = admission.Open("a", "ForwardStream", nullptr);
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_THAT(admission.Open("a", "PutWeight", nullptr),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_streams_per_principal")));
  auto b = admission.Open("b", "ForwardStream", nullptr);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(admission.Open("c", "ForwardStream", nullptr),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_streams) is 3")));
  EXPECT_EQ(admission.open_streams(), 3);
  *a1 = StreamTicket();  // closed: its slot comes back
  EXPECT_TRUE(admission.Open("c", "ForwardStream", nullptr).ok());
}

TEST(RequestAdmissionTest, BytesAreReservedAgainstBothBudgetsAndReturned) {
  RequestAdmission admission(Limits(), Plenty);
  auto a = *admission.Open("a", "ForwardStream", nullptr);
  auto b = *admission.Open("b", "ForwardStream", nullptr);
  EXPECT_TRUE(a.Reserve(500, "ForwardStream").ok());
  EXPECT_THAT(a.Reserve(200, "ForwardStream"),
              StatusIs(Code::kResourceExhausted,
                       HasSubstr("--request_memory_bytes_per_principal")));
  EXPECT_TRUE(b.Reserve(450, "ForwardStream").ok());
  EXPECT_THAT(b.Reserve(100, "ForwardStream"),
              StatusIs(Code::kResourceExhausted, HasSubstr("--request_memory_bytes)")));
  EXPECT_EQ(admission.bytes_in_use(), 950);
  a = StreamTicket();
  EXPECT_EQ(admission.bytes_in_use(), 450);
  b = StreamTicket();
  EXPECT_EQ(admission.bytes_in_use(), 0);
  EXPECT_EQ(admission.open_streams(), 0);
}

TEST(RequestAdmissionTest, MoreThanTheHostHasIsRefused) {
  RequestLimits limits = Limits();
  limits.memory_bytes = int64_t{1} << 40;
  limits.memory_bytes_per_principal = 0;
  RequestAdmission admission(limits, [] { return int64_t{1} << 20; });
  auto t = *admission.Open("a", "ForwardStream", nullptr);
  EXPECT_THAT(t.Reserve(int64_t{2} << 20, "ForwardStream"),
              StatusIs(Code::kResourceExhausted, HasSubstr("the host has 1048576 available")));
  EXPECT_EQ(admission.bytes_in_use(), 0);
}

TEST(RequestAdmissionTest, IdleStreamsAreFinishedOnceAndActiveOnesAreNot) {
  RequestLimits limits = Limits();
  limits.idle_timeout = absl::Milliseconds(100);
  RequestAdmission admission(limits, Plenty);
  std::atomic<int> idle_calls{0}, busy_calls{0}, done_calls{0};
  absl::Notification fired;
  auto idle = *admission.Open("a", "ForwardStream", [&] {
    ++idle_calls;
    fired.Notify();
  });
  auto busy = *admission.Open("b", "ForwardStream", [&] { ++busy_calls; });
  auto done = *admission.Open("b", "ForwardStream", [&] { ++done_calls; });
  done.StopWatching();
  for (int i = 0; i < 40; ++i) {  // 400 ms with a message every 10 ms
    busy.Touch();
    absl::SleepFor(absl::Milliseconds(10));
  }
  busy.StopWatching();
  ASSERT_TRUE(fired.WaitForNotificationWithTimeout(absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(idle_calls.load(), 1);
  EXPECT_EQ(done_calls.load(), 0);
  EXPECT_EQ(busy_calls.load(), 0);
  EXPECT_EQ(admission.idle_timeouts(), 1);
}

TEST(RequestAdmissionTest, AClosedTicketIsNeverCalledBack) {
  RequestLimits limits = Limits();
  limits.idle_timeout = absl::Milliseconds(20);
  RequestAdmission admission(limits, Plenty);
  std::atomic<int> calls{0};
  {
    auto t = *admission.Open("a", "PutWeight", [&] { ++calls; });
  }
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(calls.load(), 0);
}

}  // namespace
}  // namespace flce
