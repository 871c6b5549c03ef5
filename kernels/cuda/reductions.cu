// The CUDA engine's reductions. See reductions.h for what each computes.

#include <algorithm>

#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/reductions.h"

namespace flce {
namespace internal_cuda {
namespace {

constexpr int kReduceThreads = 1024;

__global__ void __launch_bounds__(kReduceThreads)
    DenomKernel(const int64_t* target, int64_t n, int64_t ignore_index, const float* class_weight,
                bool mean, double* denom, int64_t* num_valid) {
  __shared__ double shared_w[kReduceThreads];
  __shared__ long long shared_n[kReduceThreads];
  double w = 0.0;
  long long count = 0;
  for (int64_t i = threadIdx.x; i < n; i += kReduceThreads) {
    const int64_t t = target[i];
    if (t == ignore_index) continue;
    ++count;
    w += class_weight != nullptr ? class_weight[t] : 1.0f;
  }
  shared_w[threadIdx.x] = w;
  shared_n[threadIdx.x] = count;
  __syncthreads();
  for (int stride = kReduceThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      shared_w[threadIdx.x] += shared_w[threadIdx.x + stride];
      shared_n[threadIdx.x] += shared_n[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *denom = mean ? shared_w[0] : 1.0;
    *num_valid = shared_n[0];
  }
}

__global__ void RowScaleKernel(int64_t n, const double* denom, const float* grad_output,
                               int64_t grad_output_count, float* row_scale) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  double g = 1.0;
  if (grad_output != nullptr) g = grad_output[grad_output_count == 1 ? 0 : i];
  row_scale[i] = static_cast<float>(g / *denom);
}

__global__ void __launch_bounds__(kReduceThreads)
    ReduceRowsKernel(RowOutputs rows, int64_t n, const double* denom, bool divide, double* totals) {
  __shared__ double shared[3][kReduceThreads];
  double loss = 0.0, z = 0.0, correct = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kReduceThreads) {
    loss += rows.loss[i];
    z += rows.z_loss[i];
    correct += rows.correct[i];
  }
  shared[0][threadIdx.x] = loss;
  shared[1][threadIdx.x] = z;
  shared[2][threadIdx.x] = correct;
  __syncthreads();
  for (int stride = kReduceThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      for (int k = 0; k < 3; ++k) shared[k][threadIdx.x] += shared[k][threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    // mean over zero valid rows: 0/0 = NaN, as PyTorch.
    const double d = divide ? *denom : 1.0;
    totals[0] = shared[0][0] / d;
    totals[1] = shared[1][0] / d;
    totals[2] = shared[2][0];
  }
}

template <typename GradT>
__global__ void ColumnSumsKernel(const GradT* grad, int64_t rows, int64_t vocab, int64_t ld,
                                 const float* row_weight, bool accumulate, float* db) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= vocab) return;
  float sum = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float g = ToFloatDev(grad[r * ld + j]);
    sum += row_weight != nullptr ? row_weight[r] * g : g;
  }
  db[j] = accumulate ? db[j] + sum : sum;
}

__device__ __forceinline__ uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Σ Mix64(bits ^ Mix64(index)) over the matrix, summed per warp, then
// added to *hash.
template <typename Bits>
__global__ void HashMatrixKernel(const Bits* c, int64_t m, int64_t n, int64_t ld,
                                 unsigned long long* hash) {
  uint64_t h = 0;
  const int64_t total = m * n;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e / m, i = e - j * m;
    h += Mix64(static_cast<uint64_t>(c[j * ld + i]) ^ Mix64(static_cast<uint64_t>(e)));
  }
  for (int offset = 16; offset > 0; offset >>= 1) h += __shfl_xor_sync(0xffffffffu, h, offset);
  if (threadIdx.x % 32 == 0) atomicAdd(hash, static_cast<unsigned long long>(h));
}

}  // namespace

cudaError_t LaunchRowScales(const int64_t* target, int64_t n, int64_t ignore_index,
                            const float* class_weight, bool mean, const float* grad_output,
                            int64_t grad_output_count, float* row_scale, double* denom,
                            int64_t* num_valid, cudaStream_t stream) {
  DenomKernel<<<1, kReduceThreads, 0, stream>>>(target, n, ignore_index, class_weight, mean, denom,
                                                num_valid);
  if (n > 0) {
    RowScaleKernel<<<Blocks(n, 256), 256, 0, stream>>>(n, denom, grad_output, grad_output_count,
                                                       row_scale);
  }
  return cudaGetLastError();
}

cudaError_t LaunchReduceRows(const RowOutputs& rows, int64_t n, const double* denom, bool divide,
                             double* totals, cudaStream_t stream) {
  ReduceRowsKernel<<<1, kReduceThreads, 0, stream>>>(rows, n, denom, divide, totals);
  return cudaGetLastError();
}

cudaError_t LaunchColumnSums(const void* grad, DType grad_dtype, int64_t rows, int64_t vocab,
                             int64_t ld, const float* row_weight, bool accumulate, float* db,
                             cudaStream_t stream) {
  return FLCE_DISPATCH_FLOAT_DTYPE(grad_dtype, T, [&] {
    ColumnSumsKernel<<<Blocks(vocab, 256), 256, 0, stream>>>(static_cast<const T*>(grad), rows,
                                                             vocab, ld, row_weight, accumulate, db);
    return cudaGetLastError();
  });
}

cudaError_t LaunchHashMatrix(const void* c, int elem_bytes, int64_t m, int64_t n, int64_t ld,
                             unsigned long long* hash, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (ld < m) return cudaErrorInvalidValue;
  const unsigned int blocks = std::min(Blocks(m * n, 256), 8192u);
  switch (elem_bytes) {
    case 2:
      HashMatrixKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(c), m, n, ld, hash);
      break;
    case 4:
      HashMatrixKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(c), m, n, ld, hash);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace internal_cuda
}  // namespace flce
