#include "server/weight_registry.h"

#include <cblas.h>

#include <algorithm>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/host_memory.h"

namespace flce {
namespace {

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

}  // namespace

bool WeightRegistry::ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (!IsNameChar(c)) return false;
  }
  return true;
}

namespace {

// sum += term, element by element in fp32, on OpenBLAS's threads (a
// gradient is hundreds of MiB). saxpy with alpha 1 rounds each x + y once:
// the same bits as a plain loop. sum[i] += term[i], i < n.
void AddInto(float* sum, const float* term, int64_t n) {
  constexpr int64_t kPiece = int64_t{1} << 30;  // cblas counts are int
  for (int64_t first = 0; first < n; first += kPiece) {
    cblas_saxpy(static_cast<int>(std::min(kPiece, n - first)), 1.0f, term + first, 1, sum + first,
                1);
  }
}

void AddInto(HostTensor& sum, const HostTensor& term) {
  AddInto(sum.mutable_data<float>(), term.data_as<float>(), sum.num_elements());
}

// slot = value, the old value destroyed first (whole: its page lock before
// its memory, which a member-wise assignment would free first).
void Replace(std::optional<RegisteredWeight::Grad>& slot, RegisteredWeight::Grad value) {
  slot.reset();
  slot = std::move(value);
}

// Keyed by principal and name, so principals never see each other's names.
std::string Key(const std::string& principal, const std::string& name) {
  return absl::StrCat(principal.size(), ":", principal, name);
}

}  // namespace

bool ByteBudget::TryReserve(int64_t bytes) {
  int64_t used = used_.load();
  do {
    if (bytes > limit_ - used) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

namespace {

// A list of values by key, one each, oldest first (SpareWeights').
template <typename T>
using Keyed = std::vector<std::pair<std::string, T>>;

// Appends `value` under `key`; key's earlier value, and the oldest past
// `max`, go to `dropped` (freed by the caller, after its lock).
template <typename T>
void PushKeyed(Keyed<T>& list, const std::string& key, T value, size_t max, Keyed<T>& dropped) {
  for (auto it = list.begin(); it != list.end();) {
    if (it->first == key) {
      dropped.push_back(std::move(*it));
      it = list.erase(it);
    } else {
      ++it;
    }
  }
  if (list.size() >= max) {
    dropped.push_back(std::move(list.front()));
    list.erase(list.begin());
  }
  list.emplace_back(key, std::move(value));
}

// Removes and returns `key`'s value, if any.
template <typename T>
std::optional<T> PopKeyed(Keyed<T>& list, const std::string& key) {
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (it->first == key) {
      std::optional<T> value = std::move(it->second);
      list.erase(it);
      return value;
    }
  }
  return std::nullopt;
}

}  // namespace

void SpareWeights::Keep(const std::string& key, HostMemory memory, BudgetHold hold) {
  if (static_cast<int64_t>(memory.storage.capacity()) < kMinBytes) return;
  memory.storage.clear();
  Keyed<Spare> dropped;
  absl::MutexLock lock(&mu_);
  PushKeyed(spares_, key, Spare{std::move(memory), std::move(hold)}, kMaxSpares, dropped);
}

SpareWeights::HostMemory SpareWeights::Take(const std::string& key, int64_t bytes) {
  std::optional<Spare> taken;
  {
    absl::MutexLock lock(&mu_);
    taken = PopKeyed(spares_, key);
  }
  if (!taken || static_cast<int64_t>(taken->memory.storage.capacity()) < bytes) {
    return HostMemory();
  }
  return std::move(taken->memory);
}

namespace {

std::string DeviceKey(const std::string& key, SpareWeights::DeviceKind kind) {
  return absl::StrCat(kind == SpareWeights::DeviceKind::kWeight ? "w" : "s", key);
}

bool SameParts(const std::vector<WeightPart>& a, const std::vector<WeightPart>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].first != b[k].first || a[k].rows != b[k].rows || a[k].memory != b[k].memory) {
      return false;
    }
  }
  return true;
}

}  // namespace

