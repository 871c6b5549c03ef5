#ifndef FLCE_SERVER_REQUEST_VALIDATION_H_
#define FLCE_SERVER_REQUEST_VALIDATION_H_

// Decoding and validation of requests, once, before any compute. Every
// rejection names the field and the values (DESIGN.md §1):
//   INVALID_ARGUMENT  shapes, dtypes, byte lengths, option values
//   OUT_OF_RANGE      a target outside [0, V) that is not ignore_index

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/loss_engine.h"
#include "proto/codec.h"
#include "proto/flce/v1/loss_service.pb.h"
#include "server/session_store.h"
#include "server/weight_registry.h"

namespace flce {

// A checked Forward request. Views point into the request, which must
// outlive this.
struct ForwardCall {
  LossProblem problem;
  // The registered weight the problem's weight (and bias) views point into,
  // when the request named one.
  std::shared_ptr<RegisteredWeight> weight_ref;
  // Keeps the shared-memory regions the views point into mapped.
  std::shared_ptr<SliceResolver> shm;
  // Private copies of what was validated by value (targets, class weights)
  // when it came from shared memory, so the client cannot change it after
  // the check; the problem's views point here then.
  std::vector<std::shared_ptr<const HostTensor>> copies;
  bool need_backward = false;
  BackwardMode requested_mode = BackwardMode::kAuto;
  bool want_lse = false;
  bool want_per_row_loss = false;
  // Where the loss goes too (ForwardRequest.loss_out), checked to hold it.
  std::optional<SliceMemory> loss_out;
};

// Registered weights are looked up in `weights` for `principal`; tensors in
// shared memory through `shm` (null: shared memory disabled).
absl::StatusOr<ForwardCall> DecodeForward(const v1::ForwardRequest& request,
                                          const WeightRegistry& weights,
                                          const std::string& principal,
                                          std::shared_ptr<SliceResolver> shm = nullptr);

// A checked Backward request; grad_output converted to fp32.
struct BackwardCall {
  std::string session_id;
  std::optional<HostTensor> grad_output;
  // BackwardRequest.global_lse (a shard's session), fp32.
  std::optional<HostTensor> global_lse;
  bool keep_session = false;
  std::optional<DType> grad_dtype;
  bool accumulate_weight_grad = false;
  // BackwardRequest.gradients: dX only (hidden_only), dW and db only
  // (weight_only), or all (neither).
  bool hidden_only = false;
  bool weight_only = false;
  // Shared-memory destinations of the gradients, if asked for.
  std::optional<SliceRef> grad_hidden_out, grad_weight_out, grad_bias_out;
  std::shared_ptr<SliceResolver> shm;
  // The caller's ready_event (kept alive by `shm`), or null.
  const DeviceEvent* ready = nullptr;
  // Largest response the gradients may make (a unary Backward); 0: no
  // bound (streamed).
  int64_t max_response_bytes = 0;
  // BackwardSpec::grad_hidden_landed, for dX written into a region.
  std::function<void(int64_t bytes)> grad_hidden_landed;
};

absl::StatusOr<BackwardCall> DecodeBackward(const v1::BackwardRequest& request,
                                            std::shared_ptr<SliceResolver> shm = nullptr);

// Checks grad_output's shape against the session: {} or {1} for mean/sum,
// {N} for none; and global_lse: [N] for a shard's session, absent otherwise.
absl::Status CheckGradOutput(const BackwardCall& call, const SessionInfo& info);

}  // namespace flce

#endif  // FLCE_SERVER_REQUEST_VALIDATION_H_
