#include "server/weight_registry.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

HostTensor Weight(int64_t v, int64_t h, float value) {
  HostTensor t(DType::kFloat32, {v, h});
  for (int64_t i = 0; i < v * h; ++i) t.mutable_data<float>()[i] = value;
  return t;
}

TEST(WeightRegistryTest, EachPutIsANewVersion) {
  WeightRegistry registry(1 << 20);
  auto v1 = registry.Put("lm_head", "", Weight(4, 3, 1.0f), std::nullopt);
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_EQ((*v1)->version(), 1);
  auto v2 = registry.Put("lm_head", "", Weight(4, 3, 2.0f), std::nullopt);
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ((*v2)->version(), 2);
  EXPECT_EQ((*registry.Get("lm_head", 0, ""))->version(), 2);
  EXPECT_EQ((*registry.Get("lm_head", 2, ""))->version(), 2);
  EXPECT_THAT(registry.Get("lm_head", 1, ""),
              StatusIs(Code::kNotFound,
                       HasSubstr("version 1 is not registered (the latest is version 2)")));
  // The old version lives on while held, and its bytes count until it goes.
  EXPECT_EQ((*v1)->weight().data_as<float>()[0], 1.0f);
  EXPECT_EQ(registry.bytes_in_use(), 96);
  v1 = absl::StatusOr<std::shared_ptr<RegisteredWeight>>();
  EXPECT_EQ(registry.bytes_in_use(), 48);
}

// An upload's bytes are taken from the budget when its header arrives,
// beside every version alive; they pass to the version it registers.
TEST(WeightRegistryTest, ReservedUploadsCountUntilTheyEnd) {
  WeightRegistry registry(100, int64_t{1} << 30, [] { return int64_t{1} << 30; });
  auto w = *registry.Put("w", "", Weight(5, 4, 0), std::nullopt);  // 80 bytes
  EXPECT_THAT(registry.Reserve("w", 80),
              StatusIs(Code::kResourceExhausted, HasSubstr("needs 80 bytes, 80 of the budget")));
  {
    auto hold = registry.Reserve("x", 16);
    ASSERT_TRUE(hold.ok());
    EXPECT_EQ(registry.bytes_in_use(), 96);
    EXPECT_THAT(registry.Reserve("y", 8),
                StatusIs(Code::kResourceExhausted, HasSubstr("--weight_memory_bytes")));
  }  // an upload that never finished
  EXPECT_EQ(registry.bytes_in_use(), 80);
  auto hold = *registry.Reserve("x", 16);
  ASSERT_TRUE(registry.Put("x", "", Weight(2, 2, 0), std::nullopt, std::move(hold)).ok());
  EXPECT_EQ(registry.bytes_in_use(), 96);
  ASSERT_TRUE(registry.Delete("x", ""));
  EXPECT_EQ(registry.bytes_in_use(), 80);
  // More than the host has is refused before anything is taken.
  WeightRegistry small(int64_t{1} << 40, int64_t{1} << 30, [] { return int64_t{1} << 20; });
  EXPECT_THAT(small.Reserve("big", int64_t{1} << 30),
              StatusIs(Code::kResourceExhausted, HasSubstr("available")));
  EXPECT_EQ(small.bytes_in_use(), 0);
}

// A replaced version's memory (a weight of a MiB or more) is kept for the
// name's next upload, outside bytes_in_use, and yields to anything that
// needs its room.
TEST(WeightRegistryTest, ReplacedMemoryIsReusedAndYields) {
  const int64_t bytes = int64_t{1} << 20;  // 512 × 512 fp32
  WeightRegistry registry(3 * bytes, int64_t{1} << 30, [] { return int64_t{1} << 40; });
  ASSERT_TRUE(registry.Put("w", "", Weight(512, 512, 1.0f), std::nullopt).ok());
  auto v2 = registry.Put("w", "", Weight(512, 512, 2.0f), std::nullopt);  // v1 becomes a spare
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(registry.bytes_in_use(), bytes);
  EXPECT_LT(static_cast<int64_t>(registry.TakeSpare("w", "bob", bytes).storage.capacity()),
            bytes);  // another's name
  std::string spare = registry.TakeSpare("w", "", bytes).storage;
  EXPECT_GE(static_cast<int64_t>(spare.capacity()), bytes);
  EXPECT_TRUE(spare.empty());
  EXPECT_LT(static_cast<int64_t>(registry.TakeSpare("w", "", bytes).storage.capacity()),
            bytes);  // taken once
  // A spare yields to another name's upload that needs its room.
  v2 = absl::StatusOr<std::shared_ptr<RegisteredWeight>>();
  ASSERT_TRUE(registry.Put("w", "", Weight(512, 512, 3.0f), std::nullopt).ok());  // v2 spare
  EXPECT_EQ(registry.bytes_in_use(), bytes);
  auto hold = registry.Reserve("x", 2 * bytes);
  ASSERT_TRUE(hold.ok()) << hold.status();
  EXPECT_LT(static_cast<int64_t>(registry.TakeSpare("w", "", bytes).storage.capacity()), bytes);
  EXPECT_EQ(registry.bytes_in_use(), 3 * bytes);
}

