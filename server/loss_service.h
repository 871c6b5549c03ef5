#ifndef FLCE_SERVER_LOSS_SERVICE_H_
#define FLCE_SERVER_LOSS_SERVICE_H_

// flce.v1.LossService on gRPC's callback API. Handlers translate only:
// decode and validate the request on the gRPC thread, queue the engine work
// on the WorkQueue, encode the result and finish the reactor from the worker.
// Deadlines and cancellation are checked when a task starts and between
// chunks; one log line is written per finished RPC.

#include <cstdint>
#include <functional>
#include <mutex>

#include "grpcpp/grpcpp.h"
#include "proto/flce/v1/loss_service.grpc.pb.h"
#include "server/loss_core.h"
#include "server/work_queue.h"

namespace flce {

struct ServiceLimits {
  int64_t max_message_bytes = 0;
  // Bytes per WeightGradChunk that TakeWeightGrad streams.
  int64_t stream_chunk_bytes = int64_t{4} << 20;
};

class LossServiceImpl final : public v1::LossService::CallbackService {
 public:
  // All pointers must outlive the service. `on_engine_unhealthy` runs once,
  // the first time a failed call leaves the engine unhealthy.
  LossServiceImpl(LossCore* core, WorkQueue* queue, ServiceLimits limits,
                  std::function<void()> on_engine_unhealthy);

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* context,
                                     const v1::BackwardRequest* request,
                                     v1::BackwardResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSession(
      grpc::CallbackServerContext* context,
      const v1::ReleaseSessionRequest* request,
      v1::ReleaseSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context,
      const v1::GetServerInfoRequest* request,
      v1::GetServerInfoResponse* response) override;
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
  // Context for an engine error: deadline vs cancellation, INTERNAL logged
  // once, and the health hook when the engine stopped.
  absl::Status Explain(absl::Status status, const grpc::CallbackServerContext* context);

  LossCore* const core_;
  WorkQueue* const queue_;
  const ServiceLimits limits_;
  const std::function<void()> on_engine_unhealthy_;
  std::once_flag unhealthy_once_;
};

}  // namespace flce

#endif  // FLCE_SERVER_LOSS_SERVICE_H_
