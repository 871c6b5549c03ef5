#ifndef FLCE_SERVER_LOSS_SERVICE_H_
#define FLCE_SERVER_LOSS_SERVICE_H_

// flce.v1.LossService on gRPC's callback API. Handlers translate only:
// decode and validate the request on the gRPC thread, queue the engine work
// on the WorkQueue, encode the result and finish the reactor from the worker.
// Deadlines and cancellation are checked when a task starts and between
// chunks; one log line is written per RPC when it is over (rpc_call.h).
// A result is committed only once it reached the client: a Backward's
// session is consumed, a taken gradient dropped, a Forward's session kept;
// otherwise they stay (or go) as if the call had not happened.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/flce/v1/loss_service.grpc.pb.h"
#include "server/auth.h"
#include "server/call_channel.h"
#include "server/loss_core.h"
#include "server/metrics.h"
#include "server/request_admission.h"
#include "server/rpc_call.h"
#include "server/shared_memory.h"
#include "server/work_queue.h"

namespace flce {

struct ServiceLimits {
  int64_t max_message_bytes = int64_t{256} << 20;
  // Clients' own memory (POSIX shared memory, CUDA IPC) accepted
  // (--enable_shared_memory); regions of server memory need no flag.
  bool shared_memory_enabled = false;
  // Largest ForwardStream request (all its tensors), in bytes.
  int64_t max_stream_request_bytes = int64_t{64} << 30;

  // Bytes of tensor data per streamed chunk (BackwardStream,
  // TakeWeightGrad): 4 MiB, less where the message limit is smaller.
  int64_t stream_chunk_bytes() const;
};

// The service on raw bytes: every request is parsed by the service itself
// (server/rpc_call.h), so one that does not parse is INVALID_ARGUMENT.
template <typename Base>
using RawRegions = v1::LossService::WithRawCallbackMethod_WriteRegion<
    v1::LossService::WithRawCallbackMethod_ReadRegion<Base>>;
template <typename Base>
using RawChannels = v1::LossService::WithRawCallbackMethod_OpenCallChannel<
    v1::LossService::WithRawCallbackMethod_CloseCallChannel<Base>>;
using RawLossService =
    v1::LossService::WithRawCallbackMethod_Forward<v1::LossService::WithRawCallbackMethod_Backward<
        v1::LossService::WithRawCallbackMethod_ForwardStream<
            v1::LossService::WithRawCallbackMethod_BackwardStream<
                v1::LossService::WithRawCallbackMethod_ReleaseSession<
                    v1::LossService::WithRawCallbackMethod_GetServerInfo<
                        v1::LossService::WithRawCallbackMethod_GetStats<
                            v1::LossService::WithRawCallbackMethod_PutWeight<
                                v1::LossService::WithRawCallbackMethod_DeleteWeight<
                                    v1::LossService::WithRawCallbackMethod_ListWeights<
                                        v1::LossService::WithRawCallbackMethod_RegisterSharedMemory<
                                            v1::LossService::
                                                WithRawCallbackMethod_UnregisterSharedMemory<
                                                    v1::LossService::
                                                        WithRawCallbackMethod_TakeWeightGrad<
                                                            RawChannels<RawRegions<
                                                                v1::LossService::Service>>>>>>>>>>>>>>>;

class LossServiceImpl final : public RawLossService, public CallChannelService {
 public:
  // All pointers must outlive the service (`auth` null for anonymous
  // callers only).
  // `on_engine_unhealthy` runs once, the first time a failed call leaves
  // the engine unhealthy.
  // `metrics` records every RPC; `gauges` reads the current gauges for
  // GetStats.
  LossServiceImpl(LossCore* core, WorkQueue* queue, ServiceLimits limits,
                  RequestAdmission* admission, SharedMemoryRegistry* shared_memory,
                  const Authenticator* auth, ServiceMetrics* metrics,
                  std::function<Gauges()> gauges, std::function<void()> on_engine_unhealthy);

