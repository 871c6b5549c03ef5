#ifndef FLCE_SERVER_REFLECTION_V1_H_
#define FLCE_SERVER_REFLECTION_V1_H_

// grpc.reflection.v1, which tools such as grpcurl and grpc_cli ask first
// (Debian's gRPC serves only v1alpha). Answers from the descriptors linked
// into the binary (protobuf's generated pool).

#include <set>
#include <string>
#include <vector>

#include "proto/grpc/reflection/v1/reflection.grpc.pb.h"

namespace flce {

// The answer to one request. `sent` holds the names of the files this
// stream already sent; a file response adds the file and the files it
// imports, transitively, that are not in `sent` (and records them).
// Unknown names get an error_response with NOT_FOUND.
grpc::reflection::v1::ServerReflectionResponse AnswerReflection(
    const grpc::reflection::v1::ServerReflectionRequest& request,
    const std::vector<std::string>& services, std::set<std::string>* sent);

class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::CallbackService {
 public:
  // `services`: the fully qualified names list_services reports.
  explicit ReflectionV1Service(std::vector<std::string> services)
      : services_(std::move(services)) {}

  grpc::ServerBidiReactor<grpc::reflection::v1::ServerReflectionRequest,
                          grpc::reflection::v1::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* context) override;

 private:
  const std::vector<std::string> services_;
};

}  // namespace flce

#endif  // FLCE_SERVER_REFLECTION_V1_H_
