#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/host_memory.h"
#include "server/random_id.h"
#include "server/sigbus_guard.h"
#include "spdlog/spdlog.h"

namespace flce {
namespace {

// '/' then 1-255 characters of [A-Za-z0-9_.-] (NAME_MAX under /dev/shm).
bool ValidShmName(const std::string& name) {
  if (name.size() < 2 || name.size() > 256 || name[0] != '/') return false;
  for (size_t i = 1; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return name != "/." && name != "/..";
}

std::string UnknownRegion(const std::string& region_id) {
  return absl::StrCat("unknown region '", region_id.substr(0, 64), "'");
}

}  // namespace

SharedRegion::SharedRegion(void* base, int64_t bytes, MemorySpace space,
                           std::function<void()> release, int fd, int guard_slot)
    : base_(base),
      bytes_(bytes),
      space_(space),
      release_(std::move(release)),
      fd_(fd),
      guard_slot_(guard_slot) {}

SharedRegion::SharedRegion(const DeviceEvent* event, std::function<void()> release)
    : base_(nullptr),
      bytes_(0),
      space_(MemorySpace::kCuda),
      release_(std::move(release)),
      fd_(-1),
      guard_slot_(-1),
      event_(event) {}

SharedRegion::SharedRegion(ServerMemory, void* base, int64_t bytes, std::function<void()> release)
    : base_(base),
      bytes_(bytes),
      space_(MemorySpace::kHost),
      release_(std::move(release)),
      fd_(-1),
      guard_slot_(-1),
      server_memory_(true),
      marks_(std::make_unique<MarkBoard>()) {}

SharedRegion::~SharedRegion() {
  SigbusGuard::Unguard(guard_slot_);
  release_();
  if (fd_ >= 0) close(fd_);
}

bool SharedRegion::broken() const { return SigbusGuard::Broken(guard_slot_); }

absl::Status SharedRegion::CheckUsable(const std::string& field) const {
  if (broken()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field,
                     ".shm: the region's shared-memory object was shrunk by its owner under a "
                     "call; unregister it and register a new one"));
  }
  if (fd_ >= 0) {
    struct stat st;
    if (fstat(fd_, &st) != 0 || st.st_size < bytes_) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ".shm: the region's shared-memory object holds ", static_cast<int64_t>(st.st_size),
          " bytes now, ", bytes_, " when it was registered; unregister it and register a new one"));
    }
  }
  return absl::OkStatus();
}

class SharedMemoryRegistry::Holds : public SliceResolver {
 public:
  Holds(const SharedMemoryRegistry* registry, std::string principal)
      : registry_(registry), principal_(std::move(principal)) {}

  absl::StatusOr<SliceMemory> Resolve(const SliceRef& slice, int64_t bytes,
                                      const std::string& field) const override {
    std::shared_ptr<SharedRegion> region = registry_->Lookup(slice.region_id, principal_);
    if (region == nullptr) {
      return absl::NotFoundError(absl::StrCat(field, ".shm: ", UnknownRegion(slice.region_id)));
    }
    if (region->event() != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shm: region '", slice.region_id.substr(0, 64),
                       "' is an event (cuda_ipc_event_handle), not memory"));
    }
    if (slice.offset < 0 || bytes < 0 || slice.offset > region->bytes() - bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shm: ", bytes, " bytes at offset ", slice.offset,
                       " do not lie inside the region's ", region->bytes(), " bytes"));
    }
    absl::Status usable = region->CheckUsable(field);
    if (!usable.ok()) return usable;
    absl::MutexLock lock(&mu_);
    held_.push_back(region);
    return SliceMemory{region->base() + slice.offset, region->space()};
  }

  absl::StatusOr<const DeviceEvent*> ResolveEvent(const std::string& region_id,
                                                  const std::string& field) const override {
    std::shared_ptr<SharedRegion> region = registry_->Lookup(region_id, principal_);
    if (region == nullptr) {
      return absl::NotFoundError(absl::StrCat(field, ": ", UnknownRegion(region_id)));
    }
    if (region->event() == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": region '", region_id.substr(0, 64),
                       "' is memory, not an event; register one with cuda_ipc_event_handle"));
    }
    absl::MutexLock lock(&mu_);
    held_.push_back(region);
    return region->event();
  }

  absl::Status CheckIntact() const override {
    absl::MutexLock lock(&mu_);
    for (const auto& region : held_) {
      if (region->broken()) {
        return absl::FailedPreconditionError(
            "shm: a shared-memory object this call used was shrunk by its owner during the "
            "call; its results are void (nothing was kept)");
      }
    }
    return absl::OkStatus();
  }

 private:
  const SharedMemoryRegistry* const registry_;
  const std::string principal_;
  mutable absl::Mutex mu_;
  mutable std::vector<std::shared_ptr<SharedRegion>> held_ ABSL_GUARDED_BY(mu_);
};