  // From now on, new work (Forward, ForwardStream, PutWeight,
  // RegisterSharedMemory) is refused with UNAVAILABLE so that clients move
  // to another replica, while calls on existing sessions, weights and
  // regions are still served.
  void StartDraining() { draining_ = true; }

  // The channels OpenCallChannel opens (null: OpenCallChannel is
  // FAILED_PRECONDITION); set before serving, must outlive the service.
  void set_call_channels(CallChannels* channels) { channels_ = channels; }

  // The bulk HTTP port that regions of server memory are registered with
  // (0: none); set before serving.
  void set_bulk_port(int port) { bulk_port_ = port; }

  using Unary = grpc::ServerUnaryReactor;
  using Bytes = grpc::ByteBuffer;
  using Context = grpc::CallbackServerContext;

  Unary* Forward(Context* context, const Bytes* request, Bytes* response) override;
  Unary* Backward(Context* context, const Bytes* request, Bytes* response) override;
  grpc::ServerReadReactor<Bytes>* ForwardStream(Context* context, Bytes* response) override;
  grpc::ServerWriteReactor<Bytes>* BackwardStream(Context* context, const Bytes* request) override;
  Unary* ReleaseSession(Context* context, const Bytes* request, Bytes* response) override;
  Unary* GetServerInfo(Context* context, const Bytes* request, Bytes* response) override;
  Unary* GetStats(Context* context, const Bytes* request, Bytes* response) override;
  Unary* RegisterSharedMemory(Context* context, const Bytes* request, Bytes* response) override;
  Unary* UnregisterSharedMemory(Context* context, const Bytes* request, Bytes* response) override;
  grpc::ServerReadReactor<Bytes>* PutWeight(Context* context, Bytes* response) override;
  Unary* DeleteWeight(Context* context, const Bytes* request, Bytes* response) override;
  Unary* ListWeights(Context* context, const Bytes* request, Bytes* response) override;
  grpc::ServerWriteReactor<Bytes>* TakeWeightGrad(Context* context, const Bytes* request) override;
  Unary* OpenCallChannel(Context* context, const Bytes* request, Bytes* response) override;
  Unary* CloseCallChannel(Context* context, const Bytes* request, Bytes* response) override;
  grpc::ServerReadReactor<Bytes>* WriteRegion(Context* context, Bytes* response) override;
  grpc::ServerWriteReactor<Bytes>* ReadRegion(Context* context, const Bytes* request) override;

  // CallChannelService: a channel's calls, served as the RPCs are.
  void ChannelForward(Call* call, const std::string& principal, const v1::ForwardRequest* request,
                      v1::ForwardResponse* response) override;
  void ChannelBackward(Call* call, const std::string& principal,
                       const v1::BackwardRequest* request,
                       v1::BackwardResponse* response) override;
  void ChannelReleaseSession(Call* call, const std::string& principal,
                             const v1::ReleaseSessionRequest* request,
                             v1::ReleaseSessionResponse* response) override;

 private:
  // Decodes a Forward request, queues its computation and replies on `call`
  // (`response` filled in on OK). `request` and `response` must live until
  // the call is over.
  void StartForward(Call* call, const std::string& principal, const v1::ForwardRequest* request,
                    v1::ForwardResponse* response);
  // The board of the region into which `request`'s eager backward writes dX
  // where it names a written_mark (null where it names none), its failure
  // posted when `call` is over; INVALID_ARGUMENT where that region is not
  // one of `principal`'s regions of server memory.
  absl::StatusOr<MarkBoard*> WrittenMarks(Call* call, const std::string& principal,
                                          const v1::ForwardRequest& request);
  // `eager`: the request's Backward part (ForwardRequest.backward, decoded
  // by DecodeEagerBackward, and as sent), or null. `written_marks`: where
  // eager_request->written_mark is posted once the gradients are written
  // (WrittenMarks), or null.
  absl::Status ComputeForward(Call* call, const std::string& principal, const ForwardCall& forward,
                              BackwardCall* eager, const v1::EagerBackward* eager_request,
                              MarkBoard* written_marks, std::shared_ptr<LossCore::Staged> staged,
                              v1::ForwardResponse* response, absl::Time queued);
  // The same for Backward; the gradients land in *outcome, whose session
  // is settled when the call is over. `max_response_bytes` bounds the
  // inline gradients (0: none, for BackwardStream).
  struct CallStats {
    double queue_ms = 0, engine_ms = 0;
  };
  void StartBackward(Call* call, const std::string& principal, const v1::BackwardRequest* request,
                     int64_t max_response_bytes, std::shared_ptr<BackwardOutcome> outcome,
                     std::shared_ptr<CallStats> stats,
                     std::function<void(const absl::Status&)> done);
  // Writes the loss into ForwardRequest.loss_out's memory.
  absl::Status WriteLoss(const HostTensor& loss, const SliceMemory& out);
  // A unary Backward: StartBackward, then its gradients into `response`
  // (`request` and `response` live until the call is over).
  void ServeBackward(Call* call, const std::string& principal, const v1::BackwardRequest* request,
                     v1::BackwardResponse* response);

