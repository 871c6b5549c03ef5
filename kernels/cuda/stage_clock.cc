#include "kernels/cuda/stage_clock.h"

namespace flce {
namespace internal_cuda {

StageClock::~StageClock() {
  for (const auto& mark : marks_) cudaEventDestroy(mark.second);
}

void StageClock::Mark(const char* stage) {
  cudaEvent_t event = nullptr;
  if (!health_.Check(cudaEventCreate(&event), "stage event").ok()) return;
  if (!health_.Check(cudaEventRecord(event, stream_), "stage event").ok()) {
    cudaEventDestroy(event);
    return;
  }
  marks_.emplace_back(stage, event);
}

std::map<std::string, double> StageClock::Totals() const {
  std::map<std::string, double> totals;
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    if (health_
            .Check(cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second),
                   "stage timing")
            .ok()) {
      totals[marks_[i].first] += ms;
    }
  }
  return totals;
}

}  // namespace internal_cuda
}  // namespace flce
