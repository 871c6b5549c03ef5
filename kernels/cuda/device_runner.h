#ifndef FLCE_KERNELS_CUDA_DEVICE_RUNNER_H_
#define FLCE_KERNELS_CUDA_DEVICE_RUNNER_H_

// The benchmark's runner (device_run.h's DeviceRun): the served device pipeline
// (device_pipeline.h) on inputs that already live on the device, with the
// gradients delivered into device memory: what a same-host worker's call
// costs the device, without host transfers of X, W or the gradients.

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/cuda/device_pipeline.h"
#include "kernels/cuda/device_run.h"

namespace flce {
namespace internal_cuda {

// Uploads X and W of `problem` once and allocates the gradients'
// destinations (in the input dtype). REQUIRES: `problem`'s host tensors
// (target, bias, class_weight) stay valid while the run lives; `parts`
// outlives it.
absl::StatusOr<std::unique_ptr<DeviceRun>> PrepareDeviceRun(const PipelineParts& parts,
                                                            const LossProblem& problem,
                                                            BackwardMode mode);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_DEVICE_RUNNER_H_
