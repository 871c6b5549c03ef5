#ifndef FLCE_BENCH_CUBLAS_FLOOR_H_
#define FLCE_BENCH_CUBLAS_FLOOR_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/device_health.h"
#include "kernels/dtype.h"

namespace flce {

// The CUDA and cuBLAS statuses of the benchmarks' own work (the floor, the
// algorithm probe), which runs beside the engine, not in it.
internal_cuda::DeviceHealth& BenchHealth();

// Fills `b` (elements of `dtype`) with a fixed pattern of values in
// [-0.05, 0.05], never zero, and waits for it.
absl::Status FillPattern(const internal_cuda::DeviceBuffer& b, DType dtype, cudaStream_t s);

struct GemmFloor {
  double ms = 0;      // median time of the GEMM sequence
  double tflops = 0;  // its own FLOP rate
};

// The bare cuBLAS GEMMs of the loss at full size, with `dtype` operands and
// outputs (as torch.mm): logits = X·Wᵀ [N, V] (twice for RECOMPUTE), then
// dX = dZ·W and dW = dZᵀ·X. Timed with CUDA events over `iters` runs after
// `warmup`, median; on random data. This is the floor an engine is measured
// against: 3 GEMMs for STORE_GRADS, 4 for RECOMPUTE. `tuned`: each GEMM
// runs the algorithm the engine's GemmRunner tuning picks (the fastest with
// the default's bits; the first run tunes), else cublasGemmEx's default.
absl::StatusOr<GemmFloor> MeasureGemmFloor(int64_t n, int64_t h, int64_t v, DType dtype,
                                           int logits_gemms, bool tuned, int warmup, int iters);

// The card's own GEMM rate, against which an engine's effective TFLOP/s
// reads: C = A·B of size×size×size `dtype` operands and output in cuBLAS,
// its default algorithm and the fastest bit-identical tuned one (the
// faster of the two), timed as MeasureGemmFloor times.
absl::StatusOr<GemmFloor> MeasureGemmCeiling(int64_t size, DType dtype, int warmup, int iters);

}  // namespace flce

#endif  // FLCE_BENCH_CUBLAS_FLOOR_H_
