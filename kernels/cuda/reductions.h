#ifndef FLCE_KERNELS_CUDA_REDUCTIONS_H_
#define FLCE_KERNELS_CUDA_REDUCTIONS_H_

// Reductions of the CUDA engine: the row scales and divisor, the totals of
// the row outputs, the bias gradient's column sums, and a matrix hash.
// Every launcher takes an explicit stream, never allocates, never
// synchronises, and returns cudaGetLastError() after its launches. Plain C++
// and the CUDA runtime's types only (no Abseil, no gRPC), so nvcc stays simple.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/row_kernels.h"
#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// Reduction divisor and per-row gradient scale, on the device:
//   denom = Σ_{valid rows} class_weight[t] (mean) or 1 (sum, none);
//   row_scale[i] = g_i / denom, with g_i = grad_output[0] (count 1),
//   grad_output[i] (count N) or 1 (grad_output null).
// Also writes num_valid. `denom` and `num_valid` are single device values.
cudaError_t LaunchRowScales(const int64_t* target, int64_t n, int64_t ignore_index,
                            const float* class_weight, bool mean, const float* grad_output,
                            int64_t grad_output_count, float* row_scale, double* denom,
                            int64_t* num_valid, cudaStream_t stream);

// Totals over all N rows: totals[0] = Σ loss / denom (mean) or Σ loss,
// totals[1] the same for z-loss, totals[2] = Σ correct. One block, fp64
// accumulation, deterministic.
cudaError_t LaunchReduceRows(const RowOutputs& rows, int64_t n, const double* denom, bool divide,
                             double* totals, cudaStream_t stream);

// db[j] (+)= Σ_r row_weight[r]·grad[r, j] over a chunk's gradient
// (grad_dtype, leading dimension ld elements; row_weight null: all 1, else
// `rows` fp32 device values). accumulate = false overwrites db.
cudaError_t LaunchColumnSums(const void* grad, DType grad_dtype, int64_t rows, int64_t vocab,
                             int64_t ld, const float* row_weight, bool accumulate, float* db,
                             cudaStream_t stream);

// *hash += an order-independent 64-bit hash of the bits of the m×n
// column-major matrix at c (leading dimension ld elements) of
// `elem_bytes`-byte elements (2 or 4): equal matrices hash equal; any
// differing element changes the hash with overwhelming probability.
cudaError_t LaunchHashMatrix(const void* c, int elem_bytes, int64_t m, int64_t n, int64_t ld,
                             unsigned long long* hash, cudaStream_t stream);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_REDUCTIONS_H_
