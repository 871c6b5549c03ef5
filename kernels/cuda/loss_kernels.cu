// The CUDA engine's row kernels. See loss_kernels.h for what each computes.

#include "kernels/cuda/loss_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>

namespace flce {
namespace internal_cuda {
namespace {

constexpr int kRowThreads = 512;
constexpr int kWarps = kRowThreads / 32;

// ---------------------------------------------------------------------------
// Element types.

template <typename T>
__device__ __forceinline__ T FromFloatDev(float x);
template <>
__device__ __forceinline__ float FromFloatDev<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloatDev<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloatDev<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float ToFloatDev(float x) { return x; }
__device__ __forceinline__ float ToFloatDev(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloatDev(__nv_bfloat16 x) { return __bfloat162float(x); }

// ---------------------------------------------------------------------------
// Block reductions over kRowThreads threads.

// Online softmax state with the first index of the maximum.
struct SoftmaxState {
  float max;
  float sum;      // Σ exp(x − max)
  int64_t argmax;
};

__device__ __forceinline__ SoftmaxState Combine(SoftmaxState a, SoftmaxState b) {
  if (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) {
    SoftmaxState t = a;
    a = b;
    b = t;
  }
  // a.max >= b.max here.
  if (b.max == -CUDART_INF_F) return a;
  a.sum += b.sum * expf(b.max - a.max);
  return a;
}

__device__ __forceinline__ SoftmaxState WarpCombine(SoftmaxState s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    SoftmaxState o;
    o.max = __shfl_xor_sync(0xffffffffu, s.max, offset);
    o.sum = __shfl_xor_sync(0xffffffffu, s.sum, offset);
    o.argmax = __shfl_xor_sync(0xffffffffu, s.argmax, offset);
    s = Combine(s, o);
  }
  return s;
}

__device__ SoftmaxState BlockCombine(SoftmaxState s, SoftmaxState* shared) {
  s = WarpCombine(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = WarpCombine(lane < kWarps ? shared[lane]
                                  : SoftmaxState{-CUDART_INF_F, 0.0f, INT64_MAX});
    if (lane == 0) shared[0] = s;
  }
  __syncthreads();
  SoftmaxState result = shared[0];
  __syncthreads();
  return result;
}

__device__ float BlockSum(float v, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? shared[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float result = shared[0];
  __syncthreads();
  return result;
}

__device__ __forceinline__ bool BlockAny(bool v) { return __syncthreads_or(v ? 1 : 0) != 0; }

// ---------------------------------------------------------------------------
// The row kernel.

// z' = softcap(z + b).
__device__ __forceinline__ float Transform(const RowParams& p, float z, int64_t j) {
  if (p.bias != nullptr) z += p.bias[j];
  if (p.softcap > 0.0f) z = p.softcap * tanhf(z / p.softcap);
  return z;
}

// Gradient of the row loss w.r.t. logit j (before the softcap chain factor):
//   (1−ε)·w_t·(p − δ_jt) + ε/V·(Σw·p − w_j) + 2·s·lse·p, then × (1 − (z'/c)²).
__device__ __forceinline__ float Gradient(const RowParams& p, float zp, int64_t j,
                                          int64_t t, float wt, float lse) {
  const float prob = expf(zp - lse);
  const float smooth = p.label_smoothing / static_cast<float>(p.vocab);
  const float wj = p.class_weight != nullptr ? p.class_weight[j] : 1.0f;
  float d;
  if (j == t) {
    // p_t − 1 first, in fp32.
    d = (1.0f - p.label_smoothing) * wt * (prob - 1.0f) +
        smooth * (p.class_weight_sum * prob - wj) + 2.0f * p.z_loss_scale * lse * prob;
  } else {
    d = ((1.0f - p.label_smoothing) * wt + smooth * p.class_weight_sum +
         2.0f * p.z_loss_scale * lse) * prob - smooth * wj;
  }
  if (p.softcap > 0.0f) {
    const float u = zp / p.softcap;
    d *= 1.0f - u * u;
  }
  return d;
}

// Elements per 16-byte vector of T.
template <typename T>
constexpr int kPack = 16 / sizeof(T);

// Calls f(j, z[j] as float) for this thread's elements of a row, in
// increasing j. kVec: 16-byte loads (REQUIRES V % kPack<T> == 0, so every
// row starts 16-byte aligned).
template <typename T, bool kVec, typename F>
__device__ __forceinline__ void ForEachInRow(const T* z, int64_t vocab, F&& f) {
  if constexpr (kVec) {
    constexpr int P = kPack<T>;
    for (int64_t base = threadIdx.x * static_cast<int64_t>(P); base < vocab;
         base += static_cast<int64_t>(kRowThreads) * P) {
      const uint4 raw = *reinterpret_cast<const uint4*>(z + base);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < P; ++k) f(base + k, ToFloatDev(e[k]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kRowThreads) f(j, ToFloatDev(z[j]));
  }
}

// z[j] = g(j, z[j] as float) for this thread's elements, in place.
template <typename T, bool kVec, typename G>
__device__ __forceinline__ void UpdateRow(T* z, int64_t vocab, G&& g) {
  if constexpr (kVec) {
    constexpr int P = kPack<T>;
    for (int64_t base = threadIdx.x * static_cast<int64_t>(P); base < vocab;
         base += static_cast<int64_t>(kRowThreads) * P) {
      uint4 raw = *reinterpret_cast<const uint4*>(z + base);
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < P; ++k) e[k] = FromFloatDev<T>(g(base + k, ToFloatDev(e[k])));
      *reinterpret_cast<uint4*>(z + base) = raw;
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kRowThreads) {
      z[j] = FromFloatDev<T>(g(j, ToFloatDev(z[j])));
    }
  }
}

// Overwrites a row of logits with its scaled gradient (zeros for an ignored
// row). Each element is read and written by the same thread.
template <typename T, bool kVec>
__device__ void WriteGradientRow(const RowParams& p, T* z, int64_t t, bool valid, float wt,
                                 float lse, float scale) {
  UpdateRow<T, kVec>(z, p.vocab, [&](int64_t j, float x) {
    return valid ? scale * Gradient(p, Transform(p, x, j), j, t, wt, lse) : 0.0f;
  });
}

// One block per row: statistics, the row's loss outputs, and with
// kWriteGrad the gradient in place. Reads the row twice, writes it once.
template <typename T, bool kVec, bool kWriteGrad>
__global__ void __launch_bounds__(kRowThreads)
    ForwardRowsKernel(RowParams p, T* logits, const float* row_scale, RowOutputs out) {
  __shared__ SoftmaxState shared_state[kWarps];
  __shared__ float shared_sum[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  T* z = logits + r * p.vocab;
  const int64_t t = p.target[row];
  const bool valid = t != p.ignore_index;

  SoftmaxState s{-CUDART_INF_F, 0.0f, INT64_MAX};
  float weighted_z = 0.0f;  // Σ w_j z'_j, for label smoothing
  bool nan = false;
  ForEachInRow<T, kVec>(z, p.vocab, [&](int64_t j, float raw) {
    const float x = Transform(p, raw, j);
    nan |= isnan(x);
    if (x > s.max) {
      s.sum = s.sum * expf(s.max - x) + 1.0f;
      s.max = x;
      s.argmax = j;
    } else {
      s.sum += expf(x - s.max);
    }
    if (p.label_smoothing > 0.0f) {
      weighted_z += (p.class_weight != nullptr ? p.class_weight[j] : 1.0f) * x;
    }
  });
  s = BlockCombine(s, shared_state);
  if (p.label_smoothing > 0.0f) weighted_z = BlockSum(weighted_z, shared_sum);
  nan = BlockAny(nan);
  const float lse = nan ? CUDART_NAN_F : s.max + logf(s.sum);
  const float wt = valid ? (p.class_weight != nullptr ? p.class_weight[t] : 1.0f) : 0.0f;

  if (threadIdx.x == 0) {
    out.lse[row] = lse;
    if (valid) {
      const float zt = Transform(p, ToFloatDev(z[t]), t);
      const float z_row = p.z_loss_scale * lse * lse;
      const float eps = p.label_smoothing;
      out.loss[row] = (1.0f - eps) * wt * (lse - zt) +
                      eps / static_cast<float>(p.vocab) *
                          (p.class_weight_sum * lse - weighted_z) +
                      z_row;
      out.z_loss[row] = z_row;
      out.correct[row] = s.argmax == t ? 1 : 0;
    } else {
      out.loss[row] = 0.0f;
      out.z_loss[row] = 0.0f;
      out.correct[row] = 0;
    }
  }
  if constexpr (kWriteGrad) {
    __syncthreads();  // thread 0 has read z[t]; the row is overwritten next
    WriteGradientRow<T, kVec>(p, z, t, valid, wt, lse, row_scale[row]);
  }
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    GradientRowsKernel(RowParams p, T* logits, const float* lse, const float* row_scale) {
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  const int64_t t = p.target[row];
  const bool valid = t != p.ignore_index;
  const float wt = valid ? (p.class_weight != nullptr ? p.class_weight[t] : 1.0f) : 0.0f;
  WriteGradientRow<T, kVec>(p, logits + r * p.vocab, t, valid, wt, lse[row], row_scale[row]);
}

// ---------------------------------------------------------------------------
// Setup and reductions.

constexpr int kReduceThreads = 1024;

__global__ void __launch_bounds__(kReduceThreads)
    DenomKernel(const int64_t* target, int64_t n, int64_t ignore_index,
                const float* class_weight, bool mean, double* denom, int64_t* num_valid) {
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
    ReduceRowsKernel(RowOutputs rows, int64_t n, const double* denom, bool divide,
                     double* totals) {
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
                                 bool accumulate, float* db) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= vocab) return;
  float sum = 0.0f;
  for (int64_t r = 0; r < rows; ++r) sum += ToFloatDev(grad[r * ld + j]);
  db[j] = accumulate ? db[j] + sum : sum;
}

template <typename Src, typename Dst>
__global__ void ConvertKernel(const Src* src, Dst* dst, int64_t count, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromFloatDev<Dst>(ToFloatDev(src[i]) * scale);
  }
}

__global__ void WidenTargetsKernel(const int32_t* src, int64_t count, int64_t* dst) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) dst[i] = src[i];
}

// Blocks of `threads` covering `count` elements (grid x allows 2³¹ − 1).
unsigned int Blocks(int64_t count, int threads) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > INT32_MAX ? INT32_MAX : blocks));
}