  // Queues `work` (returning the call's status), then calls done(status) on
  // the worker; at once if the queue refuses. Allocation failures in `work`
  // become RESOURCE_EXHAUSTED.
  void Run(Call* call, std::function<absl::Status(absl::Time queued)> work,
           std::function<void(const absl::Status&)> done);

  // Context for an engine error: deadline vs cancellation, INTERNAL logged
  // once, and the health hook when the engine stopped.
  absl::Status Explain(absl::Status status, const Call& call);

  // The caller's principal (server/auth.h), or UNAUTHENTICATED. Every
  // handler asks first.
  absl::StatusOr<std::string> Authenticate(const Context* context) const;
  // Authenticate, and UNAVAILABLE while draining: for RPCs that start new work.
  absl::StatusOr<std::string> Admit(const Context* context) const;
  static absl::Status DrainingError();

  // A resolver of the principal's shared-memory slices, or null (disabled).
  std::shared_ptr<SliceResolver> ResolverFor(const std::string& principal) const;

  template <typename Request, typename Response>
  UnaryCall<Request, Response>* NewUnary(Context* context, const Bytes* in, Bytes* out,
                                         const char* rpc);
  // Authenticates the call (with `new_work`, also UNAVAILABLE while
  // draining) and parses its request: the principal, or nullopt when the
  // call was answered already.
  template <typename Request, typename Response>
  std::optional<std::string> Accept(UnaryCall<Request, Response>* call, bool new_work);

  LossCore* const core_;
  WorkQueue* const queue_;
  const ServiceLimits limits_;
  RequestAdmission* const admission_;
  SharedMemoryRegistry* const shared_memory_;
  const Authenticator* const auth_;
  ServiceMetrics* const metrics_;
  const std::function<Gauges()> gauges_;
  const std::function<void()> on_engine_unhealthy_;
  std::once_flag unhealthy_once_;
  std::atomic<bool> draining_{false};
  CallChannels* channels_ = nullptr;
  int bulk_port_ = 0;
};

// The unary calls' start, used by every handler file.

template <typename Request, typename Response>
UnaryCall<Request, Response>* LossServiceImpl::NewUnary(Context* context, const Bytes* in,
                                                        Bytes* out, const char* rpc) {
  return new UnaryCall<Request, Response>(context, in, out, metrics_, rpc,
                                          limits_.max_message_bytes);
}

template <typename Request, typename Response>
std::optional<std::string> LossServiceImpl::Accept(UnaryCall<Request, Response>* call,
                                                   bool new_work) {
  absl::StatusOr<std::string> principal =
      new_work ? Admit(call->context()) : Authenticate(call->context());
  if (!principal.ok()) {
    call->Reply(principal.status());
    return std::nullopt;
  }
  if (!call->Parse(*admission_, *principal)) return std::nullopt;
  return *std::move(principal);
}

}  // namespace flce

#endif  // FLCE_SERVER_LOSS_SERVICE_H_
