#ifndef FLCE_SERVER_SHARED_MEMORY_H_
#define FLCE_SERVER_SHARED_MEMORY_H_

// Shared-memory regions registered by same-host clients, so tensors travel
// as (region, offset) instead of bytes on the wire: POSIX shm objects mapped
// read-write, and GPU allocations mapped through CUDA IPC (by the engine,
// which must be able to read device memory). A region belongs to the
// principal that registered it; others see NOT_FOUND. Unregistering unmaps
// once no call holds the region any more.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/loss_engine.h"
#include "proto/codec.h"

namespace flce {

class SharedRegion {
 public:
  // `release` unmaps the memory; it runs when the region is destroyed.
  SharedRegion(void* base, int64_t bytes, MemorySpace space, std::function<void()> release)
      : base_(base), bytes_(bytes), space_(space), release_(std::move(release)) {}
  ~SharedRegion() { release_(); }
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* base() const { return static_cast<char*>(base_); }
  int64_t bytes() const { return bytes_; }
  MemorySpace space() const { return space_; }

 private:
  void* const base_;
  const int64_t bytes_;
  const MemorySpace space_;
  const std::function<void()> release_;
};

struct RegisteredRegion {
  std::string region_id;
  int64_t bytes = 0;
};

class SharedMemoryRegistry {
 public:
  // Maps `bytes` of the POSIX shm object `shm_name` for `principal`.
  // NOT_FOUND if it cannot be opened, INVALID_ARGUMENT if it is smaller.
  absl::StatusOr<RegisteredRegion> Register(const std::string& shm_name, int64_t bytes,
                                            const std::string& principal);

  // Maps the GPU allocation a CUDA IPC handle names through `engine`: the
  // first `bytes` of it, or all of it for 0. INVALID_ARGUMENT for a handle
  // of the wrong size or `bytes` beyond the allocation; the engine's error
  // when it cannot map it (FAILED_PRECONDITION for engines without a GPU).
  absl::StatusOr<RegisteredRegion> RegisterCudaIpc(const std::string& handle, int64_t bytes,
                                                   LossEngine& engine,
                                                   const std::string& principal);

  bool Unregister(const std::string& region_id, const std::string& principal);

  int64_t size() const;  // registered regions

  // A resolver for `principal`'s regions that keeps every region it resolved
  // mapped for as long as it lives (so a call in flight never loses one).
  std::shared_ptr<SliceResolver> ResolverFor(const std::string& principal) const;

 private:
  class Holds;
  struct Entry {
    std::shared_ptr<SharedRegion> region;
    std::string principal;
  };
  absl::StatusOr<RegisteredRegion> Add(std::shared_ptr<SharedRegion> region,
                                       const std::string& principal);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flce

#endif  // FLCE_SERVER_SHARED_MEMORY_H_