void SpareWeights::KeepDevice(const std::string& key, DeviceKind kind, DeviceSpare spare) {
  Keyed<DeviceSpare> dropped;
  absl::MutexLock lock(&mu_);
  PushKeyed(devices_, DeviceKey(key, kind), std::move(spare), kMaxSpares, dropped);
}

std::optional<SpareWeights::DeviceSpare> SpareWeights::TakeDevice(
    const std::string& key, DeviceKind kind, const std::vector<WeightPart>& parts) {
  std::optional<DeviceSpare> taken;
  {
    absl::MutexLock lock(&mu_);
    taken = PopKeyed(devices_, DeviceKey(key, kind));
  }
  if (taken && !SameParts(taken->parts, parts)) taken.reset();  // freed, its bytes given back
  return taken;
}

bool SpareWeights::ClearDevice() {
  Keyed<DeviceSpare> dropped;
  absl::MutexLock lock(&mu_);
  dropped.swap(devices_);
  return !dropped.empty();
}

void SpareWeights::DropDevice(const std::string& key) {
  std::optional<DeviceSpare> weight, sums;  // freed after the lock
  absl::MutexLock lock(&mu_);
  weight = PopKeyed(devices_, DeviceKey(key, DeviceKind::kWeight));
  sums = PopKeyed(devices_, DeviceKey(key, DeviceKind::kSums));
}

void SpareWeights::KeepLanding(const std::string& key, Landing landing) {
  if (landing.memory.num_elements() * 4 < kMinBytes) return;
  Keyed<Landing> dropped;
  absl::MutexLock lock(&mu_);
  PushKeyed(landings_, key, std::move(landing), kMaxSpares, dropped);
}

std::optional<SpareWeights::Landing> SpareWeights::TakeLanding(const std::string& key,
                                                               const std::vector<int64_t>& shape) {
  std::optional<Landing> taken;
  {
    absl::MutexLock lock(&mu_);
    taken = PopKeyed(landings_, key);
  }
  if (taken && taken->memory.shape != shape) taken.reset();  // unlocked, then freed
  return taken;
}

bool SpareWeights::Clear() {
  Keyed<Spare> dropped;
  Keyed<Landing> dropped_landings;
  Keyed<DeviceSpare> dropped_devices;
  absl::MutexLock lock(&mu_);
  dropped.swap(spares_);
  dropped_landings.swap(landings_);
  dropped_devices.swap(devices_);
  return !dropped.empty() || !dropped_landings.empty() || !dropped_devices.empty();
}

int64_t SpareWeights::bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [key, spare] : spares_) total += spare.hold.bytes();
  return total;
}

RegisteredWeight::RegisteredWeight(std::string name, int64_t version, std::string principal,
                                   HostTensor weight, std::optional<HostTensor> bias,
                                   std::shared_ptr<ByteBudget> device_budget, BudgetHold host_hold,
                                   std::shared_ptr<SpareWeights> spares, std::string spare_key,
                                   std::shared_ptr<DeviceBlock> weight_locked)
    : name_(std::move(name)),
      version_(version),
      principal_(std::move(principal)),
      weight_(std::move(weight)),
      weight_locked_(std::move(weight_locked)),
      bias_(std::move(bias)),
      device_budget_(std::move(device_budget)),
      host_hold_(std::move(host_hold)),
      spares_(std::move(spares)),
      spare_key_(std::move(spare_key)) {}

RegisteredWeight::~RegisteredWeight() {
  if (spares_ != nullptr) KeepDeviceMemory();
  ReleaseDevice(device_reserved_.load());
  if (spares_ == nullptr) return;
  spares_->Keep(spare_key_, {std::move(weight_.data), std::move(weight_locked_)},
                std::move(host_hold_));
  // The last take's memory, for the next version's first take.
  absl::MutexLock lock(&mu_);
  std::optional<Grad>& landing = spare_ ? spare_ : held_;
  if (landing && landing->dw_locked != nullptr) {
    spares_->KeepLanding(spare_key_, {std::move(landing->dw), std::move(landing->dw_locked)});
  }
}

