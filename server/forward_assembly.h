#ifndef FLCE_SERVER_FORWARD_ASSEMBLY_H_
#define FLCE_SERVER_FORWARD_ASSEMBLY_H_

// A ForwardRequest put back together from a ForwardStream's messages: the
// first carries the request with its tensors' dtypes and shapes but no
// bytes, each later one a piece of one tensor's bytes. No gRPC here: the
// reactor (compute_handlers.cc) feeds it and reserves what it announces.

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/flce/v1/loss_service.pb.h"

namespace flce {

class ForwardAssembly {
 public:
  // `max_bytes`: the most the announced tensors may take together.
  explicit ForwardAssembly(int64_t max_bytes) : max_bytes_(max_bytes) {}

  // One message of the stream (its contents are moved from). For the first
  // it returns the bytes the announced tensors need (sized from their dtypes
  // and shapes; RESOURCE_EXHAUSTED past `max_bytes`), for the others 0.
  // INVALID_ARGUMENT naming the field for a first message without the
  // request, a later one with it, a piece of a tensor that was not announced
  // without data, or more bytes than a tensor holds.
  absl::StatusOr<int64_t> Take(v1::ForwardRequestChunk* message);

  // The client half-closed: OK iff a request came and every announced
  // tensor is whole (INVALID_ARGUMENT naming the first that is not).
  absl::Status End();

  bool started() const { return started_; }
  // The request, as far as it has arrived.
  const v1::ForwardRequest& request() const { return request_; }

 private:
  const int64_t max_bytes_;
  v1::ForwardRequest request_;
  bool started_ = false;
  absl::flat_hash_map<int, int64_t> expected_;  // field → bytes
};

}  // namespace flce

#endif  // FLCE_SERVER_FORWARD_ASSEMBLY_H_
