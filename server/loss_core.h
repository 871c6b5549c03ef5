#ifndef FLCE_SERVER_LOSS_CORE_H_
#define FLCE_SERVER_LOSS_CORE_H_

// The service's policy below the transport: backward-mode resolution, the
// session memory budget, and the Forward → session → Backward life cycle.
// Handlers decode requests (request_validation.h), call this, and encode.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/loss_engine.h"
#include "server/request_validation.h"
#include "server/session_store.h"
#include "server/weight_registry.h"

namespace flce {

struct ForwardOutcome {
  ForwardResult result;
  std::string session_id;                   // empty without need_backward
  BackwardMode mode = BackwardMode::kAuto;  // resolved; kAuto without a session
};

// A computed Backward. Its session stays held until LossCore::Settle says
// whether the gradients reached the client.
struct BackwardOutcome {
  HostTensor grad_hidden;
  bool has_grad_hidden = true;  // false: GRADIENTS_WEIGHT, no dX to send
  // Absent when they were added into the registered weight's accumulator.
  std::optional<HostTensor> grad_weight, grad_bias;
  // Gradients written into the caller's shared memory instead (their
  // tensors above then keep dtype and shape but no bytes).
  bool grad_hidden_in_shm = false, grad_weight_in_shm = false, grad_bias_in_shm = false;

  // For Settle.
  std::optional<SessionLease> lease;
  bool keep_session = false;
  bool answered = false;
  // With accumulate_weight_grad: the record of the accumulation, kept on the
  // session if the answer is not delivered.
  std::optional<UndeliveredAccumulation> accumulated;
};

class LossCore {
 public:
  // The pointers must outlive this. `stage_ahead_bytes`: the budget of
  // StageAhead (0: no staging).
  LossCore(LossEngine* engine, SessionStore* sessions, WeightRegistry* weights,
           int64_t stage_ahead_bytes = 0);

  // X's device copy, started when its call arrived (StageAhead): held
  // within the staging budget until the call runs, freed with the call (or
  // its session) after that.
  class Staged {
   public:
    Staged(StagedCopy copy, std::shared_ptr<std::atomic<int64_t>> held, int64_t bytes)
        : copy_(std::move(copy)), held_(std::move(held)), bytes_(bytes) {}
    ~Staged() { Unhold(); }
    Staged(const Staged&) = delete;
    Staged& operator=(const Staged&) = delete;
    const StagedCopy& copy() const { return copy_; }
    // Out of the staging budget (once): the call runs now, and its session's
    // reservation counts X's device copy as it would count the engine's own.
    void Unhold() {
      if (!unheld_.exchange(true)) held_->fetch_sub(bytes_);
    }

   private:
    StagedCopy copy_;
    const std::shared_ptr<std::atomic<int64_t>> held_;
    const int64_t bytes_;
    std::atomic<bool> unheld_{false};
  };

  // Where the engine has one device (device_memory()) and the call's X
  // lies in page-locked host memory (a region of server memory), starts
  // X's copy onto the device now, when the call arrives, so that it runs
  // beside the engine's calls before this one instead of at the start of
  // its own; null where it does not (the engine uploads X in the call, as
  // before): no device, X elsewhere, a worker's ready event, the budget
  // spent by calls staged and not yet running, or the copy refused.
  std::shared_ptr<Staged> StageAhead(const ForwardCall& call);
  // Calls StageAhead staged so far.
  int64_t forwards_staged() const { return forwards_staged_.load(); }

  // AUTO resolves to RECOMPUTE for reduction none or when STORE_GRADS would
  // not fit the session budget but RECOMPUTE would; else STORE_GRADS.
  // Other modes stay as requested.
  BackwardMode ResolveMode(const LossProblem& problem, BackwardMode requested) const;

  // `started` (if any) runs once the session's place is reserved, just
  // before the engine runs: from then on only the engine can fail the call.
  // `staged`: StageAhead's copy of the call's X, read in its place.
  absl::StatusOr<ForwardOutcome> Forward(const ForwardCall& call, const std::string& principal,
                                         const CancelFn& cancelled,
                                         const std::function<void()>& started = nullptr,
                                         std::shared_ptr<Staged> staged = nullptr);

  // On failure the session stays as it was. On success it stays held by
  // the outcome until Settle. With accumulate_weight_grad, dW and db go into
  // the session's registered weight (FAILED_PRECONDITION without one).
  // RESOURCE_EXHAUSTED, before any compute, when the gradients returned as
  // bytes would exceed call.max_response_bytes (> 0).
  absl::StatusOr<BackwardOutcome> Backward(const BackwardCall& call, const std::string& principal,
                                           const CancelFn& cancelled);

  // A computed Backward's answer goes out: the session is consumed (unless
  // keep_session), pending its delivery, so that the client can go on the
  // moment it has the answer.
  void Answered(BackwardOutcome& outcome);

  // The answer's fate (after Answered, or instead of it when the call
  // failed later). Delivered: done. Not delivered: the session is as it
  // was, except that a dW added into the weight's accumulator is
  // remembered, so that only a retry of the call (which returns dX and adds
  // nothing) runs next (SessionStore's UndeliveredAccumulation).
  void Settle(BackwardOutcome& outcome, bool delivered);

  bool Release(const std::string& session_id, const std::string& principal);

  LossEngine& engine() const { return *engine_; }
  SessionStore& sessions() const { return *sessions_; }
  WeightRegistry& weights() const { return *weights_; }

 private:
  LossEngine* const engine_;
  SessionStore* const sessions_;
  WeightRegistry* const weights_;
  const int64_t stage_ahead_bytes_;
  // StageAhead's held (shared with the copies, which may outlive this).
  const std::shared_ptr<std::atomic<int64_t>> staged_bytes_ =
      std::make_shared<std::atomic<int64_t>>(0);
  std::atomic<int64_t> forwards_staged_{0};
};

}  // namespace flce

#endif  // FLCE_SERVER_LOSS_CORE_H_
