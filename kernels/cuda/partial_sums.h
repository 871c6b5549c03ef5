#ifndef FLCE_KERNELS_CUDA_PARTIAL_SUMS_H_
#define FLCE_KERNELS_CUDA_PARTIAL_SUMS_H_

// The collectives (kernels/partial_sum.h) of a sharded engine over CUDA
// engines: parts on one device (several engines sharing it: the one-GPU
// test of the several-engine path), and parts on several devices (NCCL).

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/partial_sum.h"

namespace flce {

// Every part on CUDA device `device`: added into the first by a kernel.
absl::StatusOr<std::unique_ptr<PartialSum>> DeviceLocalSum(int device);

// parts[k] on CUDA device devices[k] (distinct): an NCCL reduce into the
// first, over a communicator of this process's devices made here
// (ncclCommInitAll; NVLink multicast off: NCCL_NVLS_ENABLE=0). NCCL is
// loaded when this is called (libnccl.so.2): UNAVAILABLE without it, so the
// server starts without NCCL wherever it is not asked for.
absl::StatusOr<std::unique_ptr<PartialSum>> NcclSum(const std::vector<int>& devices);

}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_PARTIAL_SUMS_H_
