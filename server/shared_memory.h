#ifndef FLCE_SERVER_SHARED_MEMORY_H_
#define FLCE_SERVER_SHARED_MEMORY_H_

// Shared-memory regions registered by same-host clients, so tensors travel
// as (region, offset) instead of bytes on the wire: POSIX shm objects mapped
// read-write, and GPU allocations mapped through CUDA IPC (by the engine,
// which must be able to read device memory); and the clients' CUDA IPC
// events, which order the server's device work after theirs. A region belongs to the
// principal that registered it; others see NOT_FOUND. Unregistering unmaps
// once no call holds the region any more.
//
// Registrations are bounded (SharedMemoryLimits: count and mapped bytes, in
// total and per principal), checked before anything is mapped. A client may
// shrink its POSIX object at any time: each use checks the object's current
// size, and a shrink during a call cannot crash the server (SigbusGuard) —
// the call fails with FAILED_PRECONDITION instead (CheckIntact).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/device_memory.h"
#include "kernels/loss_engine.h"
#include "proto/codec.h"
#include "server/region_marks.h"

namespace flce {

struct SharedMemoryLimits {
  // Registered regions (--max_shared_memory_regions; at most 4096) and
  // one principal's (0: no per-principal bound).
  int64_t max_regions = 1024;
  int64_t max_regions_per_principal = 0;
  // Their mapped bytes together (--shared_memory_bytes), and one
  // principal's (0: no per-principal bound).
  int64_t max_bytes = int64_t{1} << 40;
  int64_t max_bytes_per_principal = 0;
  // Regions of the server's own memory (server_memory), which cost it
  // that memory: their bytes together (--region_memory_bytes; 0: none
  // allowed) and one principal's (0: no per-principal bound). They count
  // among the regions above too.
  int64_t max_server_bytes = int64_t{16} << 30;
  int64_t max_server_bytes_per_principal = 0;
  // A region of server memory no call has named for this long is
  // unregistered (--region_idle_timeout): a client that died leaves none.
  absl::Duration server_region_ttl = absl::Minutes(10);
};

class SharedRegion {
 public:
  // `release` unmaps the memory; it runs when the region is destroyed.
  // `fd` (POSIX regions; -1 otherwise) is the object, kept open to check
  // its size at each use; `guard_slot` its SigbusGuard slot (-1: none).
  SharedRegion(void* base, int64_t bytes, MemorySpace space, std::function<void()> release,
               int fd = -1, int guard_slot = -1);
  // A registered event instead of memory (no bytes); `release` closes it.
  SharedRegion(const DeviceEvent* event, std::function<void()> release);
  // Memory of the server's own (`server_memory`); `release` frees it.
  struct ServerMemory {};
  SharedRegion(ServerMemory, void* base, int64_t bytes, std::function<void()> release);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* base() const { return static_cast<char*>(base_); }
  int64_t bytes() const { return bytes_; }
  MemorySpace space() const { return space_; }
  // FAILED_PRECONDITION (naming `field`) when the object is smaller now
  // than when it was registered, or a fault already hit it.
  absl::Status CheckUsable(const std::string& field) const;
  // True once a fault hit the region (its owner shrank it under a call).
  bool broken() const;
  // The event of an event region; null for memory.
  const DeviceEvent* event() const { return event_; }
  // A client's POSIX object (shm_name).
  bool posix() const { return fd_ >= 0; }
  // The server's own memory (server_memory), which WriteRegion and
  // ReadRegion reach.
  bool server_memory() const { return server_memory_; }
  // A region of server memory's marks (server/region_marks.h): posted by
  // the calls that write into it, awaited by the bulk port's reads. Null
  // for other regions.
  MarkBoard* marks() const { return marks_.get(); }
  // When a call last named it.
  void Touch() { last_used_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed); }
  absl::Time last_used() const {
    return absl::FromUnixNanos(last_used_ns_.load(std::memory_order_relaxed));
  }

 private:
  void* const base_;
  const int64_t bytes_;
  const MemorySpace space_;
  const std::function<void()> release_;
  const int fd_;
  const int guard_slot_;
  const DeviceEvent* const event_ = nullptr;
  const bool server_memory_ = false;
  const std::unique_ptr<MarkBoard> marks_;
  std::atomic<int64_t> last_used_ns_{absl::GetCurrentTimeNanos()};
};

struct RegisteredRegion {
  std::string region_id;
  int64_t bytes = 0;
  // A region of server memory's: the secret that lets its bytes move over
  // the bulk HTTP port (server/bulk_http.h) without the principal's
  // credentials, like a presigned URL; empty for other regions.
  std::string ticket;
};

