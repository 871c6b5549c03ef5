#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "tests/shm_object.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

SliceRef Slice(const std::string& region, int64_t offset) { return SliceRef{region, offset}; }

TEST(SharedMemoryTest, RegionsAreBoundedInCountAndBytes) {
  SharedMemoryLimits limits;
  limits.max_regions = 3;
  limits.max_regions_per_principal = 2;
  limits.max_bytes = 1 << 20;
  limits.max_bytes_per_principal = 3 << 18;
  SharedMemoryRegistry registry(limits);
  ShmObject object(1 << 20);
  auto a1 = registry.Register(object.name(), 1 << 18, "a");
  auto a2 = registry.Register(object.name(), 1 << 18, "a");
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_THAT(
      registry.Register(object.name(), 4096, "a"),
      StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions_per_principal")));
  EXPECT_THAT(registry.Register(object.name(), 3 << 18, "b"),
              StatusIs(Code::kResourceExhausted, HasSubstr("--shared_memory_bytes)")));
  ASSERT_TRUE(registry.Register(object.name(), 4096, "b").ok());
  EXPECT_THAT(registry.Register(object.name(), 4096, "c"),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions)")));
  EXPECT_EQ(registry.size(), 3);
  ASSERT_TRUE(registry.Unregister(a1->region_id, "a"));
  EXPECT_EQ(registry.bytes(), (1 << 18) + 4096);
  EXPECT_TRUE(registry.Register(object.name(), 4096, "c").ok());
  // A CUDA IPC registration counts too: past the count it is refused before
  // the engine is asked.
  CpuEngine engine;
  EXPECT_THAT(registry.RegisterCudaIpc(std::string(kCudaIpcHandleBytes, '\0'), 0,
                                       engine.device_memory(), "d"),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions)")));
}

// Device memory whose only powers are opening CUDA IPC events and
// page-locking host memory (both counted; a lock fails while `no_locks`).
class EventOpener : public DeviceMemory {
 public:
  class Pin : public DeviceBlock {
   public:
    Pin(int* pinned, void* data, int64_t bytes) : pinned_(pinned), data_(data), bytes_(bytes) {
      ++*pinned_;
    }
    ~Pin() override { --*pinned_; }
    void* data() const override { return data_; }
    int64_t bytes() const override { return bytes_; }

   private:
    int* pinned_;
    void* data_;
    int64_t bytes_;
  };
  int pinned = 0;
  bool no_locks = false;
  absl::StatusOr<std::unique_ptr<DeviceBlock>> PinHostMemory(void* host, int64_t bytes) override {
    if (no_locks) return absl::ResourceExhaustedError("over the locked-memory limit");
    return std::unique_ptr<DeviceBlock>(new Pin(&pinned, host, bytes));
  }
  class Event : public DeviceEvent {
   public:
    explicit Event(int* open) : open_(open) { ++*open_; }
    ~Event() override { --*open_; }
    void* native() const override { return nullptr; }

   private:
    int* open_;
  };
  int open = 0;
  absl::StatusOr<std::unique_ptr<DeviceEvent>> ImportCudaIpcEvent(const std::string&) override {
    return std::unique_ptr<DeviceEvent>(new Event(&open));
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpc(const std::string&) override {
    return absl::UnimplementedError("events only");
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> Allocate(int64_t) override {
    return absl::UnimplementedError("events only");
  }
  absl::Status CopyToHost(const void*, void*, int64_t) override {
    return absl::UnimplementedError("events only");
  }
  absl::Status CopyToDevice(const void*, void*, int64_t) override {
    return absl::UnimplementedError("events only");
  }
  absl::Status Zero(void*, int64_t) override { return absl::UnimplementedError("events only"); }
};

// Event regions count among the regions, in total and per principal; an
// event is closed once it is unregistered and no call holds it; memory and
// events are not each other.
TEST(SharedMemoryTest, EventRegionsAreBoundedAndKeptWhileHeld) {
  SharedMemoryLimits limits;
  limits.max_regions = 3;
  limits.max_regions_per_principal = 2;
  SharedMemoryRegistry registry(limits);
  EventOpener events;
  const std::string handle(kCudaIpcHandleBytes, '\0');
  auto e1 = registry.RegisterCudaIpcEvent(handle, 0, &events, "a");
  auto e2 = registry.RegisterCudaIpcEvent(handle, 0, &events, "a");
  ASSERT_TRUE(e1.ok() && e2.ok()) << e1.status() << e2.status();
  EXPECT_THAT(
      registry.RegisterCudaIpcEvent(handle, 0, &events, "a"),
      StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions_per_principal")));
  ShmObject object(4096);
  ASSERT_TRUE(registry.Register(object.name(), 4096, "b").ok());
  EXPECT_THAT(registry.RegisterCudaIpcEvent(handle, 0, &events, "b"),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions)")));
  EXPECT_EQ(events.open, 2);
  EXPECT_EQ(registry.size(), 3);

  std::shared_ptr<SliceResolver> call = registry.ResolverFor("a");
  auto event = call->ResolveEvent(e1->region_id, "ready_event");
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_THAT(call->Resolve(Slice(e1->region_id, 0), 4, "hidden"),
              StatusIs(Code::kInvalidArgument, HasSubstr("is an event")));
  EXPECT_THAT(registry.ResolverFor("b")->ResolveEvent(e2->region_id, "ready_event"),
              StatusIs(Code::kNotFound, HasSubstr("unknown region")));
  ASSERT_TRUE(registry.Unregister(e1->region_id, "a"));
  EXPECT_EQ(events.open, 2);  // the call still holds it
  call.reset();
  EXPECT_EQ(events.open, 1);
  EXPECT_TRUE(registry.RegisterCudaIpcEvent(handle, 0, &events, "a").ok());
}

TEST(SharedMemoryTest, NamesAreCheckedBeforeAnythingIsOpened) {
  SharedMemoryRegistry registry;
  for (const std::string& name :
       {std::string("no-slash"), std::string("/a/b"), std::string("/\x1b[31m"),
        std::string("/") + std::string(300, 'x'), std::string("/..")}) {
    EXPECT_THAT(registry.Register(name, 4096, ""),
                StatusIs(Code::kInvalidArgument, HasSubstr("shm_name")));
  }
}

TEST(SharedMemoryTest, AnObjectShrunkAfterRegistrationIsRefusedAtUse) {
  SharedMemoryRegistry registry;
  ShmObject object(1 << 16);
  auto region = *registry.Register(object.name(), 1 << 16, "");
  object.Resize(4096);
  auto resolver = registry.ResolverFor("");
  EXPECT_THAT(resolver->Resolve(Slice(region.region_id, 0), 1024, "hidden"),
              StatusIs(Code::kFailedPrecondition, HasSubstr("holds 4096 bytes now")));
}

// The owner shrinks the object while a call holds a pointer into it: the
// server's access does not crash (it reads zeros) and the call learns its
// result is void.
TEST(SharedMemoryTest, AShrinkUnderACallIsCaughtNotACrash) {
  SharedMemoryRegistry registry;
  const int64_t bytes = 1 << 16;
  ShmObject object(bytes);
  auto region = *registry.Register(object.name(), bytes, "");
  auto resolver = registry.ResolverFor("");
  auto memory = resolver->Resolve(Slice(region.region_id, 0), bytes, "hidden");
  ASSERT_TRUE(memory.ok()) << memory.status();
  volatile char* data = static_cast<char*>(memory->data);
  data[0] = 7;
  EXPECT_TRUE(resolver->CheckIntact().ok());
  object.Resize(0);
  int64_t sum = 0;
  for (int64_t i = 0; i < bytes; i += 512) sum += data[i];  // would be SIGBUS
  data[bytes - 1] = 1;                                      // so would this
  EXPECT_EQ(sum, 0);
  EXPECT_THAT(resolver->CheckIntact(),
              StatusIs(Code::kFailedPrecondition, HasSubstr("shrunk by its owner")));
  // The region stays refused; a new registration of the regrown object works.
  object.Resize(bytes);
  EXPECT_THAT(registry.ResolverFor("")->Resolve(Slice(region.region_id, 0), 16, "target"),
              StatusIs(Code::kFailedPrecondition, HasSubstr("shrunk by its owner")));
  auto again = registry.Register(object.name(), bytes, "");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(registry.ResolverFor("")->Resolve(Slice(again->region_id, 0), 16, "t").ok());
}

TEST(SharedMemoryTest, UnregisteredRegionsLeaveTheBoundsWhenNoCallHoldsThem) {
  SharedMemoryLimits limits;
  limits.max_regions = 1;
  SharedMemoryRegistry registry(limits);
  ShmObject object(4096);
  auto region = *registry.Register(object.name(), 4096, "");
  auto resolver = registry.ResolverFor("");
  ASSERT_TRUE(resolver->Resolve(Slice(region.region_id, 0), 16, "t").ok());
  ASSERT_TRUE(registry.Unregister(region.region_id, ""));
  // Still mapped for the call that holds it: still counted.
  EXPECT_THAT(registry.Register(object.name(), 4096, ""),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions")));
  resolver.reset();
  EXPECT_TRUE(registry.Register(object.name(), 4096, "").ok());
}

}  // namespace
}  // namespace flce

namespace flce {
namespace {

TEST(SharedMemoryTest, ServerMemoryIsBoundedAndReapedWhenIdle) {
  SharedMemoryLimits limits;
  limits.max_server_bytes = 3 << 20;
  limits.max_server_bytes_per_principal = 2 << 20;
  limits.server_region_ttl = absl::Milliseconds(200);
  SharedMemoryRegistry registry(limits);
  auto a = registry.RegisterServerMemory(2 << 20, "a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(registry.RegisterServerMemory(4096, "a"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("--region_memory_bytes_per_principal")));
  auto b = registry.RegisterServerMemory(1 << 20, "b");
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(registry.RegisterServerMemory(4096, "c"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("(--region_memory_bytes)")));
  // Zeroed, and another principal's is NOT_FOUND.
  auto mine = registry.Find(a->region_id, "a");
  ASSERT_TRUE(mine.ok());
  EXPECT_TRUE((*mine)->server_memory());
  EXPECT_EQ((*mine)->base()[(2 << 20) - 1], 0);
  EXPECT_EQ(registry.Find(a->region_id, "b").status().code(), absl::StatusCode::kNotFound);
  mine->reset();
  // b is named again and again; a is not: only a goes.
  for (int i = 0; i < 6; ++i) {
    absl::SleepFor(absl::Milliseconds(60));
    ASSERT_TRUE(registry.Find(b->region_id, "b").ok());
  }
  EXPECT_EQ(registry.ReapIdle(), 1);
  EXPECT_EQ(registry.server_bytes(), 1 << 20);
  EXPECT_EQ(registry.Find(a->region_id, "a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.RegisterServerMemory(2 << 20, "a").ok());
}

// A region of server memory has a ticket that names it to anyone (the bulk
// port has no principal) and counts as a use; other regions have none.
TEST(SharedMemoryTest, ServerMemoryIsFoundByItsTicketAlone) {
  SharedMemoryLimits limits;
  limits.server_region_ttl = absl::Milliseconds(200);
  SharedMemoryRegistry registry(limits);
  auto a = registry.RegisterServerMemory(4096, "a");
  auto b = registry.RegisterServerMemory(4096, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ticket.size(), 32u);
  EXPECT_NE(a->ticket, b->ticket);
  auto found = registry.FindByTicket(a->region_id, a->ticket);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->principal, "a");
  EXPECT_EQ(found->region->bytes(), 4096);
  for (const std::string& wrong :
       {b->ticket, std::string(), a->ticket.substr(1), a->ticket + "0", a->region_id}) {
    EXPECT_THAT(registry.FindByTicket(a->region_id, wrong),
                StatusIs(Code::kNotFound, HasSubstr("or a wrong ticket")));
  }
  ShmObject object(4096);
  auto posix = registry.Register(object.name(), 4096, "a");
  ASSERT_TRUE(posix.ok());
  EXPECT_TRUE(posix->ticket.empty());
  EXPECT_EQ(registry.FindByTicket(posix->region_id, "").status().code(), Code::kNotFound);
  // Named by its ticket again and again, a stays; b goes idle.
  for (int i = 0; i < 6; ++i) {
    absl::SleepFor(absl::Milliseconds(60));
    ASSERT_TRUE(registry.FindByTicket(a->region_id, a->ticket).ok());
  }
  EXPECT_EQ(registry.ReapIdle(), 1);
  EXPECT_TRUE(registry.FindByTicket(a->region_id, a->ticket).ok());
}

// With an engine's device memory a region of server memory is page-locked
// for it, and unlocked once unregistered and unused (before it is
// unmapped); where locking fails it serves unlocked.
TEST(SharedMemoryTest, ServerMemoryIsPageLockedForTheEngine) {
  SharedMemoryRegistry registry;
  EventOpener device;
  auto locked = registry.RegisterServerMemory(1 << 20, "a", &device);
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_EQ(device.pinned, 1);
  auto held = registry.Find(locked->region_id, "a");
  ASSERT_TRUE(held.ok());
  EXPECT_TRUE(registry.Unregister(locked->region_id, "a"));
  EXPECT_EQ(device.pinned, 1);  // a call still holds it
  held->reset();
  EXPECT_EQ(device.pinned, 0);
  device.no_locks = true;
  auto unlocked = registry.RegisterServerMemory(1 << 20, "a", &device);
  ASSERT_TRUE(unlocked.ok()) << unlocked.status();
  EXPECT_EQ(device.pinned, 0);
  auto found = registry.Find(unlocked->region_id, "a");
  ASSERT_TRUE(found.ok());
  (*found)->base()[5] = 1;  // usable
}

}  // namespace
}  // namespace flce
