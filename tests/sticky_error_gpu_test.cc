// A sticky device error on the CUDA engine's GEMM path, end to end: the call
// that meets it and every later one get UNAVAILABLE, the engine reports
// itself unhealthy and the server's health turns NOT_SERVING. Its own test
// binary: the fault leaves the process's CUDA context unusable. Tagged
// `gpu`: skips without a device (fails under REQUIRE_GPU=1).

#include <cstdlib>
#include <memory>
#include <string>

#include "client/loss_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/random_problem.h"
#include "server/loss_server.h"
#include "tests/status_matchers.h"

#ifdef FLCE_WITH_CUDA
#include "kernels/cuda/cuda_engine.h"
#endif

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;
using grpc::health::v1::HealthCheckResponse;

bool RequireGpu() {
  const char* v = std::getenv("REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

TEST(StickyErrorTest, AFaultOnTheGemmPathMakesCallsUnavailableAndHealthNotServing) {
#ifndef FLCE_WITH_CUDA
  if (RequireGpu()) FAIL() << "REQUIRE_GPU=1 but this build has no CUDA engine";
  GTEST_SKIP() << "built without a CUDA toolkit";
#else
  auto engine = CudaEngine::Create();
  if (!engine.ok()) {
    if (RequireGpu()) FAIL() << "REQUIRE_GPU=1: " << engine.status();
    GTEST_SKIP() << engine.status();
  }
  CudaEngine* cuda = engine->get();
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.security.insecure = true;
  options.backend = "cuda";
  auto server = LossServer::Start(options, std::move(*engine));
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = LossClient::Create("127.0.0.1:" + std::to_string((*server)->port()));

  RandomProblemSpec spec;
  spec.rows = 64;
  spec.hidden = 32;
  spec.vocab = 1000;
  spec.dtype = DType::kBFloat16;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardArgs args;
  args.problem = p.view();
  ASSERT_TRUE(client->Forward(args).ok());
  EXPECT_EQ(*client->CheckHealth("flce.v1.LossService"), HealthCheckResponse::SERVING);

  cuda->InjectGemmFaultForTesting();
  // The GEMM runner's own status (cuBLAS) is what reports the fault.
  EXPECT_THAT(client->Forward(args),
              StatusIs(Code::kUnavailable, HasSubstr("unrecoverable device error in cuBLAS")));
  EXPECT_EQ(cuda->health().code(), Code::kUnavailable);
  EXPECT_EQ(*client->CheckHealth("flce.v1.LossService"), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(*client->CheckHealth(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE((*server)->Metrics().gauges.serving);
  // Every later call is refused the same way, and the server still answers.
  EXPECT_THAT(client->Forward(args), StatusIs(Code::kUnavailable, HasSubstr("unrecoverable")));
  EXPECT_TRUE(client->GetServerInfo().ok());
#endif
}

}  // namespace
}  // namespace flce
