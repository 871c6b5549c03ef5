#include "server/work_queue.h"

#include <atomic>
#include <thread>

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

TEST(WorkQueueTest, RunHereTakesAFreeWorkersPlaceOnTheCallingThread) {
  WorkQueue queue(1, 4);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  int64_t running_inside = -1;
  ASSERT_TRUE(queue.RunHereOrSubmit([&] {
                     ran_on = std::this_thread::get_id();
                     running_inside = queue.running();
                   }).ok());
  EXPECT_EQ(ran_on, caller);  // done when the call returns
  EXPECT_EQ(running_inside, 1);
  EXPECT_EQ(queue.running(), 0);
}

TEST(WorkQueueTest, RunHereQueuesWhenEveryWorkerIsBusy) {
  WorkQueue queue(1, 4);
  absl::Notification started, release, queued_ran;
  ASSERT_TRUE(queue.Submit([&] {
                     started.Notify();
                     release.WaitForNotification();
                   }).ok());
  started.WaitForNotification();
  std::thread::id ran_on;
  ASSERT_TRUE(queue.RunHereOrSubmit([&] {
                     ran_on = std::this_thread::get_id();
                     queued_ran.Notify();
                   }).ok());
  EXPECT_FALSE(queued_ran.HasBeenNotified());
  EXPECT_EQ(queue.queued(), 1);
  release.Notify();
  queued_ran.WaitForNotification();
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(WorkQueueTest, ATaskRunHereHoldsAWorkersPlace) {
  // With the only place taken by a task run on its caller's thread, a
  // submitted task waits for it instead of running beside it.
  WorkQueue queue(1, 4);
  absl::Notification inside, release, second_ran;
  std::thread caller([&] {
    ASSERT_TRUE(queue.RunHereOrSubmit([&] {
                       inside.Notify();
                       release.WaitForNotification();
                     }).ok());
  });
  inside.WaitForNotification();
  ASSERT_TRUE(queue.Submit([&] { second_ran.Notify(); }).ok());
  EXPECT_FALSE(second_ran.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  release.Notify();
  second_ran.WaitForNotification();
  caller.join();
}

TEST(WorkQueueTest, RunHereAfterShutdownIsUnavailable) {
  WorkQueue queue(1, 4);
  queue.Shutdown();
  EXPECT_EQ(queue.RunHereOrSubmit([] {}).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace flce
