#ifndef FLCE_KERNELS_CUDA_CUDA_DEVICE_MEMORY_H_
#define FLCE_KERNELS_CUDA_CUDA_DEVICE_MEMORY_H_

// The CUDA engine's DeviceMemory (kernels/device_memory.h): long-lived
// allocations (registered weights' device copies and gradient sums), CUDA
// IPC mappings of other processes' allocations, and copies between them
// and host memory. Statuses go through the engine's DeviceHealth.

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/device_health.h"
#include "kernels/device_memory.h"

namespace flce {
namespace internal_cuda {

class CudaDeviceMemory final : public DeviceMemory {
 public:
  // On CUDA device `device`; `health` must outlive this (blocks may outlive
  // it).
  CudaDeviceMemory(int device, DeviceHealth& health) : device_(device), health_(health) {}

  absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpc(const std::string& handle) override;
  absl::StatusOr<std::unique_ptr<DeviceEvent>> ImportCudaIpcEvent(
      const std::string& handle) override;
  absl::StatusOr<std::unique_ptr<DeviceBlock>> Allocate(int64_t bytes) override;
  // Waits for all of the device's work first (the engine's lanes are
  // non-blocking streams).
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override;
  absl::StatusOr<std::unique_ptr<DeviceBlock>> PinHostMemory(void* host, int64_t bytes) override;
  absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) override;
  absl::Status Zero(void* device, int64_t bytes) override;
  // On a non-blocking stream of its own (made at the first call), memory
  // from the device's stream-ordered pool.
  absl::StatusOr<StagedCopy> StageToDevice(const void* host, int64_t bytes) override;

  // Bytes of Allocate's blocks alive.
  int64_t allocated_bytes() const { return allocated_->load(); }

 private:
  absl::Status SetDevice();
  // A failed cudaIpcOpen*Handle `call`: UNAVAILABLE for a sticky error, else
  // INVALID_ARGUMENT naming `field` and where a handle must come from.
  absl::Status OpenError(cudaError_t error, const char* call, const char* field,
                         const char* origin);

  const int device_;
  DeviceHealth& health_;
  const std::shared_ptr<std::atomic<int64_t>> allocated_ =
      std::make_shared<std::atomic<int64_t>>(0);
  absl::Mutex stage_mu_;
  std::shared_ptr<CudaStream> stage_stream_ ABSL_GUARDED_BY(stage_mu_);
};

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_CUDA_DEVICE_MEMORY_H_
