#include "server/region_marks.h"

#include <atomic>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using ::testing::Optional;

const absl::Time kFar = absl::InfiniteFuture();

TEST(MarkBoardTest, APostedMarkAnswersAtOnce) {
  MarkBoard board;
  board.Post(7, absl::OkStatus());
  EXPECT_THAT(board.Await(7, kFar, nullptr), Optional(absl::OkStatus()));
}

TEST(MarkBoardTest, AWaiterWakesOnThePost) {
  MarkBoard board;
  std::optional<absl::Status> got;
  std::thread waiter([&] { got = board.Await(3, kFar, nullptr, absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(20));
  board.Post(3, absl::AbortedError("the writing call failed"));
  waiter.join();  // woken by the post, not by the minute's poll
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->code(), absl::StatusCode::kAborted);
}

TEST(MarkBoardTest, TheFirstPostWins) {
  MarkBoard board;
  board.Post(1, absl::OkStatus());
  board.Post(1, absl::AbortedError("the call ended"));
  EXPECT_THAT(board.Await(1, kFar, nullptr), Optional(absl::OkStatus()));
}

TEST(MarkBoardTest, ANeverPostedMarkEndsAtItsDeadline) {
  MarkBoard board;
  board.Post(2, absl::OkStatus());
  EXPECT_EQ(board.Await(1, absl::Now() + absl::Milliseconds(30), nullptr), std::nullopt);
  EXPECT_EQ(board.Await(1, absl::InfinitePast(), nullptr), std::nullopt);
}

TEST(MarkBoardTest, StopEndsAWait) {
  MarkBoard board;
  std::atomic<int> asked{0};
  EXPECT_EQ(board.Await(
                5, kFar, [&] { return ++asked >= 3; }, absl::Milliseconds(1)),
            std::nullopt);
  EXPECT_EQ(asked.load(), 3);
}

TEST(MarkBoardTest, AReadOfBytesAlreadyWrittenGoesBeforeThePost) {
  MarkBoard board;
  const absl::Time soon = absl::Now() + absl::Milliseconds(30);
  board.Progress(9, 1000, 1000 + 4096);
  // Within what is in: at once; beyond it or before it: still waiting.
  EXPECT_THAT(board.Await(9, kFar, nullptr, absl::Milliseconds(50), 1000, 4096),
              Optional(absl::OkStatus()));
  EXPECT_THAT(board.Await(9, kFar, nullptr, absl::Milliseconds(50), 2000, 1000),
              Optional(absl::OkStatus()));
  EXPECT_EQ(board.Await(9, soon, nullptr, absl::Milliseconds(50), 4096, 4096), std::nullopt);
  EXPECT_EQ(board.Await(9, soon, nullptr, absl::Milliseconds(50), 999, 100), std::nullopt);
  EXPECT_EQ(board.Await(9, soon, nullptr), std::nullopt) << "no range: the post";
  // A waiter beyond it wakes as the bytes come.
  std::optional<absl::Status> got;
  std::thread waiter(
      [&] { got = board.Await(9, kFar, nullptr, absl::Seconds(60), 1000 + 4096, 4096); });
  absl::SleepFor(absl::Milliseconds(20));
  board.Progress(9, 1000, 1000 + 8192);
  waiter.join();
  EXPECT_THAT(got, Optional(absl::OkStatus()));
  // Another start is not this call's; the post ends the progress.
  board.Progress(9, 0, 1 << 20);
  EXPECT_EQ(board.Await(9, soon, nullptr, absl::Milliseconds(50), 0, 1000), std::nullopt);
  board.Post(9, absl::AbortedError("the call failed after"));
  EXPECT_EQ(board.Await(9, kFar, nullptr, absl::Milliseconds(50), 1000, 4096)->code(),
            absl::StatusCode::kAborted);
  board.Progress(9, 1000, 1 << 20);  // after the post: nothing
  EXPECT_EQ(board.Await(9, kFar, nullptr, absl::Milliseconds(50), 1000, 4096)->code(),
            absl::StatusCode::kAborted);
}

TEST(MarkBoardTest, OnlyTheLastPostsAreRemembered) {
  MarkBoard board;
  for (uint64_t mark = 1; mark <= MarkBoard::kMaxPosts + 1; ++mark) {
    board.Post(mark, absl::OkStatus());
  }
  EXPECT_EQ(board.Await(1, absl::InfinitePast(), nullptr), std::nullopt);
  EXPECT_THAT(board.Await(2, absl::InfinitePast(), nullptr), Optional(absl::OkStatus()));
  EXPECT_THAT(board.Await(MarkBoard::kMaxPosts + 1, absl::InfinitePast(), nullptr),
              Optional(absl::OkStatus()));
}

}  // namespace
}  // namespace flce
