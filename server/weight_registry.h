#ifndef FLCE_SERVER_WEIGHT_REGISTRY_H_
#define FLCE_SERVER_WEIGHT_REGISTRY_H_

// Registered weights: W [V, H] (and optional b [V]) stored once under a name
// and referenced by Forward, with versions and a server-side fp32 gradient
// accumulator per version.
//
// - Each Put of a name makes version previous + 1 the latest; Get of an
//   older version is NOT_FOUND ("replaced by version k"). A version lives on
//   as long as something holds it (a session made from it, a call in flight).
// - Names belong to the principal that put them; another principal sees
//   NOT_FOUND.
// - A memory budget bounds the host bytes of every version alive and of the
//   uploads in progress (reserved when their header arrives, before
//   anything is allocated); RESOURCE_EXHAUSTED with the numbers past it.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/device_memory.h"
#include "kernels/loss_engine.h"
#include "kernels/tensor.h"

namespace flce {

// A byte budget shared by a registry and its weights (which may outlive it):
// the host copies of every version alive and the uploads in progress, or the
// device copies and gradient sums.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  // Takes `bytes` of the budget; false (nothing taken) past the limit.
  bool TryReserve(int64_t bytes);
  void Release(int64_t bytes) { used_ -= bytes; }
  int64_t used() const { return used_.load(); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Bytes taken from a ByteBudget, given back when destroyed. Move-only.
class BudgetHold {
 public:
  BudgetHold() = default;
  BudgetHold(std::shared_ptr<ByteBudget> budget, int64_t bytes)
      : budget_(std::move(budget)), bytes_(bytes) {}
  BudgetHold(BudgetHold&& other) noexcept
      : budget_(std::move(other.budget_)), bytes_(std::exchange(other.bytes_, 0)) {}
  BudgetHold& operator=(BudgetHold&& other) noexcept {
    if (this != &other) {
      Reset();
      budget_ = std::move(other.budget_);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~BudgetHold() { Reset(); }
  int64_t bytes() const { return bytes_; }
  // Ends the hold without giving its bytes back (whoever takes them over
  // counts them from now): the bytes.
  int64_t Transfer() {
    budget_.reset();
    return std::exchange(bytes_, 0);
  }

 private:
  void Reset() {
    if (budget_ != nullptr && bytes_ != 0) budget_->Release(bytes_);
    budget_.reset();
    bytes_ = 0;
  }
  std::shared_ptr<ByteBudget> budget_;
  int64_t bytes_ = 0;
};

// Memory of versions gone, kept for their name's next upload: a put of a
// gigabyte weight into fresh pages spends most of its time in the kernel
// clearing them (bench/RESULTS.md), so a training loop's weight sync reuses
// the version before last's instead. A spare keeps its budget hold (it is
// memory held), yields it to any upload or put that needs the room, and is
// kept only for weights of at least kMinBytes, at most kMaxSpares of them.
//
// The same for the memory a take from the device sums lands in (a
// "landing": fp32, the weight's shape, touched and page-locked for the
// engine): a training loop puts a new version every optimizer step and
// takes its gradient once, so without this every take faulted in and
// page-locked a fresh landing (bench/RESULTS.md: a 1 GiB take from C++, a
// new version each time, 0.43 s; from Python, one version taken again,
// 0.23-0.27 s). A version gone hands its landing to its name's next
// version. Landings are not in the budget (a version's own is not either),
// at most kMaxSpares of them are kept, and Clear frees them too.
class SpareWeights {
 public:
  static constexpr int64_t kMinBytes = int64_t{1} << 20;
  static constexpr size_t kMaxSpares = 8;
  // A weight's host memory and its page lock for the engine's devices
  // (null: not locked), declared after the memory, so it is unlocked first.
  struct HostMemory {
    std::string storage;
    std::shared_ptr<DeviceBlock> locked;
  };
  // Keeps `memory` (with the hold of its bytes) for `key`'s next upload.
  void Keep(const std::string& key, HostMemory memory, BudgetHold hold);
  // The spare of `key` if its capacity holds `bytes` (emptied, capacity
  // and page lock kept; its hold released), else empty (a spare too small
  // is freed).
  HostMemory Take(const std::string& key, int64_t bytes);

  // A take's landing: fp32 memory and its page lock (null: not locked),
  // declared after the memory, so it is unlocked first.
  struct Landing {
    HostTensor memory;
    std::shared_ptr<DeviceBlock> locked;
  };
  // Keeps `landing` for `key`'s next version's first take.
  void KeepLanding(const std::string& key, Landing landing);
  // The landing of `key` if its shape is `shape`, else nullopt (a landing
  // of another shape is freed).
  std::optional<Landing> TakeLanding(const std::string& key, const std::vector<int64_t>& shape);

  // A version's device memory of one kind (its weight's copy, or its
  // gradient sums), a block per part of `parts` (the sums: dW's, then
  // db's where there is a bias), with the device budget's hold of their
  // bytes (declared first: given back once the blocks are freed). `zero`:
  // the sums hold zeros (no Backward added since the last take).
  struct DeviceSpare {
    BudgetHold hold;
    std::vector<WeightPart> parts;
    std::vector<std::unique_ptr<DeviceBlock>> blocks;
    std::vector<std::unique_ptr<DeviceBlock>> bias_blocks;
    bool zero = false;
  };
  enum class DeviceKind { kWeight, kSums };
  // Keeps `spare` for `key`'s next version.
  void KeepDevice(const std::string& key, DeviceKind kind, DeviceSpare spare);
  // The device spare of `key` and `kind` if it was made for `parts` (the
  // same memories and rows), else nullopt (a spare for other parts is freed).
  std::optional<DeviceSpare> TakeDevice(const std::string& key, DeviceKind kind,
                                        const std::vector<WeightPart>& parts);
  // Frees the device spares; true if there was one (they yield to any
  // version that needs the device budget's room).
  bool ClearDevice();

  // Frees the device spares of `key` (its name was deleted).
  void DropDevice(const std::string& key);
  // Frees every spare and landing; true if there was one.
  bool Clear();
  // Bytes the spares hold (landings and device spares not counted: outside
  // the host budget).
  int64_t bytes() const;

 private:
  struct Spare {
    HostMemory memory;
    BudgetHold hold;
  };
  // By key, one each, oldest first.
  mutable absl::Mutex mu_;
  std::vector<std::pair<std::string, Spare>> spares_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, Landing>> landings_ ABSL_GUARDED_BY(mu_);
  // Keyed by DeviceKey(key, kind).
  std::vector<std::pair<std::string, DeviceSpare>> devices_ ABSL_GUARDED_BY(mu_);
};

class RegisteredWeight {
 public:
  // Device copies and sums are taken from `device_budget` (none without);
  // `host_hold` is the host budget the tensors take, given back with the
  // version, or with the weight's memory to `spares` (under `spare_key`),
  // when given.
  RegisteredWeight(std::string name, int64_t version, std::string principal, HostTensor weight,
                   std::optional<HostTensor> bias,
                   std::shared_ptr<ByteBudget> device_budget = nullptr,
                   BudgetHold host_hold = BudgetHold(),
                   std::shared_ptr<SpareWeights> spares = nullptr, std::string spare_key = "",
                   std::shared_ptr<DeviceBlock> weight_locked = nullptr);
  ~RegisteredWeight();
  RegisteredWeight(const RegisteredWeight&) = delete;
  RegisteredWeight& operator=(const RegisteredWeight&) = delete;

  const std::string& name() const { return name_; }
  int64_t version() const { return version_; }
  const std::string& principal() const { return principal_; }
  const HostTensor& weight() const { return weight_; }
  const std::optional<HostTensor>& bias() const { return bias_; }
  int64_t bytes() const;

  // The name was deleted: this version's device memory is freed with it,
  // not kept for a next version.
  void Retire() { retired_ = true; }

  // Adds fp32 gradients (dW [V, H], db [V] iff the weight has a bias); the
  // first ones after a TakeGrad become the accumulator (no copy).
  // REQUIRES: shapes match the weight's.
  void AccumulateGrad(HostTensor dw, std::optional<HostTensor> db);

  struct Grad {
    HostTensor dw;                 // fp32 [V, H]
    std::optional<HostTensor> db;  // fp32 [V]
    int64_t backwards = 0;         // calls summed
    uint64_t take_id = 0;          // from TakeGrad, to acknowledge a held take
    // dW's page lock for the engine's device (a take's copy from the device
    // sum runs at the bus's rate into it); declared last, so it is unlocked
    // before dW's memory is freed. Null: not locked.
    std::shared_ptr<DeviceBlock> dw_locked;
  };
  // The accumulated gradient, leaving the accumulator empty.
  // FAILED_PRECONDITION when nothing was accumulated. With `pending`, the
  // take is on its way to a client: until ConfirmTake or RestoreGrad ends
  // it, a later TakeGrad waits for it (briefly: the client may ask again as
  // soon as its call failed, before the gradient is put back).
  // A take kept by ConfirmTake is settled first: named by `resume`, it
  // goes back into the sum taken now; otherwise it is dropped.
  absl::StatusOr<Grad> TakeGrad(bool pending = false, uint64_t resume = 0);

  // A pending take was delivered. With `hold` (the take itself), it is kept
  // until the next TakeGrad, which may resume it by its take_id; a take not
  // held, or a held one not resumed, gives its memory to the next take from
  // the device sum (already touched and page-locked: the copy runs at the
  // bus's rate instead of faulting in fresh pages through staging buffers).
  void ConfirmTake(Grad taken, bool hold);

  // Puts a taken gradient back (its delivery failed), so nothing is lost.
  void RestoreGrad(Grad grad);

  // A gradient is given in fp32 as summed, or rounded once to the weight's
  // own dtype; INVALID_ARGUMENT naming `field` for any other dtype.
  absl::Status CheckGradDType(DType dtype, absl::string_view field) const;
  // `grad`'s bytes in `dtype` (dW then db, little-endian).
  absl::StatusOr<std::string> GradBytes(const Grad& grad, DType dtype,
                                        absl::string_view field) const;
  // The same bytes into `out` (GradSize of room), without a buffer between.
  absl::Status GradBytesInto(const Grad& grad, DType dtype, absl::string_view field,
                             char* out) const;
  static int64_t GradSize(const Grad& grad, DType dtype);

  int64_t accumulated_backwards() const;

  // The accumulator on the engine's device, held by one Backward at a time
  // (others that accumulate into this version wait) until destroyed.
  class DeviceGrad {
   public:
    DeviceGrad(DeviceGrad&& other) noexcept : weight_(other.weight_) { other.weight_ = nullptr; }
    DeviceGrad& operator=(DeviceGrad&&) = delete;
    ~DeviceGrad();
    // Where the Backward adds dW and db (fp32, device memory), a
    // destination per part of the engine's WeightParts (db: none without a
    // bias). The sums start at zero and a take zeroes them again, so every
    // Backward adds (an engine that writes only some parts, as one that
    // spreads requests over replicas, leaves the others' sums as they are).
    std::vector<GradientDestination> dw() const;
    std::vector<GradientDestination> db() const;
    // The Backward succeeded: its gradients are in the accumulator.
    void Added();

   private:
    friend class RegisteredWeight;
    explicit DeviceGrad(RegisteredWeight* weight) : weight_(weight) {}
    RegisteredWeight* weight_;
  };
  // W's rows by part of the engine's WeightParts (`parts`, the same every
  // call), each a view of a copy in its part's device memory, made on first
  // use (into the memory of the name's version before, where it had the
  // same parts, from the host copy page-locked for the copy and kept locked
  // for the versions after) and freed with the version or kept for the
  // name's next one (SpareWeights); or empty when a part has no device
  // memory (an engine without one), there is none to give or the device
  // budget is spent (the host copy serves then; asked again later, but
  // never again after a part without memory).
  std::vector<TensorView> DeviceWeight(const std::vector<WeightPart>& parts);

  // The device accumulator, its sums allocated by part of `parts` (as
  // DeviceWeight's) on first use, or taken over (zeroed) from the name's
  // version before; nullopt when a part has no device memory,
  // there is none to give or the device budget is spent (the host
  // accumulator of AccumulateGrad serves then). TakeGrad gathers what the
  // parts hold, each into its rows (summing parts that hold the same rows:
  // replicas), and zeroes them.
  std::optional<DeviceGrad> LeaseDeviceGrad(const std::vector<WeightPart>& parts);

 private:
  const std::string name_;
  const int64_t version_;
  const std::string principal_;
  HostTensor weight_;  // never changed; its memory moves to spares_ when destroyed
  // weight_'s page lock (null: none yet), made by DeviceWeight; declared
  // after weight_, so it is unlocked first, and moves to spares_ with it.
  std::shared_ptr<DeviceBlock> weight_locked_;
  const std::optional<HostTensor> bias_;
  std::atomic<bool> retired_{false};
  mutable absl::Mutex mu_;
  std::optional<Grad> grad_ ABSL_GUARDED_BY(mu_);
  bool take_pending_ ABSL_GUARDED_BY(mu_) = false;
  // A delivered take kept until the next TakeGrad.
  std::optional<Grad> held_ ABSL_GUARDED_BY(mu_);
  // A delivered take's memory, for the next take from the device sum (and,
  // once this version is gone, for its name's next version's).
  std::optional<Grad> spare_ ABSL_GUARDED_BY(mu_);
  // grad_ += grad (or grad_ = grad when empty: no copy).
  void MergeGrad(Grad grad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const std::shared_ptr<ByteBudget> device_budget_;
  BudgetHold host_hold_;  // moves to spares_ with the weight's memory
  const std::shared_ptr<SpareWeights> spares_;
  const std::string spare_key_;
  std::atomic<int64_t> device_reserved_{0};  // of device_budget_, released when destroyed
  // Takes `bytes` of the device budget (always, without one), the device
  // spares freed first when they are in the way.
  bool ReserveDevice(int64_t bytes);
  // Moves this version's device memory to spares_ (a weight of kMinBytes
  // or more, not retired); called when it is destroyed.
  void KeepDeviceMemory();
  // The device spare of `kind` made for `parts`, blocks of `bytes_per_row`
  // × each part's rows, its bytes counted as this version's from now;
  // nullopt without one.
  std::optional<SpareWeights::DeviceSpare> AdoptDeviceSpare(SpareWeights::DeviceKind kind,
                                                            const std::vector<WeightPart>& parts,
                                                            int64_t bytes_per_row);
  void ReleaseDevice(int64_t bytes);
  // Blocks of `bytes_per_row` × each part's rows in its memory (zeroed),
  // or empty (none reserved) when the budget or a device has no room.
  std::vector<std::unique_ptr<DeviceBlock>> AllocateParts(const std::vector<WeightPart>& parts,
                                                          int64_t bytes_per_row);
  // Frees blocks of AllocateParts and gives their bytes back to the budget.
  void FreeParts(std::vector<std::unique_ptr<DeviceBlock>>& blocks);
  // Each part's device sums into their rows of `into` (fp32, the weight's
  // shape; db where it has one): copied, or added where an earlier part (a
  // replica on another device) holds the same rows; the parts' copies at
  // once.
  absl::Status GatherDeviceSums(Grad& into) ABSL_EXCLUSIVE_LOCKS_REQUIRED(device_mu_);
  absl::Mutex weight_mu_;
  std::vector<WeightPart> weight_parts_ ABSL_GUARDED_BY(weight_mu_);
  std::vector<std::unique_ptr<DeviceBlock>> device_weight_ ABSL_GUARDED_BY(weight_mu_);
  bool no_device_weight_ ABSL_GUARDED_BY(weight_mu_) = false;
  // Held by a DeviceGrad, and by TakeGrad; taken before mu_.
  absl::Mutex device_mu_;
  std::vector<WeightPart> device_parts_ ABSL_GUARDED_BY(device_mu_);
  std::vector<std::unique_ptr<DeviceBlock>> device_dw_ ABSL_GUARDED_BY(device_mu_);
  std::vector<std::unique_ptr<DeviceBlock>> device_db_ ABSL_GUARDED_BY(device_mu_);
  bool no_device_ ABSL_GUARDED_BY(device_mu_) = false;  // the engine has none
  std::atomic<int64_t> device_backwards_{0};            // Backwards in the device sums
};

class WeightRegistry {
 public:
  // memory_budget_bytes bounds the host copies of every version alive and
  // the uploads in progress; device_budget_bytes the device copies and
  // gradient sums of every version alive (RegisteredWeight::DeviceWeight,
  // LeaseDeviceGrad). `host_available` tells the bytes the host can still
  // give (-1: unknown); null: /proc/meminfo.
  explicit WeightRegistry(int64_t memory_budget_bytes,
                          int64_t device_budget_bytes = int64_t{32} << 30,
                          std::function<int64_t()> host_available = nullptr);

  // True for a valid weight name: [A-Za-z0-9_.-], 1-128 characters.
  static bool ValidName(const std::string& name);

  // Takes `bytes` of the memory budget for an upload of `name` before its
  // bytes arrive. RESOURCE_EXHAUSTED with the numbers past the budget or
  // the host's available memory.
  absl::StatusOr<BudgetHold> Reserve(const std::string& name, int64_t bytes) const;

  // Memory for an upload of `bytes` to `name`: a spare of the name's
  // earlier versions when one is large enough (SpareWeights), else empty.
  // Call before Reserve: the spare's bytes leave the budget. Its page lock
  // (if any) goes to Put with it.
  SpareWeights::HostMemory TakeSpare(const std::string& name, const std::string& principal,
                                     int64_t bytes);

  // Validates the name (INVALID_ARGUMENT) and stores the weight as the
  // name's next version. Its bytes come from `hold` (from Reserve) when it
  // holds them, else from the budget now, after the version it replaces
  // has let go of its own where nothing else holds it. `locked`: the page
  // lock of `weight`'s memory (a spare's, from TakeSpare), or null.
  absl::StatusOr<std::shared_ptr<RegisteredWeight>> Put(
      const std::string& name, const std::string& principal, HostTensor weight,
      std::optional<HostTensor> bias, BudgetHold hold = BudgetHold(),
      std::shared_ptr<DeviceBlock> locked = nullptr);

  // `version` 0 is the latest.
  absl::StatusOr<std::shared_ptr<RegisteredWeight>> Get(const std::string& name, int64_t version,
                                                        const std::string& principal) const;

  bool Delete(const std::string& name, const std::string& principal);
  std::vector<std::shared_ptr<RegisteredWeight>> List(const std::string& principal) const;

  // Host bytes of every version alive and of the uploads in progress (the
  // spares not counted: they yield to anything that needs the room).
  int64_t bytes_in_use() const { return host_budget_->used() - spares_->bytes(); }
  int64_t memory_budget_bytes() const { return host_budget_->limit(); }
  // Device bytes the weights hold now.
  int64_t device_bytes_in_use() const { return device_budget_->used(); }
  // Registered names (their latest versions).
  int64_t size() const;

 private:
  absl::Status OverBudget(const std::string& name, int64_t bytes) const;

  const std::shared_ptr<ByteBudget> host_budget_;
  const std::shared_ptr<ByteBudget> device_budget_;
  const std::function<int64_t()> host_available_;
  const std::shared_ptr<SpareWeights> spares_ = std::make_shared<SpareWeights>();
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<RegisteredWeight>> latest_ ABSL_GUARDED_BY(mu_);
  // The last version of every name put (live or deleted, at most 2^16
  // deleted ones), and the highest version of the deleted names forgotten.
  absl::flat_hash_map<std::string, int64_t> last_version_ ABSL_GUARDED_BY(mu_);
  int64_t retired_floor_ ABSL_GUARDED_BY(mu_) = 0;
  void ForgetRetiredNames() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace flce

#endif  // FLCE_SERVER_WEIGHT_REGISTRY_H_
