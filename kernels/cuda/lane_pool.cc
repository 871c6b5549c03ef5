#include "kernels/cuda/lane_pool.h"

#include <algorithm>
#include <utility>

#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {

absl::StatusOr<std::unique_ptr<LanePool>> LanePool::Create(int count, DeviceHealth& health) {
  std::unique_ptr<LanePool> pool(new LanePool());
  for (int i = 0; i < std::max(1, count); ++i) {
    auto lane = std::make_unique<Lane>();
    lane->health_ = &health;
    FLCE_ASSIGN_OR_RETURN(lane->stream_, CudaStream::Create(health));
    FLCE_ASSIGN_OR_RETURN(lane->blas_, CublasHandle::Create(lane->stream_.get(), health));
    pool->lanes_.push_back(std::move(lane));
  }
  absl::MutexLock lock(&pool->mu_);
  for (auto& lane : pool->lanes_) pool->free_.push_back(lane.get());
  return pool;
}

LanePool::~LanePool() {
  for (auto& lane : lanes_) cudaStreamSynchronize(lane->stream());
}

LanePool::Lease::Lease(LanePool& pool) : pool_(pool) {
  absl::MutexLock lock(&pool_.mu_);
  pool_.mu_.Await(absl::Condition(
      +[](std::vector<Lane*>* free) { return !free->empty(); }, &pool_.free_));
  lane_ = pool_.free_.back();
  pool_.free_.pop_back();
}

LanePool::Lease::~Lease() {
  absl::MutexLock lock(&pool_.mu_);
  pool_.free_.push_back(lane_);
}

}  // namespace internal_cuda
}  // namespace flce
