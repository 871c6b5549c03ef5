#ifndef FLCE_CLIENT_BULK_TRANSFER_H_
#define FLCE_CLIENT_BULK_TRANSFER_H_

// Byte ranges to and from a region of the server's memory over several
// connections at once: how LossClient moves a large weight or gradient;
// the calls that use the region (PutWeight, TakeWeightGrad) name a slice of
// it instead of carrying the bytes. Over the server's bulk HTTP port
// (client/bulk_http_client.h) where it offers one and can be reached, one
// range per connection; else as WriteRegion / ReadRegion streams, one per
// connection, in CRC-32-checked parts (about 1 GB/s a connection).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/bulk_http_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/flce/v1/loss_service.grpc.pb.h"

namespace flce {

class BulkTransfer {
 public:
  // `connections`: channels of their own TCP connections; `control` for
  // registering the region; every call has `timeout` and sends `token` (if
  // any). Parts are `part_bytes`. `http`: where the bulk port is (its port
  // comes with the region; an empty host: never over HTTP).
  BulkTransfer(std::vector<std::shared_ptr<grpc::Channel>> connections,
               v1::LossService::Stub* control, absl::Duration timeout, std::string token,
               int64_t part_bytes, BulkHttpEndpoint http = {});
  ~BulkTransfer();  // unregisters the region
  BulkTransfer(const BulkTransfer&) = delete;
  BulkTransfer& operator=(const BulkTransfer&) = delete;

  // The id of this transfer's region of server memory, at least `bytes`
  // long (made once, grown as needed); the server's error where it offers
  // none.
  absl::StatusOr<std::string> Region(int64_t bytes);

  // Writes `bytes` from `data` at `offset` of `region`, one range per
  // connection, concurrently.
  absl::Status Write(const std::string& region, int64_t offset, const char* data, int64_t bytes);
  // Reads `bytes` at `offset` of `region` into `out`, checking each part.
  absl::Status Read(const std::string& region, int64_t offset, char* out, int64_t bytes);

  int connections() const { return static_cast<int>(stubs_.size()); }
  // Whether transfers go over the bulk port now.
  bool over_http() const;

 private:
  void Prepare(grpc::ClientContext& context) const;
  void UnregisterLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // [begin, end) of connection i's range of `bytes`, in whole parts.
  std::pair<int64_t, int64_t> Range(int i, int64_t bytes, int64_t unit) const;
  // f(connection, begin, end) for every connection's range, each on a
  // thread of its own; the first error.
  absl::Status ForEachRange(int64_t bytes, int64_t unit,
                            const std::function<absl::Status(int, int64_t, int64_t)>& f);
  // f(port, ticket, begin, end) over the bulk port for every range; false
  // (and gRPC for a minute) where the port cannot be reached.
  absl::StatusOr<bool> OverHttp(
      const std::string& region, int64_t bytes,
      const std::function<absl::Status(BulkHttpClient&, const std::string&, int64_t, int64_t)>&
          f);

  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::LossService::Stub>> stubs_;
  v1::LossService::Stub* const control_;
  const absl::Duration timeout_;
  const std::string token_;
  const int64_t part_bytes_;
  mutable absl::Mutex mu_;
  std::string region_ ABSL_GUARDED_BY(mu_);
  int64_t region_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  BulkHttpEndpoint http_where_;
  // The bulk port of the region (null: none), and its ticket.
  std::shared_ptr<BulkHttpClient> http_ ABSL_GUARDED_BY(mu_);
  std::string ticket_ ABSL_GUARDED_BY(mu_);
  std::string pinned_region_ ABSL_GUARDED_BY(mu_);  // the region the port was pinned for
  absl::Time http_off_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace flce

#endif  // FLCE_CLIENT_BULK_TRANSFER_H_
