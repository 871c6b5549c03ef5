#include "server/work_queue.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

TEST(WorkQueueTest, RunsEveryQueuedTask) {
  std::atomic<int> ran{0};
  {
    WorkQueue queue(2, 100);
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE(queue.Submit([&] { ++ran; }).ok());
    }
  }  // the destructor drains
  EXPECT_EQ(ran.load(), 50);
}

TEST(WorkQueueTest, FullQueueIsResourceExhausted) {
  WorkQueue queue(1, 1);
  absl::Notification started, release;
  ASSERT_TRUE(queue.Submit([&] {
                     started.Notify();
                     release.WaitForNotification();
                   }).ok());
  started.WaitForNotification();
  ASSERT_TRUE(queue.Submit([] {}).ok());  // waits
  const absl::Status full = queue.Submit([] {});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(queue.running(), 1);
  EXPECT_EQ(queue.queued(), 1);
  release.Notify();
}

TEST(WorkQueueTest, SubmitAfterShutdownIsUnavailable) {
  WorkQueue queue(1, 4);
  queue.Shutdown();
  EXPECT_EQ(queue.Submit([] {}).code(), absl::StatusCode::kUnavailable);
  queue.Shutdown();  // idempotent
}

}  // namespace
}  // namespace flce