TEST(WeightRegistryTest, NamesAreCheckedAndPerPrincipal) {
  WeightRegistry registry(1 << 20);
  EXPECT_THAT(registry.Put("bad name", "", Weight(1, 1, 0), std::nullopt),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.name")));
  EXPECT_THAT(registry.Put("", "", Weight(1, 1, 0), std::nullopt),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.name")));
  ASSERT_TRUE(registry.Put("w", "alice", Weight(1, 1, 0), std::nullopt).ok());
  EXPECT_THAT(registry.Get("w", 0, "bob"), StatusIs(Code::kNotFound, HasSubstr("no weight named")));
  EXPECT_FALSE(registry.Delete("w", "bob"));
  EXPECT_EQ(registry.List("alice").size(), 1u);
  EXPECT_TRUE(registry.List("bob").empty());
}

TEST(WeightRegistryTest, BudgetIsResourceExhaustedAndReplacingCountsOnce) {
  WeightRegistry registry(100);
  ASSERT_TRUE(registry.Put("w", "", Weight(5, 4, 0), std::nullopt).ok());  // 80 bytes
  // Replacing w frees its 80 bytes first.
  ASSERT_TRUE(registry.Put("w", "", Weight(5, 4, 0), std::nullopt).ok());
  EXPECT_THAT(
      registry.Put("x", "", Weight(2, 4, 0), std::nullopt),
      StatusIs(Code::kResourceExhausted, HasSubstr("needs 32 bytes, 80 of the budget of 100")));
}

TEST(WeightRegistryTest, DeleteIsIdempotentAndVersionsAreNeverReused) {
  WeightRegistry registry(1 << 20);
  ASSERT_TRUE(registry.Put("w", "", Weight(1, 1, 0), std::nullopt).ok());
  EXPECT_TRUE(registry.Delete("w", ""));
  EXPECT_FALSE(registry.Delete("w", ""));
  EXPECT_EQ(registry.bytes_in_use(), 0);
  EXPECT_EQ((*registry.Put("w", "", Weight(1, 1, 0), std::nullopt))->version(), 2);
}

// A client putting and deleting ever new names leaves a bounded record
// behind, and still no version of a name is given twice.
TEST(WeightRegistryTest, DeletedNamesAreRememberedBoundedlyAndVersionsNeverRepeat) {
  WeightRegistry registry(1 << 20);
  ASSERT_EQ((*registry.Put("n0", "", Weight(1, 1, 0), std::nullopt))->version(), 1);
  ASSERT_EQ((*registry.Put("n0", "", Weight(1, 1, 0), std::nullopt))->version(), 2);
  ASSERT_TRUE(registry.Delete("n0", ""));
  for (int i = 1; i <= 70000; ++i) {
    const std::string name = absl::StrCat("n", i);
    ASSERT_TRUE(registry.Put(name, "", Weight(1, 1, 0), std::nullopt).ok());
    ASSERT_TRUE(registry.Delete(name, ""));
  }
  EXPECT_GT((*registry.Put("n0", "", Weight(1, 1, 0), std::nullopt))->version(), 2);
  EXPECT_EQ(registry.bytes_in_use(), 4);
}

TEST(WeightRegistryTest, GradientAccumulatesTakesAndRestores) {
  WeightRegistry registry(1 << 20);
  HostTensor bias(DType::kFloat32, {2});
  auto w = *registry.Put("w", "", Weight(2, 2, 0), bias);
  EXPECT_THAT(w->TakeGrad(), StatusIs(Code::kFailedPrecondition, HasSubstr("no gradient")));
  HostTensor db(DType::kFloat32, {2});
  db.mutable_data<float>()[0] = db.mutable_data<float>()[1] = 0.5f;
  w->AccumulateGrad(Weight(2, 2, 1.0f), db);
  w->AccumulateGrad(Weight(2, 2, 2.0f), db);
  EXPECT_EQ(w->accumulated_backwards(), 2);
  auto grad = w->TakeGrad();
  ASSERT_TRUE(grad.ok());
  EXPECT_EQ(grad->backwards, 2);
  EXPECT_EQ(grad->dw.data_as<float>()[3], 3.0f);
  EXPECT_EQ(grad->db->data_as<float>()[1], 1.0f);
  EXPECT_EQ(w->accumulated_backwards(), 0);
  w->AccumulateGrad(Weight(2, 2, 1.0f), db);
  w->RestoreGrad(*std::move(grad));
  auto again = w->TakeGrad();
  EXPECT_EQ(again->backwards, 3);
  EXPECT_EQ(again->dw.data_as<float>()[0], 4.0f);
}

TEST(WeightRegistryTest, GradBytesAreFp32OrTheWeightsDTypeRoundedOnce) {
  WeightRegistry registry(1 << 20);
  HostTensor w16(DType::kBFloat16, {2, 2});
  HostTensor b16(DType::kBFloat16, {2});
  auto w = *registry.Put("w", "", std::move(w16), std::move(b16));
  HostTensor db(DType::kFloat32, {2});
  db.mutable_data<float>()[0] = db.mutable_data<float>()[1] = 0.5f;
  w->AccumulateGrad(Weight(2, 2, 1.0f + 1.0f / 512), db);  // not a bf16 value
  auto grad = w->TakeGrad();
  ASSERT_TRUE(grad.ok());
  auto fp32 = w->GradBytes(*grad, DType::kFloat32, "dtype");
  ASSERT_TRUE(fp32.ok());
  ASSERT_EQ(fp32->size(), 6 * 4u);
  float first;
  std::memcpy(&first, fp32->data(), 4);
  EXPECT_EQ(first, 1.0f + 1.0f / 512);
  auto bf16 = w->GradBytes(*grad, DType::kBFloat16, "dtype");
  ASSERT_TRUE(bf16.ok());
  ASSERT_EQ(bf16->size(), 6 * 2u);
  uint16_t bits;
  std::memcpy(&bits, bf16->data(), 2);
  EXPECT_EQ(bits, 0x3f80);  // 1 + 2^-9 rounds to 1 in bf16 (ties to even)
  std::memcpy(&bits, bf16->data() + 4 * 2, 2);
  EXPECT_EQ(bits, 0x3f00);  // db's 0.5 after dW's four elements
  EXPECT_THAT(w->GradBytes(*grad, DType::kFloat16, "dtype"),
              StatusIs(Code::kInvalidArgument, HasSubstr("dtype: fp16 not supported")));
  EXPECT_TRUE(w->CheckGradDType(DType::kBFloat16, "dtype").ok());
}

// Large gradients are summed on OpenBLAS's threads: the same bits as adding
// element by element in fp32.
TEST(WeightRegistryTest, LargeGradientsSumExactlyAsPlainFloatAdds) {
  WeightRegistry registry(int64_t{1} << 30);
  auto w = *registry.Put("w", "", Weight(301, 257, 0), std::nullopt);
  HostTensor a(DType::kFloat32, {301, 257}), b(DType::kFloat32, {301, 257});
  std::vector<float> want(a.num_elements());
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    a.mutable_data<float>()[i] = 1.0f / static_cast<float>(i + 3);
    b.mutable_data<float>()[i] = static_cast<float>(i % 97) * 1e-3f - 0.04f;
    want[i] = a.data_as<float>()[i] + b.data_as<float>()[i];
  }
  w->AccumulateGrad(std::move(a), std::nullopt);
  w->AccumulateGrad(std::move(b), std::nullopt);
  auto grad = w->TakeGrad();
  ASSERT_TRUE(grad.ok());
  EXPECT_EQ(std::memcmp(grad->dw.data_as<float>(), want.data(), want.size() * sizeof(float)), 0);
}

// Device memory that is host memory: enough to drive the registry's device
// copies and sums the way a CUDA engine's does. Allocations fail while
// `exhausted`. (An engine without a device has none: a null DeviceMemory.)
class FakeDeviceMemory : public DeviceMemory {
 public:
  bool exhausted = false;
  int allocations = 0;
  int locks = 0, unlocks = 0;  // PinHostMemory's

  absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpc(const std::string&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::unique_ptr<DeviceEvent>> ImportCudaIpcEvent(const std::string&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> Allocate(int64_t bytes) override {
    if (exhausted) return absl::ResourceExhaustedError("fake device full");
    ++allocations;
    return std::unique_ptr<DeviceBlock>(new Block(bytes));
  }
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override {
    std::memcpy(host, device, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) override {
    std::memcpy(device, host, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status Zero(void* device, int64_t bytes) override {
    ++zeroed;
    std::memset(device, 0, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  int zeroed = 0;  // Zero's calls
  absl::StatusOr<std::unique_ptr<DeviceBlock>> PinHostMemory(void* host, int64_t bytes) override {
    if (!lock_host) return absl::UnimplementedError("fake");
    ++locks;
    return std::unique_ptr<DeviceBlock>(new Locked(host, bytes, &unlocks));
  }
  bool lock_host = false;

 private:
  class Locked : public DeviceBlock {
   public:
    Locked(void* host, int64_t bytes, int* unlocks)
        : host_(host), bytes_(bytes), unlocks_(unlocks) {}
    ~Locked() override { ++*unlocks_; }
    void* data() const override { return host_; }
    int64_t bytes() const override { return bytes_; }

   private:
    void* host_;
    int64_t bytes_;
    int* unlocks_;
  };

  class Block : public DeviceBlock {
   public:
    explicit Block(int64_t bytes) : bytes_(static_cast<size_t>(bytes), '\0') {}
    void* data() const override { return const_cast<char*>(bytes_.data()); }
    int64_t bytes() const override { return static_cast<int64_t>(bytes_.size()); }

   private:
    std::string bytes_;
  };
};

// The one part of an engine with one device memory (LossEngine::WeightParts).
std::vector<WeightPart> Whole(const std::shared_ptr<RegisteredWeight>& w, DeviceMemory* memory) {
  return {WeightPart{0, w->weight().shape[0], memory}};
}

// What an engine's Backward does with a DeviceGrad: writes (first) or adds
// `value` into every element of dW and db, `h` floats a row.
void AddOnDevice(const RegisteredWeight::DeviceGrad& grad, int64_t v, int64_t h, float value) {
  auto add = [&](const GradientDestination& to, int64_t count) {
    EXPECT_EQ(to.space, MemorySpace::kCuda);
    float* f = static_cast<float*>(to.data);
    for (int64_t i = 0; i < count; ++i) f[i] = (to.accumulate ? f[i] : 0.0f) + value;
  };
  ASSERT_EQ(grad.dw().size(), 1u);
  add(grad.dw()[0], v * h);
  if (!grad.db().empty()) add(grad.db()[0], v);
}

TEST(WeightRegistryTest, DeviceSumsMergeWithTheHostOnTake) {
  FakeDeviceMemory memory;
  WeightRegistry registry(1 << 20);
  auto w = *registry.Put("w", "", Weight(3, 2, 0), HostTensor(DType::kFloat32, {3}));
  for (float value : {1.0f, 2.0f}) {
    auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
    ASSERT_TRUE(grad.has_value());
    EXPECT_TRUE(grad->dw()[0].accumulate);  // into sums allocated zeroed
    AddOnDevice(*grad, 3, 2, value);
    grad->Added();
  }
  EXPECT_EQ(w->accumulated_backwards(), 2);
  // A broken TakeWeightGrad stream put a host sum back meanwhile.
  HostTensor db(DType::kFloat32, {3});
  for (int i = 0; i < 3; ++i) db.mutable_data<float>()[i] = 0.25f;
  w->RestoreGrad(RegisteredWeight::Grad{Weight(3, 2, 0.5f), db, 1});
  EXPECT_EQ(w->accumulated_backwards(), 3);
  auto taken = w->TakeGrad();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->backwards, 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(taken->dw.data_as<float>()[i], 3.5f);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(taken->db->data_as<float>()[i], 3.25f);
  EXPECT_THAT(w->TakeGrad(), StatusIs(Code::kFailedPrecondition, HasSubstr("no gradient")));
  // A take zeroes the device sums (dW and db): the next Backward adds into
  // zeros.
  EXPECT_EQ(memory.zeroed, 2);
  {
    auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
    EXPECT_TRUE(grad->dw()[0].accumulate);
    AddOnDevice(*grad, 3, 2, 4.0f);
    grad->Added();
  }
  EXPECT_EQ(w->TakeGrad()->dw.data_as<float>()[5], 4.0f);
  EXPECT_EQ(memory.allocations, 2);  // dW and db, once
}

// A take from the device sum lands in memory page-locked once and reused:
// the last take's, once it is no longer held for a resume.
TEST(WeightRegistryTest, TakesFromTheDeviceReuseTheLastTakesLockedMemory) {
  FakeDeviceMemory memory;
  memory.lock_host = true;
  WeightRegistry registry(1 << 20);
  auto w = *registry.Put("w", "", Weight(3, 2, 0), std::nullopt);
  const void* first = nullptr;
  for (int step = 0; step < 4; ++step) {
    {
      auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
      AddOnDevice(*grad, 3, 2, 1.0f + step);
      grad->Added();
    }
    auto taken = w->TakeGrad(/*pending=*/true, /*resume=*/0);
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ(taken->dw.data_as<float>()[4], 1.0f + step);
    EXPECT_NE(taken->dw_locked, nullptr);
    if (step == 0) first = taken->dw.data.data();
    EXPECT_EQ(taken->dw.data.data(), first) << step;  // the same memory every time
    w->ConfirmTake(*std::move(taken), /*hold=*/step % 2 == 0);
  }
  EXPECT_EQ(memory.locks, 1);
  EXPECT_EQ(memory.unlocks, 0);
  // A held take that is resumed goes back into the sum, exactly.
  {
    auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
    AddOnDevice(*grad, 3, 2, 10.0f);
    grad->Added();
  }
  auto held = w->TakeGrad(true, 0);
  const uint64_t id = held->take_id;
  w->ConfirmTake(*std::move(held), /*hold=*/true);
  {
    auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
    AddOnDevice(*grad, 3, 2, 0.5f);
    grad->Added();
  }
  auto resumed = w->TakeGrad(true, id);
  ASSERT_TRUE(resumed.ok());
  EXPECT_EQ(resumed->dw.data_as<float>()[0], 10.5f);
  EXPECT_EQ(resumed->backwards, 2);
  // (The resumed take's memory holds the sum; the device's came into new
  // memory, added and freed.) Every lock ends with its memory.
  EXPECT_EQ(memory.locks, 2);
  resumed = absl::InternalError("dropped");
  EXPECT_EQ(memory.unlocks, 2);
}

// A training loop puts a new version every step and takes its gradient
// once: each version's first take lands in the memory of the take before
// it, page-locked once (the landing of a version gone goes to its name's
// next version); another shape, another name or a Clear does not reuse it.
TEST(WeightRegistryTest, TakesOfNewVersionsReuseTheLastVersionsLockedMemory) {
  FakeDeviceMemory memory;
  memory.lock_host = true;
  WeightRegistry registry(int64_t{64} << 20);
  const int64_t v = 512, h = 512;  // 1 MiB fp32: the smallest landing kept
  const void* first = nullptr;
  auto step = [&](const std::string& name, int64_t rows, float value, bool hold) {
    auto w = *registry.Put(name, "", Weight(rows, h, 0), std::nullopt);
    {
      auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
      AddOnDevice(*grad, rows, h, value);
      grad->Added();
    }
    auto taken = w->TakeGrad(/*pending=*/true, /*resume=*/0);
    EXPECT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ(taken->dw.data_as<float>()[rows * h - 1], value);
    EXPECT_NE(taken->dw_locked, nullptr);
    const void* landed = taken->dw.data.data();
    w->ConfirmTake(*std::move(taken), hold);
    return landed;  // the version goes once replaced (nothing else holds it)
  };
  first = step("w", v, 1.0f, /*hold=*/true);
  for (int k = 2; k <= 4; ++k) {
    EXPECT_EQ(step("w", v, static_cast<float>(k), /*hold=*/k % 2 == 0), first) << k;
  }
  EXPECT_EQ(memory.locks, 1);
  EXPECT_EQ(memory.unlocks, 0);
  // Another name has its own; another shape of this name frees it.
  EXPECT_NE(step("other", v, 5.0f, true), first);
  EXPECT_EQ(memory.locks, 2);
  step("w", v + 1, 6.0f, true);
  EXPECT_EQ(memory.locks, 3);
  EXPECT_EQ(memory.unlocks, 1);  // the landing of shape [512, 512]
  // Clearing the spares (an upload that needs the room) frees landings too.
  auto last = *registry.Put("w", "", Weight(v, h, 0), std::nullopt);
  last.reset();
  registry.Delete("w", "");
  EXPECT_EQ(memory.unlocks, 1);
  auto big = registry.Reserve("huge", (int64_t{64} << 20) - (int64_t{1} << 20));
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(memory.unlocks, 2);  // "w"'s landing ("other"'s is its live version's)
}

// A training loop's next version takes over the device memory of the one
// before (its weight's copy and its gradient sums, zeroed) and the page
// lock of its host copy: after the first two versions nothing is allocated
// or locked again, and the copy on the device is the new version's.
TEST(WeightRegistryTest, NextVersionsTakeOverDeviceMemoryAndTheLockedHostCopy) {
  FakeDeviceMemory memory;
  memory.lock_host = true;
  WeightRegistry registry(int64_t{64} << 20);
  const int64_t v = 512, h = 512;  // 1 MiB fp32: the smallest kept
  const int64_t bytes = v * h * 4;
  // As the PutWeight handler does: into the name's spare memory, if any.
  auto put = [&](const std::string& name, int64_t rows, float value) {
    SpareWeights::HostMemory spare = registry.TakeSpare(name, "", rows * h * 4);
    HostTensor weight = Weight(rows, h, value);
    spare.storage.assign(weight.data);
    weight.data = std::move(spare.storage);
    return *registry.Put(name, "", std::move(weight), std::nullopt, BudgetHold(),
                         std::move(spare.locked));
  };
  struct Placed {
    const void* weight;
    const void* sums;
  };
  auto step = [&](const std::string& name, int64_t rows, float value) {
    auto w = put(name, rows, value);
    std::vector<TensorView> device = w->DeviceWeight(Whole(w, &memory));
    EXPECT_EQ(device.size(), 1u);
    const float* copied = static_cast<const float*>(device[0].data);
    EXPECT_EQ(copied[0], value);
    EXPECT_EQ(copied[rows * h - 1], value);
    auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
    EXPECT_TRUE(grad.has_value());
    const float* sums = static_cast<const float*>(grad->dw()[0].data);
    EXPECT_EQ(sums[0], 0.0f);  // every version's sums start at zero
    EXPECT_EQ(sums[rows * h - 1], 0.0f);
    AddOnDevice(*grad, rows, h, value);  // never taken: the next version zeroes them
    grad->Added();
    return Placed{device[0].data, grad->dw()[0].data};
  };
  const Placed first = step("w", v, 1.0f);
  EXPECT_EQ(memory.allocations, 2);  // the copy and the sums
  for (int k = 2; k <= 5; ++k) {
    const Placed next = step("w", v, static_cast<float>(k));
    EXPECT_EQ(next.weight, first.weight) << k;
    EXPECT_EQ(next.sums, first.sums) << k;
  }
  EXPECT_EQ(memory.allocations, 2);
  EXPECT_EQ(memory.zeroed, 4);
  // Two host copies in turn (a version is put while the one before lives).
  EXPECT_EQ(memory.locks, 2);
  EXPECT_EQ(memory.unlocks, 0);
  EXPECT_EQ(registry.device_bytes_in_use(), 2 * bytes);
  // Another row length frees the spares and allocates anew.
  step("w", v + 1, 6.0f);
  EXPECT_EQ(memory.allocations, 4);
  EXPECT_EQ(registry.device_bytes_in_use(), 2 * (v + 1) * h * 4);
  // Deleting the name frees its device memory with its last version.
  ASSERT_TRUE(registry.Delete("w", ""));
  EXPECT_EQ(registry.device_bytes_in_use(), 0);
}

// A version gone keeps its device memory only while nothing else needs the
// device budget's room.
TEST(WeightRegistryTest, DeviceSparesYieldToAnyWeight) {
  FakeDeviceMemory memory;
  const int64_t v = 512, h = 512, bytes = v * h * 4;
  WeightRegistry registry(int64_t{64} << 20, /*device_budget_bytes=*/bytes + bytes / 2);
  auto w = *registry.Put("w", "", Weight(v, h, 1.0f), std::nullopt);
  EXPECT_EQ(w->DeviceWeight(Whole(w, &memory)).size(), 1u);
  w = *registry.Put("w", "", Weight(v, h, 2.0f), std::nullopt);  // version 1 goes: a spare
  EXPECT_EQ(registry.device_bytes_in_use(), bytes);
  auto x = *registry.Put("x", "", Weight(v, h, 3.0f), std::nullopt);
  std::vector<TensorView> device = x->DeviceWeight(Whole(x, &memory));
  ASSERT_EQ(device.size(), 1u);
  EXPECT_EQ(static_cast<const float*>(device[0].data)[0], 3.0f);
  EXPECT_EQ(registry.device_bytes_in_use(), bytes);  // x's; w's spare freed
  EXPECT_EQ(memory.allocations, 2);
}

// Device memory kept from versions gone is bounded too: at most kMaxSpares
// weight copies, the oldest freed first, their bytes back in the budget.
TEST(WeightRegistryTest, DeviceSparesKeptAreBounded) {
  FakeDeviceMemory memory;
  const int64_t v = 512, h = 512, bytes = v * h * 4;  // 1 MiB fp32
  WeightRegistry registry(int64_t{256} << 20);
  const int names = static_cast<int>(SpareWeights::kMaxSpares) + 3;
  for (int i = 0; i < names; ++i) {
    const std::string name = absl::StrCat("w", i);
    auto w = *registry.Put(name, "", Weight(v, h, 1.0f), std::nullopt);
    ASSERT_EQ(w->DeviceWeight(Whole(w, &memory)).size(), 1u);
    w.reset();
    ASSERT_TRUE(registry.Put(name, "", Weight(v, h, 2.0f), std::nullopt).ok());  // v1 goes
  }
  EXPECT_EQ(memory.allocations, names);
  EXPECT_EQ(registry.device_bytes_in_use(), static_cast<int64_t>(SpareWeights::kMaxSpares) * bytes);
}

// Landings of versions gone are bounded: at most kMaxSpares, the oldest
// freed first.
TEST(WeightRegistryTest, LandingsKeptAreBounded) {
  FakeDeviceMemory memory;
  memory.lock_host = true;
  WeightRegistry registry(int64_t{256} << 20);
  const int64_t v = 512, h = 512;  // 1 MiB fp32
  const int names = static_cast<int>(SpareWeights::kMaxSpares) + 3;
  for (int i = 0; i < names; ++i) {
    const std::string name = absl::StrCat("w", i);
    auto w = *registry.Put(name, "", Weight(v, h, 0), std::nullopt);
    {
      auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
      AddOnDevice(*grad, v, h, 1.0f);
      grad->Added();
    }
    auto taken = w->TakeGrad(/*pending=*/true, /*resume=*/0);
    ASSERT_TRUE(taken.ok()) << taken.status();
    w->ConfirmTake(*std::move(taken), /*hold=*/true);
    w.reset();
    registry.Delete(name, "");  // the version goes: its landing is kept
  }
  EXPECT_EQ(memory.locks, names);
  EXPECT_EQ(memory.unlocks, 3);  // the three oldest
}

// A lease that never reports success (the Backward failed) adds no count,
// and the lease is exclusive: the next one waits for it to end.
TEST(WeightRegistryTest, AFailedBackwardAddsNothing) {
  FakeDeviceMemory memory;
  WeightRegistry registry(1 << 20);
  auto w = *registry.Put("w", "", Weight(2, 2, 0), std::nullopt);
  {
    auto grad = w->LeaseDeviceGrad(Whole(w, &memory));
    ASSERT_TRUE(grad.has_value());
    EXPECT_TRUE(grad->db().empty());
  }
  EXPECT_EQ(w->accumulated_backwards(), 0);
  EXPECT_THAT(w->TakeGrad(), StatusIs(Code::kFailedPrecondition, HasSubstr("no gradient")));
  auto again = w->LeaseDeviceGrad(Whole(w, &memory));
  EXPECT_TRUE(again.has_value());
}

// Without device memory the host serves: no device memory at all is
// remembered, RESOURCE_EXHAUSTED is asked again next time.
TEST(WeightRegistryTest, WithoutDeviceMemoryTheHostServes) {
  FakeDeviceMemory memory;
  WeightRegistry registry(1 << 20);
  auto w = *registry.Put("w", "", Weight(2, 2, 1.5f), std::nullopt);
  memory.exhausted = true;
  EXPECT_FALSE(w->LeaseDeviceGrad(Whole(w, &memory)).has_value());
  EXPECT_TRUE(w->DeviceWeight(Whole(w, &memory)).empty());
  memory.exhausted = false;
  std::vector<TensorView> device = w->DeviceWeight(Whole(w, &memory));
  ASSERT_EQ(device.size(), 1u);
  EXPECT_EQ(device[0].space, MemorySpace::kCuda);
  EXPECT_EQ(device[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(static_cast<const float*>(device[0].data)[3], 1.5f);          // copied from the host
  EXPECT_EQ(w->DeviceWeight(Whole(w, &memory))[0].data, device[0].data);  // once per version
  EXPECT_TRUE(w->LeaseDeviceGrad(Whole(w, &memory)).has_value());

  // An engine without device memory (null): remembered, never asked again.
  FakeDeviceMemory later;
  auto v = *registry.Put("v", "", Weight(2, 2, 0), std::nullopt);
  EXPECT_FALSE(v->LeaseDeviceGrad(Whole(v, nullptr)).has_value());
  EXPECT_TRUE(v->DeviceWeight(Whole(v, nullptr)).empty());
  EXPECT_FALSE(v->LeaseDeviceGrad(Whole(v, &later)).has_value());
  EXPECT_TRUE(v->DeviceWeight(Whole(v, &later)).empty());
  EXPECT_EQ(later.allocations, 0);
}

// On several devices (a sharded engine's WeightParts) each part of the rows
// is copied into its own memory, its gradients summed there, and a take
// gathers every part's sums into their rows.
TEST(WeightRegistryTest, PartsOnSeveralDevicesGatherOnTake) {
  FakeDeviceMemory a, b;
  WeightRegistry registry(1 << 20, /*device_budget_bytes=*/1 << 20);
  const int64_t v = 5, h = 2;
  HostTensor weight(DType::kFloat32, {v, h});
  for (int64_t i = 0; i < v * h; ++i) weight.mutable_data<float>()[i] = static_cast<float>(i);
  HostTensor bias(DType::kFloat32, {v});
  auto w = *registry.Put("w", "", std::move(weight), std::move(bias));
  const std::vector<WeightPart> parts = {{0, 2, &a}, {2, 3, &b}};
  std::vector<TensorView> device = w->DeviceWeight(parts);
  ASSERT_EQ(device.size(), 2u);
  EXPECT_EQ(device[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(device[1].shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(static_cast<const float*>(device[0].data)[3], 3.0f);
  EXPECT_EQ(static_cast<const float*>(device[1].data)[0], 4.0f);  // row 2 of the whole
  EXPECT_EQ(a.allocations, 1);
  EXPECT_EQ(b.allocations, 1);
  for (float step : {1.0f, 2.0f}) {
    auto grad = w->LeaseDeviceGrad(parts);
    ASSERT_TRUE(grad.has_value());
    ASSERT_EQ(grad->dw().size(), 2u);
    ASSERT_EQ(grad->db().size(), 2u);
    for (size_t k = 0; k < 2; ++k) {
      const GradientDestination dw = grad->dw()[k], db = grad->db()[k];
      EXPECT_TRUE(dw.accumulate);
      for (int64_t r = 0; r < parts[k].rows; ++r) {
        const float value = step * static_cast<float>(10 * (k + 1) + r);
        for (int64_t c = 0; c < h; ++c) {
          float& f = static_cast<float*>(dw.data)[r * h + c];
          f = (dw.accumulate ? f : 0.0f) + value;
        }
        float& f = static_cast<float*>(db.data)[r];
        f = (db.accumulate ? f : 0.0f) - value;
      }
    }
    grad->Added();
  }
  EXPECT_EQ(registry.device_bytes_in_use(), (v * h + v * h + v) * 4);
  auto taken = w->TakeGrad();
  ASSERT_TRUE(taken.ok()) << taken.status();
  const float want[] = {30, 33, 60, 63, 66};  // 3 × (10(k+1) + r), part k's row r
  for (int64_t row = 0; row < v; ++row) {
    EXPECT_EQ(taken->dw.data_as<float>()[row * h + 1], want[row]) << row;
    EXPECT_EQ(taken->db->data_as<float>()[row], -want[row]) << row;
  }
  EXPECT_EQ(taken->backwards, 2);

  // A part without device memory: the host serves, for good.
  auto u = *registry.Put("u", "", Weight(v, h, 1.0f), std::nullopt);
  const std::vector<WeightPart> host_part = {{0, 2, &a}, {2, 3, nullptr}};
  EXPECT_TRUE(u->DeviceWeight(host_part).empty());
  EXPECT_FALSE(u->LeaseDeviceGrad(host_part).has_value());
  EXPECT_TRUE(u->DeviceWeight(parts).empty());
  EXPECT_EQ(a.allocations + b.allocations, 2 + 4);  // w's copies, dW and db sums only
}

// Replicas (an engine that spreads requests: every part the whole
// vocabulary, on its own device): each Backward adds into its replica's
// sums alone; a take adds the replicas' sums together and zeroes them all.
TEST(WeightRegistryTest, ReplicasAddUpOnTake) {
  FakeDeviceMemory a, b;
  WeightRegistry registry(1 << 20, /*device_budget_bytes=*/1 << 20);
  auto w = *registry.Put("w", "", Weight(3, 2, 1.0f), HostTensor(DType::kFloat32, {3}));
  const std::vector<WeightPart> replicas = {{0, 3, &a}, {0, 3, &b}};
  ASSERT_EQ(w->DeviceWeight(replicas).size(), 2u);
  // Three Backwards: on replica 0, 1, 0, each adding its value into its
  // replica's dW and db.
  auto backward = [&](size_t replica, float value) {
    auto grad = w->LeaseDeviceGrad(replicas);
    ASSERT_TRUE(grad.has_value());
    for (const auto& to : {grad->dw()[replica], grad->db()[replica]}) {
      EXPECT_TRUE(to.accumulate);
      float* f = static_cast<float*>(to.data);
      for (int i = 0; i < (to.data == grad->dw()[replica].data ? 6 : 3); ++i) f[i] += value;
    }
    grad->Added();
  };
  backward(0, 1.0f);
  backward(1, 10.0f);
  backward(0, 100.0f);
  auto taken = w->TakeGrad();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->backwards, 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(taken->dw.data_as<float>()[i], 111.0f);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(taken->db->data_as<float>()[i], 111.0f);
  EXPECT_EQ(a.zeroed + b.zeroed, 4);  // each replica's dW and db
  // The next take sees only what came after this one.
  backward(1, 0.5f);
  EXPECT_EQ(w->TakeGrad()->dw.data_as<float>()[3], 0.5f);
}

// A part that does not fit gives back what the others took.
TEST(WeightRegistryTest, APartThatDoesNotFitFreesTheOthers) {
  FakeDeviceMemory a, b;
  b.exhausted = true;
  WeightRegistry registry(1 << 20, /*device_budget_bytes=*/1 << 20);
  auto w = *registry.Put("w", "", Weight(4, 2, 1.0f), std::nullopt);
  const std::vector<WeightPart> parts = {{0, 2, &a}, {2, 2, &b}};
  EXPECT_TRUE(w->DeviceWeight(parts).empty());
  EXPECT_FALSE(w->LeaseDeviceGrad(parts).has_value());
  EXPECT_EQ(registry.device_bytes_in_use(), 0);
  b.exhausted = false;  // asked again: fits now
  EXPECT_EQ(w->DeviceWeight(parts).size(), 2u);
  EXPECT_TRUE(w->LeaseDeviceGrad(parts).has_value());
  EXPECT_EQ(registry.device_bytes_in_use(), 2 * 4 * 2 * 4);
}

// The device budget bounds the copies and sums of every version alive;
// past it the host serves, and a version's bytes come back when it dies.
TEST(WeightRegistryTest, DeviceBudgetBoundsCopiesAndSums) {
  FakeDeviceMemory memory;
  WeightRegistry registry(1 << 20, /*device_budget_bytes=*/40);
  auto w = *registry.Put("w", "", Weight(2, 2, 1.0f), std::nullopt);  // 16 bytes each
  EXPECT_FALSE(w->DeviceWeight(Whole(w, &memory)).empty());
  EXPECT_TRUE(w->LeaseDeviceGrad(Whole(w, &memory)).has_value());
  EXPECT_EQ(registry.device_bytes_in_use(), 32);
  auto v = *registry.Put("v", "", Weight(2, 2, 2.0f), std::nullopt);
  EXPECT_TRUE(v->DeviceWeight(Whole(v, &memory)).empty());  // 48 > 40: the host copy serves
  EXPECT_FALSE(v->LeaseDeviceGrad(Whole(v, &memory)).has_value());
  EXPECT_EQ(registry.device_bytes_in_use(), 32);
  // Replacing w and dropping the last reference frees its 32 bytes.
  ASSERT_TRUE(registry.Put("w", "", Weight(2, 2, 3.0f), std::nullopt).ok());
  w.reset();
  EXPECT_EQ(registry.device_bytes_in_use(), 0);
  EXPECT_FALSE(v->DeviceWeight(Whole(v, &memory)).empty());  // asked again, fits now
  EXPECT_EQ(registry.device_bytes_in_use(), 16);
}

}  // namespace
}  // namespace flce