bool RegisteredWeight::ReserveDevice(int64_t bytes) {
  if (device_budget_ != nullptr && !device_budget_->TryReserve(bytes) &&
      !(spares_ != nullptr && spares_->ClearDevice() && device_budget_->TryReserve(bytes))) {
    return false;
  }
  device_reserved_ += bytes;
  return true;
}

namespace {

int64_t BlockBytes(const std::vector<std::unique_ptr<DeviceBlock>>& blocks) {
  int64_t total = 0;
  for (const auto& block : blocks) total += block->bytes();
  return total;
}

}  // namespace

void RegisteredWeight::KeepDeviceMemory() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // (Destroyed: no lease or copy can be under way.)
  if (retired_ || static_cast<int64_t>(weight_.data.size()) < SpareWeights::kMinBytes) return;
  auto keep = [&](SpareWeights::DeviceKind kind, std::vector<WeightPart>& parts,
                  std::vector<std::unique_ptr<DeviceBlock>>& blocks,
                  std::vector<std::unique_ptr<DeviceBlock>>& bias_blocks, bool zero) {
    if (blocks.empty()) return;
    const int64_t bytes = BlockBytes(blocks) + BlockBytes(bias_blocks);
    device_reserved_ -= bytes;  // held by the spare from here
    spares_->KeepDevice(spare_key_, kind,
                        {BudgetHold(device_budget_, bytes), std::move(parts), std::move(blocks),
                         std::move(bias_blocks), zero});
  };
  std::vector<std::unique_ptr<DeviceBlock>> none;
  keep(SpareWeights::DeviceKind::kWeight, weight_parts_, device_weight_, none, false);
  keep(SpareWeights::DeviceKind::kSums, device_parts_, device_dw_, device_db_,
       device_backwards_.load() == 0);
}

std::optional<SpareWeights::DeviceSpare> RegisteredWeight::AdoptDeviceSpare(
    SpareWeights::DeviceKind kind, const std::vector<WeightPart>& parts, int64_t bytes_per_row) {
  if (spares_ == nullptr) return std::nullopt;
  std::optional<SpareWeights::DeviceSpare> spare = spares_->TakeDevice(spare_key_, kind, parts);
  if (!spare) return std::nullopt;
  for (size_t k = 0; k < parts.size(); ++k) {
    if (spare->blocks[k]->bytes() != parts[k].rows * bytes_per_row) {
      return std::nullopt;  // another row length or dtype: freed, its bytes given back
    }
  }
  device_reserved_ += spare->hold.Transfer();  // this version's from here
  return spare;
}

void RegisteredWeight::ReleaseDevice(int64_t bytes) {
  if (device_budget_ != nullptr) device_budget_->Release(bytes);
  device_reserved_ -= bytes;
}

int64_t RegisteredWeight::bytes() const {
  return static_cast<int64_t>(weight_.data.size() + (bias_ ? bias_->data.size() : 0));
}

void RegisteredWeight::MergeGrad(Grad grad) {
  if (!grad_) {
    grad_ = std::move(grad);
    return;
  }
  AddInto(grad_->dw, grad.dw);
  if (grad.db && grad_->db) AddInto(*grad_->db, *grad.db);
  grad_->backwards += grad.backwards;
}

void RegisteredWeight::AccumulateGrad(HostTensor dw, std::optional<HostTensor> db) {
  absl::MutexLock lock(&mu_);
  MergeGrad(Grad{std::move(dw), std::move(db), 1});
}

