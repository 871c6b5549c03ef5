#include "server/session_store.h"

#include <memory>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

class FakeState : public SavedState {
 public:
  explicit FakeState(int64_t bytes) : bytes_(bytes) {}
  int64_t bytes() const override { return bytes_; }

 private:
  int64_t bytes_;
};

class SessionStoreTest : public ::testing::Test {
 protected:
  SessionStoreTest()
      : store_(SessionLimits{/*max_sessions=*/3, /*memory_budget_bytes=*/1000,
                             /*ttl=*/absl::Seconds(60)},
               [this] { return now_; }) {}

  std::string Make(int64_t bytes, const std::string& principal = "") {
    auto reservation = store_.Reserve(bytes, principal);
    EXPECT_TRUE(reservation.ok()) << reservation.status();
    return store_.Commit(std::move(*reservation), std::make_unique<FakeState>(bytes),
                         SessionInfo{});
  }

  absl::Time now_ = absl::FromUnixSeconds(1000000);
  SessionStore store_;
};

TEST_F(SessionStoreTest, IdsAre128RandomBitsInHex) {
  std::set<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    std::string id = Make(1);
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 3u);
}

TEST_F(SessionStoreTest, BackwardConsumesUnlessKept) {
  const std::string id = Make(10);
  auto lease = store_.Acquire(id, "");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->state->bytes(), 10);
  store_.Finish(*lease, /*consume=*/false);
  lease = store_.Acquire(id, "");
  ASSERT_TRUE(lease.ok());
  store_.Finish(*lease, /*consume=*/true);
  auto again = store_.Acquire(id, "");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("already consumed"));
  EXPECT_EQ(store_.live_sessions(), 0);
  EXPECT_EQ(store_.bytes_in_use(), 0);
}

TEST_F(SessionStoreTest, ConcurrentBackwardIsRefused) {
  const std::string id = Make(10);
  auto first = store_.Acquire(id, "");
  ASSERT_TRUE(first.ok());
  auto second = store_.Acquire(id, "");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("in use"));
}

TEST_F(SessionStoreTest, UnknownSessionIsNotFound) {
  auto lease = store_.Acquire("00112233445566778899aabbccddeeff", "");
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lease.status().message(), HasSubstr("unknown session"));
}

TEST_F(SessionStoreTest, ExpiredSessionIsNotFound) {
  const std::string id = Make(10);
  now_ += absl::Seconds(61);
  EXPECT_EQ(store_.ReapExpired(), 1);
  EXPECT_EQ(store_.live_sessions(), 0);
  auto lease = store_.Acquire(id, "");
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lease.status().message(), HasSubstr("expired"));
}

TEST_F(SessionStoreTest, ExpiryIsDetectedBeforeTheReaperRuns) {
  const std::string id = Make(10);
  now_ += absl::Seconds(61);
  auto lease = store_.Acquire(id, "");
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lease.status().message(), HasSubstr("expired"));
  EXPECT_EQ(store_.bytes_in_use(), 0);
}

TEST_F(SessionStoreTest, UseRestartsTheTtl) {
  const std::string id = Make(10);
  now_ += absl::Seconds(50);
  auto lease = store_.Acquire(id, "");
  ASSERT_TRUE(lease.ok());
  store_.Finish(*lease, /*consume=*/false);
  now_ += absl::Seconds(50);
  EXPECT_EQ(store_.ReapExpired(), 0);
  EXPECT_TRUE(store_.Acquire(id, "").ok());
}

TEST_F(SessionStoreTest, SessionsInUseAreNotReaped) {
  const std::string id = Make(10);
  auto lease = store_.Acquire(id, "");
  ASSERT_TRUE(lease.ok());
  now_ += absl::Seconds(120);
  EXPECT_EQ(store_.ReapExpired(), 0);
  store_.Finish(*lease, /*consume=*/true);
}

