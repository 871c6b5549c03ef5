#include "server/reflection_v1.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/descriptor.pb.h"
#include "gtest/gtest.h"
#include "proto/flce/v1/loss_service.pb.h"

namespace flce {
namespace {

namespace rv1 = grpc::reflection::v1;
using ::testing::ElementsAre;

const std::vector<std::string> kServices = {"flce.v1.LossService", "grpc.health.v1.Health"};

TEST(ReflectionV1Test, ListsTheServices) {
  rv1::ServerReflectionRequest request;
  request.set_list_services("");
  std::set<std::string> sent;
  const rv1::ServerReflectionResponse r = AnswerReflection(request, kServices, &sent);
  ASSERT_TRUE(r.has_list_services_response());
  std::vector<std::string> names;
  for (const auto& s : r.list_services_response().service()) names.push_back(s.name());
  EXPECT_THAT(names, ElementsAre("flce.v1.LossService", "grpc.health.v1.Health"));
  EXPECT_TRUE(r.original_request().has_list_services());
}

TEST(ReflectionV1Test, TheServicesFileOnceAndThenNotAgain) {
  // Linked in: the descriptor of the API.
  ASSERT_NE(v1::ForwardRequest::descriptor(), nullptr);
  rv1::ServerReflectionRequest request;
  request.set_file_containing_symbol("flce.v1.LossService");
  std::set<std::string> sent;
  rv1::ServerReflectionResponse r = AnswerReflection(request, kServices, &sent);
  ASSERT_TRUE(r.has_file_descriptor_response()) << r.DebugString();
  ASSERT_GE(r.file_descriptor_response().file_descriptor_proto_size(), 1);
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(file.ParseFromString(r.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(file.package(), "flce.v1");
  ASSERT_GE(file.service_size(), 1);
  EXPECT_EQ(file.service(0).name(), "LossService");
  // A method's symbol names the same file, already sent on this stream.
  request.set_file_containing_symbol("flce.v1.LossService.Forward");
  r = AnswerReflection(request, kServices, &sent);
  ASSERT_TRUE(r.has_file_descriptor_response());
  EXPECT_EQ(r.file_descriptor_response().file_descriptor_proto_size(), 0);
  request.set_file_by_filename(file.name());
  std::set<std::string> fresh;
  r = AnswerReflection(request, kServices, &fresh);
  EXPECT_EQ(r.file_descriptor_response().file_descriptor_proto_size(), 1);
}

TEST(ReflectionV1Test, UnknownNamesAreNotFound) {
  std::set<std::string> sent;
  rv1::ServerReflectionRequest request;
  request.set_file_containing_symbol("flce.v1.NoSuchService");
  rv1::ServerReflectionResponse r = AnswerReflection(request, kServices, &sent);
  ASSERT_TRUE(r.has_error_response());
  EXPECT_EQ(r.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_THAT(r.error_response().error_message(), ::testing::HasSubstr("NoSuchService"));
  request.set_file_by_filename("no/such.proto");
  EXPECT_TRUE(AnswerReflection(request, kServices, &sent).has_error_response());
  request.set_all_extension_numbers_of_type("flce.v1.ForwardRequest");
  r = AnswerReflection(request, kServices, &sent);
  ASSERT_TRUE(r.has_all_extension_numbers_response());
  EXPECT_EQ(r.all_extension_numbers_response().extension_number_size(), 0);
  EXPECT_TRUE(
      AnswerReflection(rv1::ServerReflectionRequest(), kServices, &sent).has_error_response());
}

}  // namespace
}  // namespace flce
