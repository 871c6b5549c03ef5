#ifndef FLCE_KERNELS_CUDA_STAGE_CLOCK_H_
#define FLCE_KERNELS_CUDA_STAGE_CLOCK_H_

// CUDA events between the stages of a call on one stream, for benchmarks:
// device milliseconds per stage, summed over chunks. The pipeline marks its
// stages on a clock when it is given one (StageClock* may be null: no
// events, no cost).

#include <cuda_runtime_api.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/device_health.h"

namespace flce {
namespace internal_cuda {

class StageClock {
 public:
  // Errors of its events go through `health` (a failed mark is skipped).
  StageClock(cudaStream_t stream, DeviceHealth& health) : stream_(stream), health_(health) {}
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  ~StageClock();

  // The work queued on the stream since the previous mark was `stage` (the
  // first mark only starts the clock).
  void Mark(const char* stage);

  // Once the stream has run the marked work.
  std::map<std::string, double> Totals() const;

 private:
  cudaStream_t stream_;
  DeviceHealth& health_;
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
};

// Marks a stage on `clock` when there is one.
inline void Mark(StageClock* clock, const char* stage) {
  if (clock != nullptr) clock->Mark(stage);
}

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_STAGE_CLOCK_H_