namespace {

// Zeroes each part's sums (dW's, and db's where there are any); false at
// the first that cannot be (a device fault).
bool ZeroSums(const std::vector<WeightPart>& parts,
              const std::vector<std::unique_ptr<DeviceBlock>>& dw,
              const std::vector<std::unique_ptr<DeviceBlock>>& db) {
  for (size_t k = 0; k < parts.size(); ++k) {
    if (!parts[k].memory->Zero(dw[k]->data(), dw[k]->bytes()).ok()) return false;
    if (!db.empty() && !parts[k].memory->Zero(db[k]->data(), db[k]->bytes()).ok()) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<RegisteredWeight::Grad> RegisteredWeight::TakeGrad(bool pending, uint64_t resume) {
  absl::MutexLock device_lock(&device_mu_);
  absl::MutexLock lock(&mu_);
  auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !take_pending_; };
  mu_.AwaitWithTimeout(absl::Condition(&settled), absl::Seconds(2));
  if (held_) {
    if (resume != 0 && held_->take_id == resume) {
      MergeGrad(*std::move(held_));
    } else {
      Replace(spare_, *std::move(held_));
    }
    held_.reset();
  }
  const int64_t device_backwards = device_backwards_.load();
  if (!grad_ && device_backwards == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("weight ", name_, " version ", version_,
                     ": no gradient accumulated (Backward with accumulate_weight_grad adds one)"));
  }
  if (device_backwards > 0) {
    Grad device;
    std::optional<SpareWeights::Landing> earlier;
    if (spare_ && spare_->dw.shape == weight_.shape) {
      device = *std::move(spare_);  // touched and page-locked already
    } else if (spares_ != nullptr &&
               (earlier = spares_->TakeLanding(spare_key_, weight_.shape)).has_value()) {
      device.dw = std::move(earlier->memory);  // an earlier version's, likewise
      device.dw_locked = std::move(earlier->locked);
    } else {
      device.dw = HostTensor(DType::kFloat32, weight_.shape);
      absl::StatusOr<std::unique_ptr<DeviceBlock>> locked = device_parts_[0].memory->PinHostMemory(
          device.dw.data.data(), static_cast<int64_t>(device.dw.data.size()));
      if (locked.ok()) device.dw_locked = *std::move(locked);  // else: through staging
    }
    spare_.reset();
    device.db.reset();
    device.backwards = device_backwards;
    if (!device_db_.empty()) device.db = HostTensor(DType::kFloat32, {weight_.shape[0]});
    FLCE_RETURN_IF_ERROR(GatherDeviceSums(device));
    device_backwards_ = 0;
    MergeGrad(std::move(device));
    // The sums start again from zero, where the next Backwards add; a sum
    // that cannot be zeroed (a device fault) is dropped, its contents taken
    // already, and the host accumulator serves from then on.
    if (!ZeroSums(device_parts_, device_dw_, device_db_)) {
      FreeParts(device_dw_);
      FreeParts(device_db_);
      no_device_ = true;
    }
  }
  Grad grad = std::move(*grad_);
  grad_.reset();
  static std::atomic<uint64_t> last_take_id{0};  // unique across versions
  grad.take_id = ++last_take_id;
  take_pending_ = pending;
  return grad;
}

absl::Status RegisteredWeight::GatherDeviceSums(Grad& into) {
  const int64_t h = weight_.shape[1];
  const size_t count = device_parts_.size();
  // A part whose rows an earlier part holds too (a replica on another
  // device) lands in memory of its own, added after.
  std::vector<bool> added(count, false);
  for (size_t k = 0; k < count; ++k) {
    const WeightPart& a = device_parts_[k];
    for (size_t j = 0; j < k; ++j) {
      const WeightPart& b = device_parts_[j];
      if (b.first < a.first + a.rows && a.first < b.first + b.rows) added[k] = true;
    }
  }
  std::vector<HostTensor> dw_of(count), db_of(count);
  std::vector<absl::Status> copied(count);
  auto copy = [&](size_t k) {
    const WeightPart& part = device_parts_[k];
    float* dw = into.dw.mutable_data<float>() + part.first * h;
    float* db = into.db ? into.db->mutable_data<float>() + part.first : nullptr;
    if (added[k]) {
      dw_of[k] = HostTensor(DType::kFloat32, {part.rows, h});
      dw = dw_of[k].mutable_data<float>();
      if (db != nullptr) {
        db_of[k] = HostTensor(DType::kFloat32, {part.rows});
        db = db_of[k].mutable_data<float>();
      }
    }
    copied[k] = part.memory->CopyToHost(device_dw_[k]->data(), dw, part.rows * h * 4);
    if (copied[k].ok() && db != nullptr) {
      copied[k] = part.memory->CopyToHost(device_db_[k]->data(), db, part.rows * 4);
    }
  };
  // The parts' copies at once.
  std::vector<std::thread> threads;
  for (size_t k = 1; k < count; ++k) threads.emplace_back(copy, k);
  copy(0);
  for (std::thread& t : threads) t.join();
  for (const absl::Status& c : copied) FLCE_RETURN_IF_ERROR(c);
  for (size_t k = 0; k < count; ++k) {
    if (!added[k]) continue;
    const WeightPart& part = device_parts_[k];
    AddInto(into.dw.mutable_data<float>() + part.first * h, dw_of[k].data_as<float>(),
            part.rows * h);
    if (into.db)
      AddInto(into.db->mutable_data<float>() + part.first, db_of[k].data_as<float>(), part.rows);
  }
  return absl::OkStatus();
}

void RegisteredWeight::ConfirmTake(Grad taken, bool hold) {
  absl::MutexLock lock(&mu_);
  take_pending_ = false;
  Replace(hold ? held_ : spare_, std::move(taken));
}

std::vector<std::unique_ptr<DeviceBlock>> RegisteredWeight::AllocateParts(
    const std::vector<WeightPart>& parts, int64_t bytes_per_row) {
  std::vector<std::unique_ptr<DeviceBlock>> blocks;
  for (const WeightPart& part : parts) {
    const int64_t bytes = part.rows * bytes_per_row;
    if (!ReserveDevice(bytes)) {
      FreeParts(blocks);
      return blocks;
    }
    absl::StatusOr<std::unique_ptr<DeviceBlock>> block = part.memory->Allocate(bytes);
    if (!block.ok()) {
      ReleaseDevice(bytes);
      FreeParts(blocks);
      return blocks;
    }
    blocks.push_back(*std::move(block));
  }
  return blocks;
}

void RegisteredWeight::FreeParts(std::vector<std::unique_ptr<DeviceBlock>>& blocks) {
  int64_t total = 0;
  for (const auto& block : blocks) total += block->bytes();
  blocks.clear();
  ReleaseDevice(total);
}

namespace {

bool HaveMemory(const std::vector<WeightPart>& parts) {
  if (parts.empty()) return false;
  for (const WeightPart& part : parts) {
    if (part.memory == nullptr) return false;
  }
  return true;
}

}  // namespace

std::vector<TensorView> RegisteredWeight::DeviceWeight(const std::vector<WeightPart>& parts) {
  absl::MutexLock lock(&weight_mu_);
  // e.g. the CPU engine: never ask again.
  if (!HaveMemory(parts)) no_device_weight_ = true;
  const int64_t row_bytes = weight_.shape[1] * DTypeSize(weight_.dtype);
  if (device_weight_.empty() && !no_device_weight_) {
    // The memory of the name's version before where it has the same parts
    // (a training loop's next step), else new; an empty answer: the budget
    // is spent, the host copy serves.
    std::vector<std::unique_ptr<DeviceBlock>> blocks;
    if (std::optional<SpareWeights::DeviceSpare> spare =
            AdoptDeviceSpare(SpareWeights::DeviceKind::kWeight, parts, row_bytes)) {
      blocks = std::move(spare->blocks);
    } else {
      blocks = AllocateParts(parts, row_bytes);
    }
    // Copied from page-locked memory at the bus's rate; the lock stays
    // with the memory for the name's next versions (a weight of kMinBytes
    // or more; without a lock the copy goes through staging).
    if (!blocks.empty() && weight_locked_ == nullptr && spares_ != nullptr &&
        static_cast<int64_t>(weight_.data.size()) >= SpareWeights::kMinBytes) {
      absl::StatusOr<std::unique_ptr<DeviceBlock>> locked = parts[0].memory->PinHostMemory(
          weight_.data.data(), static_cast<int64_t>(weight_.data.capacity()));
      if (locked.ok()) weight_locked_ = *std::move(locked);
    }
    bool copied = !blocks.empty();
    for (size_t k = 0; copied && k < parts.size(); ++k) {
      copied = parts[k]
                   .memory
                   ->CopyToDevice(weight_.data.data() + parts[k].first * row_bytes,
                                  blocks[k]->data(), parts[k].rows * row_bytes)
                   .ok();
    }
    if (copied) {
      weight_parts_ = parts;
      device_weight_ = std::move(blocks);
    } else {
      FreeParts(blocks);
    }
  }
  std::vector<TensorView> views;
  for (size_t k = 0; k < device_weight_.size(); ++k) {
    views.push_back(TensorView{weight_.dtype,
                               {parts[k].rows, weight_.shape[1]},
                               device_weight_[k]->data(),
                               MemorySpace::kCuda});
  }
  return views;
}

// The lease holds device_mu_ from here until its destructor: a hand-over
// the thread-safety analysis cannot follow.
std::optional<RegisteredWeight::DeviceGrad> RegisteredWeight::LeaseDeviceGrad(
    const std::vector<WeightPart>& parts) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  device_mu_.Lock();
  if (!HaveMemory(parts)) no_device_ = true;  // e.g. the CPU engine: never ask again
  if (device_dw_.empty() && !no_device_) {
    std::vector<std::unique_ptr<DeviceBlock>> dw, db;
    // The sums of the name's version before where they were for the same
    // parts and bias (zeroed unless they are zero), else new ones.
    if (std::optional<SpareWeights::DeviceSpare> spare =
            AdoptDeviceSpare(SpareWeights::DeviceKind::kSums, parts, weight_.shape[1] * 4)) {
      dw = std::move(spare->blocks);
      db = std::move(spare->bias_blocks);
      if (db.empty() == bias_.has_value() || (!spare->zero && !ZeroSums(parts, dw, db))) {
        FreeParts(dw);
        FreeParts(db);
      }
    }
    if (dw.empty()) dw = AllocateParts(parts, weight_.shape[1] * 4);
    if (!dw.empty() && bias_ && db.empty()) {
      db = AllocateParts(parts, 4);
      if (db.empty()) FreeParts(dw);
    }
    if (!dw.empty()) {
      device_parts_ = parts;
      device_dw_ = std::move(dw);
      device_db_ = std::move(db);
    }
  }
  if (device_dw_.empty()) {
    device_mu_.Unlock();
    return std::nullopt;
  }
  return DeviceGrad(this);
}

