#ifndef FLCE_KERNELS_CUDA_LANE_POOL_H_
#define FLCE_KERNELS_CUDA_LANE_POOL_H_

// The CUDA engine's lanes: one per concurrent call, each a non-blocking
// stream with a cuBLAS handle bound to it. A call leases a lane for its
// whole duration, so everything it queues is ordered on one stream.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/device_health.h"

namespace flce {
namespace internal_cuda {

class Lane {
 public:
  cudaStream_t stream() const { return stream_.get(); }
  cublasHandle_t blas() const { return blas_.get(); }
  DeviceHealth& health() const { return *health_; }

  // `error` through the engine's DeviceHealth.
  absl::Status Check(cudaError_t error, absl::string_view what) const {
    return health_->Check(error, what);
  }
  // Stream-ordered device memory on this lane.
  absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes) const {
    return DeviceBuffer::Allocate(bytes, stream_.get(), *health_);
  }
  // Waits for everything queued on the lane.
  absl::Status Synchronize(absl::string_view what) const {
    return Check(cudaStreamSynchronize(stream_.get()), what);
  }

 private:
  friend class LanePool;
  CudaStream stream_;
  CublasHandle blas_;
  DeviceHealth* health_ = nullptr;
};

class LanePool {
 public:
  // `count` lanes (at least one) on the current device; statuses through
  // `health`, which must outlive the pool.
  static absl::StatusOr<std::unique_ptr<LanePool>> Create(int count, DeviceHealth& health);
  // Waits for every lane's work.
  ~LanePool();

  // Holds one lane for a call; waits while every lane is leased.
  class Lease {
   public:
    explicit Lease(LanePool& pool);
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lane& operator*() const { return *lane_; }
    Lane* operator->() const { return lane_; }

   private:
    LanePool& pool_;
    Lane* lane_;
  };

 private:
  LanePool() = default;
  std::vector<std::unique_ptr<Lane>> lanes_;
  absl::Mutex mu_;
  std::vector<Lane*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_LANE_POOL_H_
