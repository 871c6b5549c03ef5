#ifndef FLCE_SERVER_SHARED_MEMORY_H_
#define FLCE_SERVER_SHARED_MEMORY_H_

// Shared-memory regions registered by same-host clients: POSIX shm objects
// mapped read-write, so tensors travel as (region, offset) instead of bytes
// on the wire. A region belongs to the principal that registered it; others
// see NOT_FOUND. Unregistering unmaps once no call holds the region any more.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/codec.h"

namespace flce {

class SharedRegion {
 public:
  SharedRegion(void* base, int64_t bytes) : base_(base), bytes_(bytes) {}
  ~SharedRegion();  // munmap
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* base() const { return static_cast<char*>(base_); }
  int64_t bytes() const { return bytes_; }

 private:
  void* const base_;
  const int64_t bytes_;
};

class SharedMemoryRegistry {
 public:
  // Maps `bytes` of the POSIX shm object `shm_name` for `principal`.
  // NOT_FOUND if it cannot be opened, INVALID_ARGUMENT if it is smaller.
  absl::StatusOr<std::string> Register(const std::string& shm_name, int64_t bytes,
                                       const std::string& principal);
  bool Unregister(const std::string& region_id, const std::string& principal);

  // A resolver for `principal`'s regions that keeps every region it resolved
  // mapped for as long as it lives (so a call in flight never loses one).
  std::shared_ptr<SliceResolver> ResolverFor(const std::string& principal) const;

 private:
  class Holds;
  struct Entry {
    std::shared_ptr<SharedRegion> region;
    std::string principal;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flce

#endif  // FLCE_SERVER_SHARED_MEMORY_H_
