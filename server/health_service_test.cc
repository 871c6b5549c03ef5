#include "server/health_service.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class HealthServiceTest : public ::testing::Test {
 protected:
  void Start(int max_watches) {
    service_ = std::make_unique<HealthService>(max_watches);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = Health::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) {
      service_->Shutdown();
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    }
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckRequest request;
    request.set_service(service);
    return stub_->Check(&context, request, response);
  }

  // An open Watch of `service`.
  struct Watch {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;

    HealthCheckResponse::ServingStatus Next() {
      HealthCheckResponse response;
      return reader->Read(&response) ? response.status()
                                     : static_cast<HealthCheckResponse::ServingStatus>(-1);
    }
  };
  std::unique_ptr<Watch> OpenWatch(const std::string& service) {
    auto watch = std::make_unique<Watch>();
    watch->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    HealthCheckRequest request;
    request.set_service(service);
    watch->reader = stub_->Watch(&watch->context, request);
    return watch;
  }

  void OpenWatchesBecome(int n) {
    for (int i = 0; i < 500 && service_->open_watches() != n; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(service_->open_watches(), n);
  }

  std::unique_ptr<HealthService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthServiceTest, CheckAnswersEachServicesStatusAndNotFoundForOthers) {
  Start(8);
  service_->SetServingStatus("", true);
  service_->SetServingStatus("flce.v1.LossService", false);
  HealthCheckResponse response;
  ASSERT_TRUE(Check("", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  ASSERT_TRUE(Check("flce.v1.LossService", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  const grpc::Status unknown = Check("no.such.Service", &response);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(unknown.error_message().find("no.such.Service"), std::string::npos);
}

TEST_F(HealthServiceTest, AWatchGetsTheStatusThenEachChange) {
  Start(8);
  service_->SetServingStatus("svc", true);
  auto watch = OpenWatch("svc");
  EXPECT_EQ(watch->Next(), HealthCheckResponse::SERVING);
  service_->SetServingStatus("svc", false);
  EXPECT_EQ(watch->Next(), HealthCheckResponse::NOT_SERVING);
  service_->SetServingStatus("other", true);  // not this watch's service
  service_->SetServingStatus("svc", false);   // no change: nothing sent
  service_->SetServingStatus("svc", true);
  EXPECT_EQ(watch->Next(), HealthCheckResponse::SERVING);
  // An unknown service is watched too, until it has a status.
  auto later = OpenWatch("later");
  EXPECT_EQ(later->Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  service_->SetServingStatus("later", true);
  EXPECT_EQ(later->Next(), HealthCheckResponse::SERVING);
  watch->context.TryCancel();
  later->context.TryCancel();
  OpenWatchesBecome(0);
}

TEST_F(HealthServiceTest, ShutdownEndsOpenWatchesSoTheServerStopsAtOnce) {
  Start(8);
  service_->SetServingStatus("", true);
  auto first = OpenWatch("");
  auto second = OpenWatch("");
  EXPECT_EQ(first->Next(), HealthCheckResponse::SERVING);
  EXPECT_EQ(second->Next(), HealthCheckResponse::SERVING);
  OpenWatchesBecome(2);
  const absl::Time start = absl::Now();
  service_->Shutdown();
  for (Watch* watch : {first.get(), second.get()}) {
    EXPECT_EQ(watch->Next(), HealthCheckResponse::NOT_SERVING);
    EXPECT_EQ(watch->Next(), -1);  // the end of the stream
    const grpc::Status status = watch->reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(status.error_message(), "the server is shutting down");
  }
  // Statuses are NOT_SERVING from now on, whatever is set; a new watch is
  // told so and ended.
  service_->SetServingStatus("", true);
  HealthCheckResponse response;
  ASSERT_TRUE(Check("", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  auto late = OpenWatch("");
  EXPECT_EQ(late->Next(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(late->Next(), -1);
  EXPECT_EQ(late->reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  // Nothing holds the server's shutdown, whose grace is long.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30));
  server_ = nullptr;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(service_->open_watches(), 0);
}

TEST_F(HealthServiceTest, OpenWatchesAreBounded) {
  Start(2);
  service_->SetServingStatus("", true);
  auto a = OpenWatch("");
  auto b = OpenWatch("");
  EXPECT_EQ(a->Next(), HealthCheckResponse::SERVING);
  EXPECT_EQ(b->Next(), HealthCheckResponse::SERVING);
  auto refused = OpenWatch("");
  EXPECT_EQ(refused->Next(), -1);
  const grpc::Status status = refused->reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("--max_health_watches"), std::string::npos);
  // A watch that ends makes room; checks are not watches and still answer.
  a->context.TryCancel();
  OpenWatchesBecome(1);
  auto c = OpenWatch("");
  EXPECT_EQ(c->Next(), HealthCheckResponse::SERVING);
  HealthCheckResponse response;
  EXPECT_TRUE(Check("", &response).ok());
  b->context.TryCancel();
  c->context.TryCancel();
  OpenWatchesBecome(0);
}

}  // namespace
}  // namespace flce
