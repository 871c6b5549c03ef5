#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flce {

class SharedMemoryRegistry::Holds : public SliceResolver {
 public:
  Holds(const SharedMemoryRegistry* registry, std::string principal)
      : registry_(registry), principal_(std::move(principal)) {}

  absl::StatusOr<SliceMemory> Resolve(const v1::SharedMemorySlice& slice, int64_t bytes,
                                      const std::string& field) const override {
    std::shared_ptr<SharedRegion> region;
    {
      absl::MutexLock lock(&registry_->mu_);
      auto it = registry_->regions_.find(slice.region_id());
      if (it == registry_->regions_.end() || it->second.principal != principal_) {
        return absl::NotFoundError(
            absl::StrCat(field, ".shm: unknown region '", slice.region_id(), "'"));
      }
      region = it->second.region;
    }
    if (slice.offset() < 0 || bytes < 0 || slice.offset() > region->bytes() - bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shm: ", bytes, " bytes at offset ", slice.offset(),
          " do not lie inside the region's ", region->bytes(), " bytes"));
    }
    absl::MutexLock lock(&mu_);
    held_.push_back(region);
    return SliceMemory{region->base() + slice.offset(), region->space()};
  }

 private:
  const SharedMemoryRegistry* const registry_;
  const std::string principal_;
  mutable absl::Mutex mu_;
  mutable std::vector<std::shared_ptr<SharedRegion>> held_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::Register(const std::string& shm_name,
                                                                int64_t bytes,
                                                                const std::string& principal) {
  if (shm_name.size() < 2 || shm_name[0] != '/' || shm_name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_name: '", shm_name, "' must be a POSIX shm name: '/' then no other '/'"));
  }
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: ", bytes, "; expected > 0"));
  }
  const int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("shm_name: cannot open '", shm_name, "': ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < bytes) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("bytes: ", bytes, " but '", shm_name,
                                                   "' holds ", static_cast<int64_t>(st.st_size)));
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map '", shm_name, "': ", std::strerror(errno)));
  }
  return Add(std::make_shared<SharedRegion>(
                 base, bytes, MemorySpace::kHost,
                 [base, bytes] { munmap(base, static_cast<size_t>(bytes)); }),
             principal);
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::RegisterCudaIpc(
    const std::string& handle, int64_t bytes, LossEngine& engine, const std::string& principal) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle: expected ",
                                                   kCudaIpcHandleBytes,
                                                   " bytes (a cudaIpcMemHandle_t), got ",
                                                   handle.size()));
  }
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, "; expected >= 0 (0: the whole allocation)"));
  }
  absl::StatusOr<std::unique_ptr<ImportedMemory>> imported = engine.ImportCudaIpcMemory(handle);
  if (!imported.ok()) return imported.status();
  const int64_t size = (*imported)->bytes();
  if (bytes > size) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, " but the allocation holds ", size));
  }
  void* base = (*imported)->data();
  std::shared_ptr<ImportedMemory> mapping = std::move(*imported);
  return Add(std::make_shared<SharedRegion>(base, bytes == 0 ? size : bytes, MemorySpace::kCuda,
                                            [mapping]() mutable { mapping.reset(); }),
             principal);
}

absl::StatusOr<RegisteredRegion> SharedMemoryRegistry::Add(std::shared_ptr<SharedRegion> region,
                                                           const std::string& principal) {
  unsigned char id_bytes[16];
  if (getrandom(id_bytes, sizeof(id_bytes), 0) != sizeof(id_bytes)) {
    return absl::InternalError("getrandom failed");
  }
  RegisteredRegion out;
  for (unsigned char b : id_bytes) absl::StrAppendFormat(&out.region_id, "%02x", b);
  out.bytes = region->bytes();
  absl::MutexLock lock(&mu_);
  regions_[out.region_id] = Entry{std::move(region), principal};
  return out;
}

bool SharedMemoryRegistry::Unregister(const std::string& region_id,
                                      const std::string& principal) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end() || it->second.principal != principal) return false;
  regions_.erase(it);
  return true;
}

int64_t SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

std::shared_ptr<SliceResolver> SharedMemoryRegistry::ResolverFor(
    const std::string& principal) const {
  return std::make_shared<Holds>(this, principal);
}

}  // namespace flce
