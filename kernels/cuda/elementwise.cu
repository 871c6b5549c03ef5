// The CUDA engine's element-wise kernels. See elementwise.h for what each
// computes.

#include "kernels/cuda/elementwise.h"

#include <type_traits>

#include "kernels/cuda/device_primitives.cuh"

namespace flce {
namespace internal_cuda {
namespace {

// dst[r, c] = factor[r] × src[r, c] for a row-major rows × cols matrix,
// rounded once to T; dst may be src. One block per row.
template <typename T>
__global__ void ScaleRowsKernel(const T* src, T* dst, const float* factor, int64_t cols) {
  const int64_t base = blockIdx.x * cols;
  const float f = factor[blockIdx.x];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    dst[base + c] = FromFloatDev<T>(f * ToFloatDev(src[base + c]));
  }
}

template <typename Src, typename Dst>
__global__ void ConvertKernel(const Src* src, Dst* dst, int64_t count, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromFloatDev<Dst>(ToFloatDev(src[i]) * scale);
  }
}

// Four consecutive elements, loaded and stored as one vector.
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename Src, typename Dst>
__device__ __forceinline__ Quad<Dst> ConvertQuad(const Quad<Src>& in, float scale) {
  Quad<Dst> out;
#pragma unroll
  for (int k = 0; k < 4; ++k) out.v[k] = FromFloatDev<Dst>(ToFloatDev(in.v[k]) * scale);
  return out;
}

// Quads each thread of ConvertQuadsKernel has in flight: the narrowing is a
// pure stream, and one 16-byte load per thread leaves DRAM underused.
constexpr int kQuadsInFlight = 4;

// ConvertKernel four elements at a time, for aligned src and dst: each
// thread loads kQuadsInFlight quads a grid apart, then converts and stores.
template <typename Src, typename Dst>
__global__ void ConvertQuadsKernel(const Quad<Src>* src, Quad<Dst>* dst, int64_t quads,
                                   float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (; i + (kQuadsInFlight - 1) * stride < quads; i += kQuadsInFlight * stride) {
    Quad<Src> in[kQuadsInFlight];
#pragma unroll
    for (int u = 0; u < kQuadsInFlight; ++u) in[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kQuadsInFlight; ++u) {
      dst[i + u * stride] = ConvertQuad<Src, Dst>(in[u], scale);
    }
  }
  for (; i < quads; i += stride) dst[i] = ConvertQuad<Src, Dst>(src[i], scale);
}

__global__ void WidenTargetsKernel(const int32_t* src, int64_t count, int64_t* dst) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) dst[i] = src[i];
}

// dst[i] += src[i] × scale in dst's dtype: fp32 sums in one FMA; a bf16 or
// fp16 dst gets round(dst + round(src × scale)), PyTorch's accumulation of a
// new gradient into a .grad of that dtype.
template <typename Src, typename Dst>
__global__ void AccumulateKernel(const Src* src, Dst* dst, int64_t count, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<Dst, float>) {
      dst[i] += ToFloatDev(src[i]) * scale;
    } else {
      const Dst add = FromFloatDev<Dst>(ToFloatDev(src[i]) * scale);
      dst[i] = FromFloatDev<Dst>(ToFloatDev(dst[i]) + ToFloatDev(add));
    }
  }
}

// Whole quads through the vector kernel where both sides are aligned for
// it, the rest (or everything, unaligned) element by element.
template <typename Src, typename Dst>
void ConvertTo(const Src* src, Dst* dst, int64_t count, float scale, cudaStream_t stream) {
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(src) % sizeof(Quad<Src>) == 0 &&
      reinterpret_cast<uintptr_t>(dst) % sizeof(Quad<Dst>) == 0) {
    const int64_t quads = count / 4;
    if (quads > 0) {
      ConvertQuadsKernel<<<Blocks(quads, 256 * kQuadsInFlight), 256, 0, stream>>>(
          reinterpret_cast<const Quad<Src>*>(src), reinterpret_cast<Quad<Dst>*>(dst), quads, scale);
    }
    done = quads * 4;
  }
  if (done < count) {
    ConvertKernel<<<Blocks(count - done, 256), 256, 0, stream>>>(src + done, dst + done,
                                                                 count - done, scale);
  }
}

__global__ void TrapKernel() { __trap(); }

}  // namespace

cudaError_t LaunchScaleRows(const void* src, void* dst, DType dtype, const float* factor,
                            int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  return FLCE_DISPATCH_FLOAT_DTYPE(dtype, T, [&] {
    ScaleRowsKernel<<<static_cast<unsigned int>(rows), 256, 0, stream>>>(
        static_cast<const T*>(src), static_cast<T*>(dst), factor, cols);
    return cudaGetLastError();
  });
}

cudaError_t LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                          int64_t count, float scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return FLCE_DISPATCH_FLOAT_DTYPE(src_dtype, Src, [&] {
    return FLCE_DISPATCH_FLOAT_DTYPE(dst_dtype, Dst, [&] {
      ConvertTo(static_cast<const Src*>(src), static_cast<Dst*>(dst), count, scale, stream);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchAccumulate(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                             int64_t count, float scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return FLCE_DISPATCH_FLOAT_DTYPE(src_dtype, Src, [&] {
    return FLCE_DISPATCH_FLOAT_DTYPE(dst_dtype, Dst, [&] {
      AccumulateKernel<<<Blocks(count, 256), 256, 0, stream>>>(
          static_cast<const Src*>(src), static_cast<Dst*>(dst), count, scale);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchWidenTargets(const int32_t* src, int64_t count, int64_t* dst,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  WidenTargetsKernel<<<Blocks(count, 256), 256, 0, stream>>>(src, count, dst);
  return cudaGetLastError();
}

cudaError_t LaunchTrap(cudaStream_t stream) {
  TrapKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

}  // namespace internal_cuda
}  // namespace flce