TEST_F(SessionStoreTest, CountLimitIsResourceExhaustedWithNumbers) {
  Make(1);
  Make(1);
  Make(1);
  auto r = store_.Reserve(1, "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("3 live of at most 3"));
}

TEST_F(SessionStoreTest, MemoryBudgetIsResourceExhaustedWithNumbers) {
  Make(600);
  EXPECT_FALSE(store_.Fits(401));
  EXPECT_TRUE(store_.Fits(400));
  auto r = store_.Reserve(401, "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(),
              HasSubstr("needs 401 bytes, 600 of the budget of 1000 bytes"));
}

TEST(SessionStorePrincipalTest, PerPrincipalLimitsLeaveOthersRoom) {
  SessionLimits limits;
  limits.max_sessions = 10;
  limits.memory_budget_bytes = 10000;
  limits.max_sessions_per_principal = 2;
  limits.memory_bytes_per_principal = 500;
  SessionStore store(limits);
  auto make = [&](int64_t bytes, const std::string& principal) -> absl::StatusOr<std::string> {
    auto reservation = store.Reserve(bytes, principal);
    if (!reservation.ok()) return reservation.status();
    return store.Commit(std::move(*reservation), std::make_unique<FakeState>(bytes),
                        SessionInfo{});
  };
  ASSERT_TRUE(make(100, "alice").ok());
  auto second = make(100, "alice");
  ASSERT_TRUE(second.ok());
  auto third = make(100, "alice");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("2 live of at most 2 per principal"));
  auto big = make(501, "bob");
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("of its 500 bytes"));
  EXPECT_TRUE(make(500, "bob").ok());
  // Alice's freed session makes room for her again.
  EXPECT_TRUE(store.Release(*second, "alice"));
  EXPECT_TRUE(make(100, "alice").ok());
}

TEST_F(SessionStoreTest, DroppedReservationReturnsItsBudget) {
  {
    auto r = store_.Reserve(900, "");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(store_.bytes_in_use(), 900);
    EXPECT_FALSE(store_.Fits(200));
  }
  EXPECT_EQ(store_.bytes_in_use(), 0);
  EXPECT_TRUE(store_.Fits(1000));
}

TEST_F(SessionStoreTest, ReleaseIsIdempotent) {
  const std::string id = Make(10);
  EXPECT_TRUE(store_.Release(id, ""));
  EXPECT_FALSE(store_.Release(id, ""));
  EXPECT_FALSE(store_.Release("nope", ""));
  auto lease = store_.Acquire(id, "");
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(lease.status().message(), HasSubstr("released"));
}

TEST_F(SessionStoreTest, ReleaseDuringBackwardFreesWhenItFinishes) {
  const std::string id = Make(10);
  auto lease = store_.Acquire(id, "");
  ASSERT_TRUE(lease.ok());
  EXPECT_TRUE(store_.Release(id, ""));
  EXPECT_EQ(store_.live_sessions(), 1);
  store_.Finish(*lease, /*consume=*/false);
  EXPECT_EQ(store_.live_sessions(), 0);
}

TEST_F(SessionStoreTest, OtherPrincipalsSeeNotFound) {
  const std::string id = Make(10, "alice");
  auto lease = store_.Acquire(id, "bob");
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(store_.Release(id, "bob"));
  EXPECT_TRUE(store_.Acquire(id, "alice").ok());
}

// A consumption pending its answer's delivery frees the budget at once and
// is undone if the answer is lost; the reaper keeps its tombstone meanwhile.
TEST_F(SessionStoreTest, PendingConsumptionIsDeliveredOrRestored) {
  const std::string id = Make(400);
  auto lease = store_.Acquire(id, "");
  ASSERT_TRUE(lease.ok());
  store_.Finish(*lease, /*consume=*/true, std::nullopt, /*pending=*/true);
  EXPECT_EQ(store_.live_sessions(), 0);
  EXPECT_EQ(store_.bytes_in_use(), 0);
  now_ += absl::Hours(2);  // past every tombstone age
  store_.ReapExpired();
  store_.Restore(*lease, UndeliveredAccumulation{});
  EXPECT_EQ(store_.live_sessions(), 1);
  EXPECT_EQ(store_.bytes_in_use(), 400);
  auto again = store_.Acquire(id, "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->undelivered.has_value());
  EXPECT_EQ(again->state, lease->state);
  store_.Finish(*again, /*consume=*/true, std::nullopt, /*pending=*/true);
  store_.Delivered(*again);
  store_.Restore(*again);  // too late: delivered
  EXPECT_EQ(store_.live_sessions(), 0);
  EXPECT_THAT(store_.Acquire(id, "").status().message(), HasSubstr("already consumed"));
}

}  // namespace
}  // namespace flce