SharedMemoryRegistry::SharedMemoryRegistry(SharedMemoryLimits limits) : limits_(limits) {}

SharedMemoryRegistry::~SharedMemoryRegistry() {
  // Unmapped while the bounds they leave still exist.
  absl::flat_hash_map<std::string, Entry> regions;
  {
    absl::MutexLock lock(&mu_);
    regions.swap(regions_);
  }
  regions.clear();
}

absl::Status SharedMemoryRegistry::Admit(const std::string& principal, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (count_ >= limits_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat("shared memory: ", count_,
                                                     " regions are registered, the server's limit "
                                                     "(--max_shared_memory_regions) is ",
                                                     limits_.max_regions,
                                                     "; unregister some first"));
  }
  if (bytes > limits_.max_bytes - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory: this region maps ", bytes, " bytes; registered regions map ", bytes_,
        " of the server's limit of ", limits_.max_bytes, " (--shared_memory_bytes)"));
  }
  Usage& usage = usage_[principal];
  if (limits_.max_regions_per_principal > 0 && usage.regions >= limits_.max_regions_per_principal) {
    if (usage.regions == 0) usage_.erase(principal);
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory: this principal has ", usage.regions,
        " regions registered, the limit (--max_shared_memory_regions_per_principal) is ",
        limits_.max_regions_per_principal));
  }
  if (limits_.max_bytes_per_principal > 0 &&
      bytes > limits_.max_bytes_per_principal - usage.bytes) {
    if (usage.regions == 0) usage_.erase(principal);
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory: this region maps ", bytes,
                     " bytes; this principal's regions map ", usage.bytes, " of its limit of ",
                     limits_.max_bytes_per_principal, " (--shared_memory_bytes_per_principal)"));
  }
  ++count_;
  bytes_ += bytes;
  ++usage.regions;
  usage.bytes += bytes;
  return absl::OkStatus();
}

void SharedMemoryRegistry::Unadmit(const std::string& principal, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  --count_;
  bytes_ -= bytes;
  auto it = usage_.find(principal);
  if (it == usage_.end()) return;
  it->second.regions -= 1;
  it->second.bytes -= bytes;
  if (it->second.regions == 0) usage_.erase(it);
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::Register(const std::string& shm_name,
                                                                int64_t bytes,
                                                                const std::string& principal) {
  if (!ValidShmName(shm_name)) {
    return absl::InvalidArgumentError(
        "shm_name: must be a POSIX shm name: '/' then 1-255 characters of [A-Za-z0-9_.-]");
  }
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: ", bytes, "; expected > 0"));
  }
  if (absl::Status admitted = Admit(principal, bytes); !admitted.ok()) return admitted;
  auto fail = [&](absl::Status status) {
    Unadmit(principal, bytes);
    return status;
  };
  const int fd = shm_open(shm_name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    return fail(absl::NotFoundError(
        absl::StrCat("shm_name: cannot open '", shm_name, "': ", std::strerror(errno))));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < bytes) {
    close(fd);
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "bytes: ", bytes, " but '", shm_name, "' holds ", static_cast<int64_t>(st.st_size))));
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("cannot map '", shm_name, "': ", std::strerror(error))));
  }
  const int slot = SigbusGuard::Guard(base, static_cast<size_t>(bytes));
  if (slot < 0) {
    munmap(base, static_cast<size_t>(bytes));
    close(fd);
    return fail(absl::ResourceExhaustedError(absl::StrCat("shared memory: ", SigbusGuard::kCapacity,
                                                          " POSIX regions are mapped already")));
  }
  // The region's place in the bounds is given back when it is unmapped.
  return Add(std::make_shared<SharedRegion>(
                 base, bytes, MemorySpace::kHost,
                 [this, principal, base, bytes] {
                   munmap(base, static_cast<size_t>(bytes));
                   Unadmit(principal, bytes);
                 },
                 fd, slot),
             principal);
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::RegisterServerMemory(
    int64_t bytes, const std::string& principal, DeviceMemory* device) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: ", bytes, "; expected > 0"));
  }
  FLCE_RETURN_IF_ERROR(Admit(principal, bytes));
  if (absl::Status budget = AdmitServerBytes(principal, bytes); !budget.ok()) {
    Unadmit(principal, bytes);
    return budget;
  }
  auto fail = [&](absl::Status status) {
    UnadmitServerBytes(principal, bytes);
    Unadmit(principal, bytes);
    return status;
  };
  if (absl::Status host = CheckHostMemory(bytes, HostAvailableBytes(), "server_memory");
      !host.ok()) {
    return fail(host);
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("server_memory: cannot allocate ", bytes, " bytes: ", std::strerror(errno))));
  }
  madvise(base, static_cast<size_t>(bytes), MADV_HUGEPAGE);  // fewer faults when first written
  std::shared_ptr<DeviceBlock> pinned;
  if (device != nullptr) {
    absl::StatusOr<std::unique_ptr<DeviceBlock>> pin = device->PinHostMemory(base, bytes);
    if (pin.ok()) {
      pinned = *std::move(pin);
    } else {
      SPDLOG_WARN("server_memory: a region of {} bytes serves unlocked: {}", bytes,
                  pin.status().ToString());
    }
  }
  return Add(std::make_shared<SharedRegion>(SharedRegion::ServerMemory{}, base, bytes,
                                            [this, principal, base, bytes, pinned]() mutable {
                                              pinned.reset();  // unlocked before unmapped
                                              munmap(base, static_cast<size_t>(bytes));
                                              UnadmitServerBytes(principal, bytes);
                                              Unadmit(principal, bytes);
                                            }),
             principal, /*with_ticket=*/true);
}

