#ifndef FLCE_KERNELS_CUDA_DEVICE_HEALTH_H_
#define FLCE_KERNELS_CUDA_DEVICE_HEALTH_H_

// The one place where the CUDA engine turns CUDA and cuBLAS results into
// absl::Status and decides whether the engine can go on serving. Every
// status in kernels/cuda that comes from the CUDA runtime or cuBLAS goes
// through a DeviceHealth (the engine's), so a sticky device error marks the
// engine unhealthy on whichever path it surfaces: a GEMM, an allocation, a
// kernel launch, a copy or a timer.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace flce {
namespace internal_cuda {

// True for errors after which the CUDA context is unusable (illegal
// address, launch failure, ...): every later call in the process fails.
bool IsStickyError(cudaError_t error);

class DeviceHealth {
 public:
  DeviceHealth() = default;
  DeviceHealth(const DeviceHealth&) = delete;
  DeviceHealth& operator=(const DeviceHealth&) = delete;

  // OK for cudaSuccess. A sticky error marks this unhealthy for good and
  // gives UNAVAILABLE; an allocation failure gives RESOURCE_EXHAUSTED; any
  // other error INTERNAL. Messages name `what` and the error. A non-sticky
  // error is cleared from the runtime, so that later calls do not see it.
  absl::Status Check(cudaError_t error, absl::string_view what);

  // OK for CUBLAS_STATUS_SUCCESS; RESOURCE_EXHAUSTED for an allocation
  // failure; otherwise UNAVAILABLE (and unhealthy for good) when the CUDA
  // runtime reports a sticky error behind the failure, else INTERNAL.
  absl::Status Check(cublasStatus_t status, absl::string_view what);

  // OK while healthy; UNAVAILABLE naming the first sticky error after.
  absl::Status status() const;
  bool healthy() const { return healthy_.load(); }

 private:
  absl::Status MarkSticky(cudaError_t error, absl::string_view what);

  std::atomic<bool> healthy_{true};
  mutable absl::Mutex mu_;
  std::string first_sticky_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_DEVICE_HEALTH_H_