RegisteredWeight::DeviceGrad::~DeviceGrad() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (weight_ != nullptr) weight_->device_mu_.Unlock();
}

namespace {

// The sums start at zero (allocated zeroed, zeroed again by each take):
// every Backward adds.
std::vector<GradientDestination> Destinations(
    const std::vector<std::unique_ptr<DeviceBlock>>& blocks) {
  std::vector<GradientDestination> out;
  for (const auto& block : blocks) {
    out.push_back(GradientDestination{block->data(), MemorySpace::kCuda, /*accumulate=*/true});
  }
  return out;
}

}  // namespace

std::vector<GradientDestination> RegisteredWeight::DeviceGrad::dw() const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  return Destinations(weight_->device_dw_);
}

std::vector<GradientDestination> RegisteredWeight::DeviceGrad::db() const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  return Destinations(weight_->device_db_);
}

void RegisteredWeight::DeviceGrad::Added() { ++weight_->device_backwards_; }

absl::Status RegisteredWeight::CheckGradDType(DType dtype, absl::string_view field) const {
  if (dtype == DType::kFloat32 || dtype == weight_.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", DTypeName(dtype),
                                                 " not supported; expected fp32 or the weight's ",
                                                 DTypeName(weight_.dtype)));
}

int64_t RegisteredWeight::GradSize(const Grad& grad, DType dtype) {
  return (grad.dw.num_elements() + (grad.db ? grad.db->num_elements() : 0)) * DTypeSize(dtype);
}

