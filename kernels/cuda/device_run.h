#ifndef FLCE_KERNELS_CUDA_DEVICE_RUN_H_
#define FLCE_KERNELS_CUDA_DEVICE_RUN_H_

// What a benchmark gets from CudaEngine::PrepareDeviceRun: the served device
// pipeline, run again and again on one prepared problem (device_runner.h
// makes it).

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace flce {

class DeviceRun {
 public:
  virtual ~DeviceRun() = default;
  // One Forward + Backward of the prepared problem; returns its device
  // milliseconds, from CUDA events on the lane's stream before its first
  // and after its last work.
  virtual absl::StatusOr<double> Run() = 0;
  // Run() with CUDA events between its stages: device milliseconds per
  // stage (logits GEMM, row kernel, dX GEMM, dW GEMM, narrowing, ...),
  // summed over chunks.
  virtual absl::StatusOr<std::map<std::string, double>> RunStages() = 0;
  // Bytes of dX and dW that Run() holds: the gradients in their final
  // dtype and the fp32 sums they are made from (STORE_GRADS' state,
  // RECOMPUTE's dX). With X and W, what a served call holds anyway.
  virtual int64_t gradient_bytes() const = 0;
};

}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_DEVICE_RUN_H_