// A region of server memory named by its ticket, and whose it is.
struct TicketedRegion {
  std::shared_ptr<SharedRegion> region;
  std::string principal;
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryLimits limits = SharedMemoryLimits());
  // Unmaps every region. REQUIRES: no resolver of it is alive.
  ~SharedMemoryRegistry();

  // Maps `bytes` of the POSIX shm object `shm_name` for `principal`.
  // INVALID_ARGUMENT for a malformed name or a size the object does not
  // have, NOT_FOUND if it cannot be opened, RESOURCE_EXHAUSTED past a bound.
  absl::StatusOr<RegisteredRegion> Register(const std::string& shm_name, int64_t bytes,
                                            const std::string& principal);

  // Maps the GPU allocation a CUDA IPC handle names through `memory` (the
  // engine's device memory): the first `bytes` of it, or all of it for 0.
  // INVALID_ARGUMENT for a handle of the wrong size or `bytes` beyond the
  // allocation; FAILED_PRECONDITION without device memory (a null
  // `memory`: the CPU engine); its error when it cannot map it;
  // RESOURCE_EXHAUSTED past a bound.
  absl::StatusOr<RegisteredRegion> RegisterCudaIpc(const std::string& handle, int64_t bytes,
                                                   DeviceMemory* memory,
                                                   const std::string& principal);

  // Opens the event a cudaIpcEventHandle_t names through `memory`, as a
  // region (no bytes) that requests name as their ready_event. Errors as
  // RegisterCudaIpc's; `bytes` must be 0.
  absl::StatusOr<RegisteredRegion> RegisterCudaIpcEvent(const std::string& handle, int64_t bytes,
                                                        DeviceMemory* memory,
                                                        const std::string& principal);

  // `bytes` of zeroed memory of the server's own for `principal`, filled and
  // read over gRPC (WriteRegion, ReadRegion). INVALID_ARGUMENT for bytes
  // <= 0; RESOURCE_EXHAUSTED past a bound (the region count, the mapped
  // bytes, --region_memory_bytes and its per-principal form) or past what
  // the host has available. With `device` (an engine's), the region is
  // page-locked for it, so that the engine's copies of the tensors and
  // gradients it holds run at the bus's rate; where that fails it serves
  // unlocked.
  absl::StatusOr<RegisteredRegion> RegisterServerMemory(int64_t bytes,
                                                        const std::string& principal,
                                                        DeviceMemory* device = nullptr);

  bool Unregister(const std::string& region_id, const std::string& principal);

  // Unregisters the regions of server memory no call named for
  // limits().server_region_ttl; how many.
  int ReapIdle();

  const SharedMemoryLimits& limits() const { return limits_; }
  int64_t size() const;   // registered regions
  int64_t bytes() const;  // their mapped bytes
  int64_t server_bytes() const;  // of them, the server's own memory

  // A resolver for `principal`'s regions that keeps every region it resolved
  // mapped for as long as it lives (so a call in flight never loses one).
  std::shared_ptr<SliceResolver> ResolverFor(const std::string& principal) const;

  // `principal`'s region `region_id` (mapped for as long as the pointer
  // lives), or NOT_FOUND ("unknown region ...").
  absl::StatusOr<std::shared_ptr<SharedRegion>> Find(const std::string& region_id,
                                                     const std::string& principal) const;

  // The region of server memory `region_id` whose ticket is `ticket`
  // (compared in constant time), as a call naming it: it counts as used
  // now. NOT_FOUND alike for an unknown region and a wrong ticket.
  absl::StatusOr<TicketedRegion> FindByTicket(const std::string& region_id,
                                              const std::string& ticket) const;

 private:
  // Null when unknown or another principal's.
  std::shared_ptr<SharedRegion> Lookup(const std::string& region_id,
                                       const std::string& principal) const;
  class Holds;
  struct Entry {
    std::shared_ptr<SharedRegion> region;
    std::string principal;
    std::string ticket;  // regions of server memory only
  };
  struct Usage {
    int64_t regions = 0, bytes = 0, server_bytes = 0;
  };
  // Takes a region's place in the bounds before it is mapped.
  absl::Status Admit(const std::string& principal, int64_t bytes);
  void Unadmit(const std::string& principal, int64_t bytes);
  // The server-memory budget (after Admit counted the region).
  absl::Status AdmitServerBytes(const std::string& principal, int64_t bytes);
  void UnadmitServerBytes(const std::string& principal, int64_t bytes);
  absl::StatusOr<RegisteredRegion> Add(std::shared_ptr<SharedRegion> region,
                                       const std::string& principal, bool with_ticket = false);

  const SharedMemoryLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;  // registered and being registered
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t server_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flce

#endif  // FLCE_SERVER_SHARED_MEMORY_H_