absl::Status RegisteredWeight::GradBytesInto(const Grad& grad, DType dtype, absl::string_view field,
                                             char* out) const {
  FLCE_RETURN_IF_ERROR(CheckGradDType(dtype, field));
  const int64_t dw = grad.dw.num_elements();
  FromFloatInParallel(dtype, grad.dw.data_as<float>(), dw, out);
  if (grad.db) {
    FromFloatInParallel(dtype, grad.db->data_as<float>(), grad.db->num_elements(),
                        out + dw * DTypeSize(dtype));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RegisteredWeight::GradBytes(const Grad& grad, DType dtype,
                                                        absl::string_view field) const {
  FLCE_RETURN_IF_ERROR(CheckGradDType(dtype, field));
  std::string bytes(static_cast<size_t>(GradSize(grad, dtype)), '\0');
  FLCE_RETURN_IF_ERROR(GradBytesInto(grad, dtype, field, &bytes[0]));
  return bytes;
}

void RegisteredWeight::RestoreGrad(Grad grad) {
  absl::MutexLock lock(&mu_);
  MergeGrad(std::move(grad));
  take_pending_ = false;
}

int64_t RegisteredWeight::accumulated_backwards() const {
  absl::MutexLock lock(&mu_);
  return (grad_ ? grad_->backwards : 0) + device_backwards_.load();
}

WeightRegistry::WeightRegistry(int64_t memory_budget_bytes, int64_t device_budget_bytes,
                               std::function<int64_t()> host_available)
    : host_budget_(std::make_shared<ByteBudget>(memory_budget_bytes)),
      device_budget_(std::make_shared<ByteBudget>(device_budget_bytes)),
      host_available_(host_available ? std::move(host_available) : HostAvailableBytes) {}

absl::Status WeightRegistry::OverBudget(const std::string& name, int64_t bytes) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("weight memory: ", name, " needs ", bytes, " bytes, ", host_budget_->used(),
                   " of the budget of ", host_budget_->limit(),
                   " bytes are in use (--weight_memory_bytes: every registered version still held, "
                   "and uploads in progress)"));
}