absl::Status SharedMemoryRegistry::AdmitServerBytes(const std::string& principal, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes > limits_.max_server_bytes - server_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server_memory: this region takes ", bytes, " bytes; regions of server memory hold ",
        server_bytes_, " of the server's limit of ", limits_.max_server_bytes,
        " (--region_memory_bytes)"));
  }
  Usage& usage = usage_[principal];  // there: Admit counted the region
  if (limits_.max_server_bytes_per_principal > 0 &&
      bytes > limits_.max_server_bytes_per_principal - usage.server_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server_memory: this region takes ", bytes, " bytes; this principal's hold ",
        usage.server_bytes, " of its limit of ", limits_.max_server_bytes_per_principal,
        " (--region_memory_bytes_per_principal)"));
  }
  server_bytes_ += bytes;
  usage.server_bytes += bytes;
  return absl::OkStatus();
}

void SharedMemoryRegistry::UnadmitServerBytes(const std::string& principal, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  server_bytes_ -= bytes;
  auto it = usage_.find(principal);
  if (it != usage_.end()) it->second.server_bytes -= bytes;
}

int64_t SharedMemoryRegistry::server_bytes() const {
  absl::MutexLock lock(&mu_);
  return server_bytes_;
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::RegisterCudaIpc(
    const std::string& handle, int64_t bytes, DeviceMemory* memory, const std::string& principal) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc_handle: expected ", kCudaIpcHandleBytes,
                     " bytes (a cudaIpcMemHandle_t), got ", handle.size()));
  }
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, "; expected >= 0 (0: the whole allocation)"));
  }
  // The count is checked before the engine maps anything (the bytes are
  // known only after).
  if (absl::Status admitted = Admit(principal, 0); !admitted.ok()) return admitted;
  Unadmit(principal, 0);
  if (memory == nullptr) {
    return absl::FailedPreconditionError(
        "cuda_ipc_handle: this server's engine offers no GPU memory (the cpu backend, or "
        "several --cuda_devices); CUDA IPC needs --backend=cuda on one device");
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> imported = memory->ImportCudaIpc(handle);
  if (!imported.ok()) return imported.status();
  const int64_t size = (*imported)->bytes();
  if (bytes > size) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, " but the allocation holds ", size));
  }
  const int64_t mapped = bytes == 0 ? size : bytes;
  if (absl::Status admitted = Admit(principal, mapped); !admitted.ok()) return admitted;
  void* base = (*imported)->data();
  std::shared_ptr<DeviceBlock> mapping = std::move(*imported);
  return Add(std::make_shared<SharedRegion>(base, mapped, MemorySpace::kCuda,
                                            [this, principal, mapped, mapping]() mutable {
                                              mapping.reset();
                                              Unadmit(principal, mapped);
                                            }),
             principal);
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::RegisterCudaIpcEvent(
    const std::string& handle, int64_t bytes, DeviceMemory* memory, const std::string& principal) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc_event_handle: expected ", kCudaIpcHandleBytes,
                     " bytes (a cudaIpcEventHandle_t), got ", handle.size()));
  }
  if (bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, "; an event region has none (expected 0)"));
  }
  if (memory == nullptr) {
    return absl::FailedPreconditionError(
        "cuda_ipc_event_handle: this server's engine offers no GPU memory (the cpu backend, "
        "or several --cuda_devices); CUDA IPC needs --backend=cuda on one device");
  }
  // Counted among the regions like any other.
  if (absl::Status admitted = Admit(principal, 0); !admitted.ok()) return admitted;
  absl::StatusOr<std::unique_ptr<DeviceEvent>> imported = memory->ImportCudaIpcEvent(handle);
  if (!imported.ok()) {
    Unadmit(principal, 0);
    return imported.status();
  }
  const DeviceEvent* event = imported->get();
  std::shared_ptr<DeviceEvent> owned = std::move(*imported);
  return Add(std::make_shared<SharedRegion>(event,
                                            [this, principal, owned]() mutable {
                                              owned.reset();
                                              Unadmit(principal, 0);
                                            }),
             principal);
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::Add(std::shared_ptr<SharedRegion> region,
                                                           const std::string& principal,
                                                           bool with_ticket) {
  RegisteredRegion out;
  out.region_id = RandomId();
  out.bytes = region->bytes();
  if (with_ticket) out.ticket = RandomId();
  absl::MutexLock lock(&mu_);
  regions_[out.region_id] = Entry{std::move(region), principal, out.ticket};
  return out;
}