template <typename Src>
cudaError_t ConvertFrom(const Src* src, void* dst, DType dst_dtype, int64_t count, float scale,
                        cudaStream_t stream) {
  const unsigned int blocks = Blocks(count, 256);
  switch (dst_dtype) {
    case DType::kFloat32:
      ConvertKernel<<<blocks, 256, 0, stream>>>(src, static_cast<float*>(dst), count, scale);
      break;
    case DType::kFloat16:
      ConvertKernel<<<blocks, 256, 0, stream>>>(src, static_cast<__half*>(dst), count, scale);
      break;
    case DType::kBFloat16:
      ConvertKernel<<<blocks, 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), count,
                                                scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t ForwardRowsFor(const RowParams& p, void* logits, bool write_grad,
                           const float* row_scale, const RowOutputs& out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(p.rows));
  T* z = static_cast<T*>(logits);
  const bool vec = p.vocab % kPack<T> == 0;
  if (write_grad) {
    if (vec) {
      ForwardRowsKernel<T, true, true><<<grid, kRowThreads, 0, stream>>>(p, z, row_scale, out);
    } else {
      ForwardRowsKernel<T, false, true><<<grid, kRowThreads, 0, stream>>>(p, z, row_scale, out);
    }
  } else {
    if (vec) {
      ForwardRowsKernel<T, true, false><<<grid, kRowThreads, 0, stream>>>(p, z, row_scale, out);
    } else {
      ForwardRowsKernel<T, false, false><<<grid, kRowThreads, 0, stream>>>(p, z, row_scale,
                                                                           out);
    }
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t GradientRowsFor(const RowParams& p, void* logits, const float* lse,
                            const float* row_scale, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(p.rows));
  T* z = static_cast<T*>(logits);
  if (p.vocab % kPack<T> == 0) {
    GradientRowsKernel<T, true><<<grid, kRowThreads, 0, stream>>>(p, z, lse, row_scale);
  } else {
    GradientRowsKernel<T, false><<<grid, kRowThreads, 0, stream>>>(p, z, lse, row_scale);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchForwardRows(const RowParams& p, void* logits, DType dtype, bool write_grad,
                              const float* row_scale, const RowOutputs& out,
                              cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return ForwardRowsFor<float>(p, logits, write_grad, row_scale, out, stream);
    case DType::kFloat16:
      return ForwardRowsFor<__half>(p, logits, write_grad, row_scale, out, stream);
    case DType::kBFloat16:
      return ForwardRowsFor<__nv_bfloat16>(p, logits, write_grad, row_scale, out, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchGradientRows(const RowParams& p, void* logits, DType dtype, const float* lse,
                               const float* row_scale, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return GradientRowsFor<float>(p, logits, lse, row_scale, stream);
    case DType::kFloat16:
      return GradientRowsFor<__half>(p, logits, lse, row_scale, stream);
    case DType::kBFloat16:
      return GradientRowsFor<__nv_bfloat16>(p, logits, lse, row_scale, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchRowScales(const int64_t* target, int64_t n, int64_t ignore_index,
                            const float* class_weight, bool mean, const float* grad_output,
                            int64_t grad_output_count, float* row_scale, double* denom,
                            int64_t* num_valid, cudaStream_t stream) {
  DenomKernel<<<1, kReduceThreads, 0, stream>>>(target, n, ignore_index, class_weight, mean,
                                                denom, num_valid);
  if (n > 0) {
    RowScaleKernel<<<Blocks(n, 256), 256, 0, stream>>>(n, denom, grad_output,
                                                       grad_output_count, row_scale);
  }
  return cudaGetLastError();
}

cudaError_t LaunchReduceRows(const RowOutputs& rows, int64_t n, const double* denom,
                             bool divide, double* totals, cudaStream_t stream) {
  ReduceRowsKernel<<<1, kReduceThreads, 0, stream>>>(rows, n, denom, divide, totals);
  return cudaGetLastError();
}

cudaError_t LaunchColumnSums(const void* grad, DType grad_dtype, int64_t rows, int64_t vocab,
                             int64_t ld, bool accumulate, float* db, cudaStream_t stream) {
  const unsigned int blocks = Blocks(vocab, 256);
  switch (grad_dtype) {
    case DType::kFloat32:
      ColumnSumsKernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(grad), rows, vocab,
                                                   ld, accumulate, db);
      break;
    case DType::kFloat16:
      ColumnSumsKernel<<<blocks, 256, 0, stream>>>(static_cast<const __half*>(grad), rows,
                                                   vocab, ld, accumulate, db);
      break;
    case DType::kBFloat16:
      ColumnSumsKernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(grad),
                                                   rows, vocab, ld, accumulate, db);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                          int64_t count, float scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (src_dtype) {
    case DType::kFloat32:
      return ConvertFrom(static_cast<const float*>(src), dst, dst_dtype, count, scale, stream);
    case DType::kFloat16:
      return ConvertFrom(static_cast<const __half*>(src), dst, dst_dtype, count, scale, stream);
    case DType::kBFloat16:
      return ConvertFrom(static_cast<const __nv_bfloat16*>(src), dst, dst_dtype, count, scale,
                         stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchWidenTargets(const int32_t* src, int64_t count, int64_t* dst,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  WidenTargetsKernel<<<Blocks(count, 256), 256, 0, stream>>>(src, count, dst);
  return cudaGetLastError();
}

}  // namespace internal_cuda
}  // namespace flce