absl::StatusOr<BudgetHold> WeightRegistry::Reserve(const std::string& name, int64_t bytes) const {
  // Spares yield to an upload that needs their room (in the budget, or in
  // the host's memory).
  absl::Status memory =
      CheckHostMemory(bytes, host_available_(), absl::StrCat("weight memory: ", name));
  if (!memory.ok() && spares_->Clear()) {
    memory = CheckHostMemory(bytes, host_available_(), absl::StrCat("weight memory: ", name));
  }
  FLCE_RETURN_IF_ERROR(memory);
  if (!host_budget_->TryReserve(bytes) && !(spares_->Clear() && host_budget_->TryReserve(bytes))) {
    return OverBudget(name, bytes);
  }
  return BudgetHold(host_budget_, bytes);
}

SpareWeights::HostMemory WeightRegistry::TakeSpare(const std::string& name,
                                                   const std::string& principal, int64_t bytes) {
  return spares_->Take(Key(principal, name), bytes);
}

absl::StatusOr<std::shared_ptr<RegisteredWeight>> WeightRegistry::Put(
    const std::string& name, const std::string& principal, HostTensor weight,
    std::optional<HostTensor> bias, BudgetHold hold, std::shared_ptr<DeviceBlock> locked) {
  // Any refusal unlocks `weight`'s memory here, before the caller frees it
  // (a version made takes `locked` over, leaving this nothing to do).
  absl::Cleanup unlock = [&locked] { locked.reset(); };
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.name: '", name, "' must be 1-128 characters of [A-Za-z0-9_.-]"));
  }
  const int64_t bytes = static_cast<int64_t>(weight.data.size() + (bias ? bias->data.size() : 0));
  // Declared before the lock: a replaced version is freed after it.
  std::shared_ptr<RegisteredWeight> replaced;
  absl::MutexLock lock(&mu_);
  const std::string key = Key(principal, name);
  auto it = latest_.find(key);
  if (hold.bytes() != bytes) {
    // Without a reservation: the replaced version lets go of its bytes
    // first where nothing else holds it.
    if (it != latest_.end()) {
      replaced = std::move(it->second);
      latest_.erase(it);
      if (replaced.use_count() == 1) replaced.reset();
    }
    hold = BudgetHold();
    if (!host_budget_->TryReserve(bytes) &&
        !(spares_->Clear() && host_budget_->TryReserve(bytes))) {
      absl::Status over = OverBudget(name, bytes);
      if (replaced != nullptr) latest_[key] = std::move(replaced);
      return over;
    }
    hold = BudgetHold(host_budget_, bytes);
  }
  auto [last, fresh] = last_version_.try_emplace(key, retired_floor_);
  const int64_t version = ++last->second;
  if (fresh) ForgetRetiredNames();
  auto registered = std::make_shared<RegisteredWeight>(
      name, version, principal, std::move(weight), std::move(bias), device_budget_, std::move(hold),
      spares_, key, std::move(locked));
  replaced = std::move(latest_[key]);
  latest_[key] = registered;
  return registered;
}

