#ifndef FLCE_SERVER_LOSS_SERVICE_H_
#define FLCE_SERVER_LOSS_SERVICE_H_

// flce.v1.LossService on gRPC's callback API. Handlers translate only:
// decode and validate the request on the gRPC thread, queue the engine work
// on the WorkQueue, encode the result and finish the reactor from the worker.
// Deadlines and cancellation are checked when a task starts and between
// chunks; one log line is written per finished RPC.

#include <cstdint>
#include <memory>
#include <string>
#include <atomic>
#include <functional>
#include <mutex>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/flce/v1/loss_service.grpc.pb.h"
#include "server/auth.h"
#include "server/loss_core.h"
#include "server/metrics.h"
#include "server/shared_memory.h"
#include "server/work_queue.h"

namespace flce {

struct ServiceLimits {
  int64_t max_message_bytes = 0;
  // Bytes per chunk that TakeWeightGrad and BackwardStream send.
  int64_t stream_chunk_bytes = int64_t{4} << 20;
  // Largest ForwardStream request (all its tensors), in bytes.
  int64_t max_stream_request_bytes = int64_t{64} << 30;
};

class LossServiceImpl final : public v1::LossService::CallbackService {
 public:
  // All pointers must outlive the service; `shared_memory` is null when
  // shared memory is disabled, `auth` null for anonymous callers only.
  // `on_engine_unhealthy` runs once, the first time a failed call leaves
  // the engine unhealthy.
  // `metrics` records every RPC; `gauges` reads the current gauges for
  // GetStats.
  LossServiceImpl(LossCore* core, WorkQueue* queue, ServiceLimits limits,
                  SharedMemoryRegistry* shared_memory, const Authenticator* auth,
                  ServiceMetrics* metrics, std::function<Gauges()> gauges,
                  std::function<void()> on_engine_unhealthy);

  // From now on, new work (Forward, ForwardStream, PutWeight,
  // RegisterSharedMemory) is refused with UNAVAILABLE so that clients move
  // to another replica, while calls on existing sessions, weights and
  // regions are still served.
  void StartDraining() { draining_ = true; }

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* context,
                                     const v1::BackwardRequest* request,
                                     v1::BackwardResponse* response) override;
  grpc::ServerReadReactor<v1::ForwardRequestChunk>* ForwardStream(
      grpc::CallbackServerContext* context, v1::ForwardResponse* response) override;
  grpc::ServerWriteReactor<v1::BackwardResponseChunk>* BackwardStream(
      grpc::CallbackServerContext* context, const v1::BackwardRequest* request) override;
  grpc::ServerUnaryReactor* ReleaseSession(
      grpc::CallbackServerContext* context,
      const v1::ReleaseSessionRequest* request,
      v1::ReleaseSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context,
      const v1::GetServerInfoRequest* request,
      v1::GetServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerReadReactor<v1::PutWeightChunk>* PutWeight(
      grpc::CallbackServerContext* context, v1::PutWeightResponse* response) override;
  grpc::ServerUnaryReactor* DeleteWeight(grpc::CallbackServerContext* context,
                                         const v1::DeleteWeightRequest* request,
                                         v1::DeleteWeightResponse* response) override;
  grpc::ServerUnaryReactor* ListWeights(grpc::CallbackServerContext* context,
                                        const v1::ListWeightsRequest* request,
                                        v1::ListWeightsResponse* response) override;
  grpc::ServerWriteReactor<v1::WeightGradChunk>* TakeWeightGrad(
      grpc::CallbackServerContext* context,
      const v1::TakeWeightGradRequest* request) override;

 private:
  struct CallStats {
    double queue_ms = 0, engine_ms = 0;
  };

  // Decodes a Forward request, queues its computation and calls finish()
  // with the outcome (the response filled in on OK). `request` and
  // `response` must live until then.
  void StartForward(grpc::CallbackServerContext* context, const std::string& principal,
                    const v1::ForwardRequest* request, v1::ForwardResponse* response,
                    const char* rpc, std::function<void(const absl::Status&)> finish);
  absl::Status ComputeForward(grpc::CallbackServerContext* context, const std::string& principal,
                              const ForwardCall& call, v1::ForwardResponse* response,
                              absl::Time start, std::string* detail);
  // The same for Backward; the gradients land in *outcome.
  void StartBackward(grpc::CallbackServerContext* context, const std::string& principal,
                     const v1::BackwardRequest* request, const char* rpc, std::shared_ptr<BackwardOutcome> outcome,
                     std::shared_ptr<CallStats> stats,
                     std::function<void(const absl::Status&)> finish);

  // Context for an engine error: deadline vs cancellation, INTERNAL logged
  // once, and the health hook when the engine stopped.
  absl::Status Explain(absl::Status status, const grpc::CallbackServerContext* context);

  // The caller's principal (server/auth.h), or UNAUTHENTICATED. Every
  // handler asks first.
  absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext* context) const;
  // Authenticate, and UNAVAILABLE while draining: for RPCs that start new work.
  absl::StatusOr<std::string> Admit(const grpc::CallbackServerContext* context) const;

  // A resolver of the principal's shared-memory slices, or null (disabled).
  std::shared_ptr<SliceResolver> ResolverFor(const std::string& principal) const;

  LossCore* const core_;
  WorkQueue* const queue_;
  const ServiceLimits limits_;
  SharedMemoryRegistry* const shared_memory_;
  const Authenticator* const auth_;
  ServiceMetrics* const metrics_;
  const std::function<Gauges()> gauges_;
  const std::function<void()> on_engine_unhealthy_;
  std::once_flag unhealthy_once_;
  std::atomic<bool> draining_{false};
};

}  // namespace flce

#endif  // FLCE_SERVER_LOSS_SERVICE_H_
