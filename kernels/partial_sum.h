#ifndef FLCE_KERNELS_PARTIAL_SUM_H_
#define FLCE_KERNELS_PARTIAL_SUM_H_

// The collective behind the vocabulary-sharded engine over several engines
// (kernels/sharded_engine.h): the sum of fp32 buffers, one in each engine's
// memory, into the first one's. Implementations: in host memory (engines
// without a device, below), on one device for several engines sharing it,
// and NCCL over several devices (kernels/cuda/partial_sums.h).

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace flce {

class PartialSum {
 public:
  virtual ~PartialSum() = default;
  // parts[k]: `count` floats in engine k's memory (its device's, or host
  // memory for an engine without one); afterwards parts[0] holds the sum of
  // all of them. Complete when it returns.
  virtual absl::Status SumIntoFirst(const std::vector<float*>& parts, int64_t count) = 0;
};

// For engines that compute in host memory.
std::unique_ptr<PartialSum> HostPartialSum();

}  // namespace flce

#endif  // FLCE_KERNELS_PARTIAL_SUM_H_