absl::StatusOr<std::shared_ptr<RegisteredWeight>> WeightRegistry::Get(
    const std::string& name, int64_t version, const std::string& principal) const {
  absl::MutexLock lock(&mu_);
  auto it = latest_.find(Key(principal, name));
  if (it == latest_.end()) {
    return absl::NotFoundError(
        absl::StrCat("weight_ref: no weight named '", name, "' (PutWeight registers one)"));
  }
  if (version != 0 && version != it->second->version()) {
    return absl::NotFoundError(absl::StrCat("weight_ref: ", name, " version ", version,
                                            " is not registered (the latest is version ",
                                            it->second->version(), ")"));
  }
  return it->second;
}

void WeightRegistry::ForgetRetiredNames() {
  // Deleted names keep their last version so that a name put again goes on
  // from it; past kMaxRetiredNames of them they are forgotten, and every
  // name new to the registry starts above all that were.
  constexpr size_t kMaxRetiredNames = size_t{1} << 16;
  if (last_version_.size() <= latest_.size() + kMaxRetiredNames) return;
  for (auto it = last_version_.begin(); it != last_version_.end();) {
    if (latest_.contains(it->first)) {
      ++it;
    } else {
      retired_floor_ = std::max(retired_floor_, it->second);
      last_version_.erase(it++);
    }
  }
}

bool WeightRegistry::Delete(const std::string& name, const std::string& principal) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(principal, name);
  auto it = latest_.find(key);
  if (it == latest_.end()) return false;
  // Its device memory goes with it (its host memory stays a spare).
  it->second->Retire();
  latest_.erase(it);
  spares_->DropDevice(key);
  return true;
}

std::vector<std::shared_ptr<RegisteredWeight>> WeightRegistry::List(
    const std::string& principal) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<RegisteredWeight>> out;
  for (const auto& [key, weight] : latest_) {
    if (weight->principal() == principal) out.push_back(weight);
  }
  return out;
}

int64_t WeightRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(latest_.size());
}

}  // namespace flce