bool SharedMemoryRegistry::Unregister(const std::string& region_id, const std::string& principal) {
  // Unmapped after the lock, once no call holds it; it leaves the bounds then.
  std::shared_ptr<SharedRegion> region;
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end() || it->second.principal != principal) return false;
  region = std::move(it->second.region);
  regions_.erase(it);
  return true;
}

int64_t SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

int64_t SharedMemoryRegistry::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

std::shared_ptr<SharedRegion> SharedMemoryRegistry::Lookup(const std::string& region_id,
                                                           const std::string& principal) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end() || it->second.principal != principal) return nullptr;
  it->second.region->Touch();
  return it->second.region;
}

int SharedMemoryRegistry::ReapIdle() {
  const absl::Time oldest = absl::Now() - limits_.server_region_ttl;
  std::vector<std::shared_ptr<SharedRegion>> idle;  // unmapped after the lock
  absl::MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    auto next = std::next(it);
    if (it->second.region->server_memory() && it->second.region->last_used() < oldest) {
      idle.push_back(std::move(it->second.region));
      regions_.erase(it);
    }
    it = next;
  }
  return static_cast<int>(idle.size());
}

absl::StatusOr<std::shared_ptr<SharedRegion>> SharedMemoryRegistry::Find(
    const std::string& region_id, const std::string& principal) const {
  std::shared_ptr<SharedRegion> region = Lookup(region_id, principal);
  if (region == nullptr) return absl::NotFoundError(UnknownRegion(region_id));
  return region;
}

absl::StatusOr<TicketedRegion> SharedMemoryRegistry::FindByTicket(
    const std::string& region_id, const std::string& ticket) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_id);
  const std::string& expected = it == regions_.end() ? std::string() : it->second.ticket;
  // Every byte compared, so the time tells nothing of how close a guess was.
  unsigned char differ = expected.empty() || expected.size() != ticket.size();
  for (size_t i = 0; i < ticket.size() && i < expected.size(); ++i) {
    differ |= static_cast<unsigned char>(expected[i] ^ ticket[i]);
  }
  if (differ != 0) {
    return absl::NotFoundError(absl::StrCat(UnknownRegion(region_id), " or a wrong ticket"));
  }
  it->second.region->Touch();
  return TicketedRegion{it->second.region, it->second.principal};
}

std::shared_ptr<SliceResolver> SharedMemoryRegistry::ResolverFor(
    const std::string& principal) const {
  return std::make_shared<Holds>(this, principal);
}

}  // namespace flce
