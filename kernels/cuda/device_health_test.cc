// DeviceHealth's decisions, on error codes alone: runs without a GPU.

#include "kernels/cuda/device_health.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace internal_cuda {
namespace {

using ::testing::HasSubstr;

TEST(DeviceHealthTest, StickyErrorsAreTheOnesThatLoseTheContext) {
  for (cudaError_t sticky :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction,
        cudaErrorMisalignedAddress, cudaErrorAssert, cudaErrorECCUncorrectable, cudaErrorUnknown}) {
    EXPECT_TRUE(IsStickyError(sticky)) << cudaGetErrorName(sticky);
  }
  for (cudaError_t recoverable : {cudaSuccess, cudaErrorMemoryAllocation, cudaErrorInvalidValue,
                                  cudaErrorNotReady, cudaErrorInvalidResourceHandle}) {
    EXPECT_FALSE(IsStickyError(recoverable)) << cudaGetErrorName(recoverable);
  }
}

TEST(DeviceHealthTest, RecoverableErrorsKeepTheEngineServing) {
  DeviceHealth health;
  EXPECT_TRUE(health.Check(cudaSuccess, "nothing").ok());
  absl::Status oom = health.Check(cudaErrorMemoryAllocation, "allocating 8 bytes");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(oom.message(), HasSubstr("allocating 8 bytes"));
  absl::Status invalid = health.Check(cudaErrorInvalidValue, "row kernel");
  EXPECT_EQ(invalid.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(invalid.message(), HasSubstr("row kernel"));
  EXPECT_THAT(invalid.message(), HasSubstr("cudaErrorInvalidValue"));
  EXPECT_EQ(health.Check(CUBLAS_STATUS_ALLOC_FAILED, "cublasGemmEx").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(health.Check(CUBLAS_STATUS_INVALID_VALUE, "cublasGemmEx").code(),
            absl::StatusCode::kInternal);
  EXPECT_TRUE(health.healthy());
  EXPECT_TRUE(health.status().ok());
}

TEST(DeviceHealthTest, AStickyErrorStopsTheEngineForGoodAndNamesTheFirst) {
  DeviceHealth health;
  absl::Status first = health.Check(cudaErrorIllegalAddress, "dW GEMM");
  EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(first.message(), HasSubstr("dW GEMM"));
  EXPECT_FALSE(health.healthy());
  EXPECT_EQ(health.Check(cudaErrorLaunchFailure, "download").code(),
            absl::StatusCode::kUnavailable);
  // Later successes do not bring it back.
  EXPECT_TRUE(health.Check(cudaSuccess, "anything").ok());
  EXPECT_EQ(health.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(health.status().message(), HasSubstr("dW GEMM: cudaErrorIllegalAddress"));
}

}  // namespace
}  // namespace internal_cuda
}  // namespace flce
