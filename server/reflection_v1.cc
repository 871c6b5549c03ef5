#include "server/reflection_v1.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"

namespace flce {

namespace rv1 = grpc::reflection::v1;
using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;

namespace {

void AddFile(const FileDescriptor* file, std::set<std::string>* sent,
             rv1::FileDescriptorResponse* out) {
  if (!sent->insert(file->name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) AddFile(file->dependency(i), sent, out);
}

void NotFound(const std::string& what, rv1::ServerReflectionResponse* response) {
  response->mutable_error_response()->set_error_code(static_cast<int>(grpc::StatusCode::NOT_FOUND));
  response->mutable_error_response()->set_error_message(what);
}

}  // namespace

rv1::ServerReflectionResponse AnswerReflection(const rv1::ServerReflectionRequest& request,
                                               const std::vector<std::string>& services,
                                               std::set<std::string>* sent) {
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  rv1::ServerReflectionResponse response;
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  const FileDescriptor* file = nullptr;
  switch (request.message_request_case()) {
    case rv1::ServerReflectionRequest::kFileByFilename:
      file = pool->FindFileByName(request.file_by_filename());
      if (file == nullptr)
        NotFound(absl::StrCat("no file ", request.file_by_filename()), &response);
      break;
    case rv1::ServerReflectionRequest::kFileContainingSymbol:
      file = pool->FindFileContainingSymbol(request.file_containing_symbol());
      if (file == nullptr) {
        NotFound(absl::StrCat("no symbol ", request.file_containing_symbol()), &response);
      }
      break;
    case rv1::ServerReflectionRequest::kFileContainingExtension: {
      const auto& e = request.file_containing_extension();
      const auto* type = pool->FindMessageTypeByName(e.containing_type());
      const auto* extension =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, e.extension_number());
      if (extension == nullptr) {
        NotFound(absl::StrCat("no extension ", e.extension_number(), " of ", e.containing_type()),
                 &response);
      } else {
        file = extension->file();
      }
      break;
    }
    case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const auto* type = pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        NotFound(absl::StrCat("no type ", request.all_extension_numbers_of_type()), &response);
        break;
      }
      std::vector<const google::protobuf::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = response.mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const auto* f : extensions) numbers->add_extension_number(f->number());
      break;
    }
    case rv1::ServerReflectionRequest::kListServices:
      for (const std::string& name : services) {
        response.mutable_list_services_response()->add_service()->set_name(name);
      }
      break;
    default:
      response.mutable_error_response()->set_error_code(
          static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      response.mutable_error_response()->set_error_message("an empty request");
  }
  if (file != nullptr) AddFile(file, sent, response.mutable_file_descriptor_response());
  return response;
}

grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse>*
ReflectionV1Service::ServerReflectionInfo(grpc::CallbackServerContext*) {
  // Read a request, write its answer, read the next; the client's half-close
  // ends the stream with OK.
  class Stream final : public grpc::ServerBidiReactor<rv1::ServerReflectionRequest,
                                                      rv1::ServerReflectionResponse> {
   public:
    explicit Stream(const std::vector<std::string>* services) : services_(services) {
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      response_ = AnswerReflection(request_, *services_, &sent_);
      StartWrite(&response_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
        return;
      }
      StartRead(&request_);
    }
    void OnDone() override { delete this; }

   private:
    const std::vector<std::string>* const services_;
    rv1::ServerReflectionRequest request_;
    rv1::ServerReflectionResponse response_;
    std::set<std::string> sent_;
  };
  return new Stream(&services_);
}

}  // namespace flce
