#ifndef FLCE_KERNELS_CUDA_ELEMENTWISE_H_
#define FLCE_KERNELS_CUDA_ELEMENTWISE_H_

// Element-wise kernels of the CUDA engine: row scaling, dtype conversion
// (the narrowing of gradients), accumulation, target widening.
// Every launcher takes an explicit stream, never allocates, never
// synchronises, and returns cudaGetLastError() after its launches. Plain C++
// and the CUDA runtime's types only (no Abseil, no gRPC), so nvcc stays simple.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// dst[r, c] = factor[r] × src[r, c] over a row-major rows × cols matrix of
// `dtype`, rounded once; dst may equal src.
cudaError_t LaunchScaleRows(const void* src, void* dst, DType dtype, const float* factor,
                            int64_t rows, int64_t cols, cudaStream_t stream);

// dst[i] = src[i] × scale converted from src_dtype to dst_dtype (floating
// dtypes), rounded once. dst may equal src only when the element sizes match.
cudaError_t LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                          int64_t count, float scale, cudaStream_t stream);

// dst[i] += src[i] × scale, in dst's dtype (a gradient added into a sum):
// fp32 dst in one FMA; bf16/fp16 dst as round(dst + round(src × scale)),
// PyTorch's autograd accumulation into a .grad of that dtype. Floating
// dtypes only.
cudaError_t LaunchAccumulate(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                             int64_t count, float scale, cudaStream_t stream);

// dst[i] = src[i]: int32 targets widened to int64.
cudaError_t LaunchWidenTargets(const int32_t* src, int64_t count, int64_t* dst,
                               cudaStream_t stream);

// A kernel that executes a trap instruction: the device reports
// cudaErrorLaunchFailure and the CUDA context becomes unusable (a sticky
// error). For fault-injection tests only (CudaEngine::InjectGemmFaultForTesting).
cudaError_t LaunchTrap(cudaStream_t stream);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_ELEMENTWISE_H_
