#ifndef FLCE_KERNELS_CUDA_DEVICE_PRIMITIVES_CUH_
#define FLCE_KERNELS_CUDA_DEVICE_PRIMITIVES_CUH_

// Device-side building blocks of the CUDA engine's kernels (row_kernels.cu,
// reductions.cu, elementwise.cu, hopper_gemm.cu): element conversions, block
// reductions over a row's threads, 16-byte accesses with L2 eviction hints,
// fast exp, and the one dtype dispatch. Plain CUDA C++ (no Abseil, no gRPC).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <math_constants.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// Runs the callable `...` (taking no arguments and returning cudaError_t)
// with `T` naming the device element type of the floating dtype `dtype`
// (float, __half, __nv_bfloat16); any other dtype gives
// cudaErrorInvalidValue. An expression: `return FLCE_DISPATCH_FLOAT_DTYPE(
// dtype, T, [&] { return Launch<T>(...); });`
#define FLCE_DISPATCH_FLOAT_DTYPE(dtype, T, ...) \
  [&]() -> cudaError_t {                         \
    switch (dtype) {                             \
      case ::flce::DType::kFloat32: {            \
        using T = float;                         \
        return (__VA_ARGS__)();                  \
      }                                          \
      case ::flce::DType::kFloat16: {            \
        using T = __half;                        \
        return (__VA_ARGS__)();                  \
      }                                          \
      case ::flce::DType::kBFloat16: {           \
        using T = __nv_bfloat16;                 \
        return (__VA_ARGS__)();                  \
      }                                          \
      default:                                   \
        return cudaErrorInvalidValue;            \
    }                                            \
  }()

// Threads of a row kernel's block (one block per row).
constexpr int kRowThreads = 1024;
constexpr int kWarps = kRowThreads / 32;

// Blocks of `threads` covering `count` elements (grid x allows 2³¹ − 1).
inline unsigned int Blocks(int64_t count, int threads) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > INT32_MAX ? INT32_MAX : blocks));
}

// ---------------------------------------------------------------------------
// Element types.

template <typename T>
__device__ __forceinline__ T FromFloatDev(float x);
template <>
__device__ __forceinline__ float FromFloatDev<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloatDev<__half>(float x) {
  return __float2half_rn(x);
}
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
  float sum;  // Σ exp(x − max)
  int64_t argmax;
};

// kRescale: each state's sum is relative to its own max (online softmax);
// else every sum is relative to one common offset and sums just add.
template <bool kRescale>
__device__ __forceinline__ SoftmaxState Combine(SoftmaxState a, SoftmaxState b) {
  if (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) {
    SoftmaxState t = a;
    a = b;
    b = t;
  }
  // a.max >= b.max here.
  if constexpr (kRescale) {
    if (b.max == -CUDART_INF_F) return a;
    a.sum += b.sum * expf(b.max - a.max);
  } else {
    a.sum += b.sum;
  }
  return a;
}

template <bool kRescale>
__device__ __forceinline__ SoftmaxState WarpCombine(SoftmaxState s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    SoftmaxState o;
    o.max = __shfl_xor_sync(0xffffffffu, s.max, offset);
    o.sum = __shfl_xor_sync(0xffffffffu, s.sum, offset);
    o.argmax = __shfl_xor_sync(0xffffffffu, s.argmax, offset);
    s = Combine<kRescale>(s, o);
  }
  return s;
}

template <bool kRescale>
__device__ SoftmaxState BlockCombine(SoftmaxState s, SoftmaxState* shared) {
  s = WarpCombine<kRescale>(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = WarpCombine<kRescale>(lane < kWarps ? shared[lane]
                                            : SoftmaxState{-CUDART_INF_F, 0.0f, INT64_MAX});
    if (lane == 0) shared[0] = s;
  }
  __syncthreads();
  SoftmaxState result = shared[0];
  __syncthreads();
  return result;
}

// op(v) over the block's threads; every thread gets the result.
template <typename Op>
__device__ float BlockReduce(float v, float* shared, float identity, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? shared[lane] : identity;
    for (int offset = 16; offset > 0; offset >>= 1) {
      v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float result = shared[0];
  __syncthreads();
  return result;
}

__device__ inline float BlockSum(float v, float* shared) {
  return BlockReduce(v, shared, 0.0f, [](float a, float b) { return a + b; });
}

// The maximum, ignoring NaNs (fmaxf).
__device__ inline float BlockMax(float v, float* shared) {
  return BlockReduce(v, shared, -CUDART_INF_F, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ bool BlockAny(bool v) { return __syncthreads_or(v ? 1 : 0) != 0; }

// L2 eviction priorities (the row kernels' 16-byte accesses, the GEMM's
// TMA loads). The statistics pass marks what it reads evict-last when the
// gradient pass will read it again, so other blocks' streaming traffic (their gradient passes'
// reads and writes, marked evict-first) is evicted before it.
__device__ __forceinline__ uint64_t L2EvictLast() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t L2EvictFirst() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
// As a load without a hint (for instructions that always take a policy).
__device__ __forceinline__ uint64_t L2EvictNormal() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// volatile keeps a pack's load before the store that overwrites it in place.
__device__ __forceinline__ uint4 LoadWithPolicy(const void* ptr, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr), "l"(policy)
               : "memory");
  return v;
}
__device__ __forceinline__ void StoreWithPolicy(void* ptr, uint4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(ptr), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
}

// Elements per 16-byte vector of T.
template <typename T>
constexpr int kPack = 16 / sizeof(T);

// A thread's share of a row is packs of P consecutive elements: pack i
// starts at (threadIdx.x + i·kRowThreads)·P. kVec: P = kPack<T>, 16-byte
// loads with an L2 eviction policy (REQUIRES V % kPack<T> == 0, so every row
// starts 16-byte aligned); else single elements.
template <typename T, bool kVec>
struct RowPacks {
  static constexpr int P = kVec ? kPack<T> : 1;
  static constexpr int64_t kStride = int64_t{kRowThreads} * P;

  __device__ static void Load(const T* z, int64_t base, float (&x)[P], uint64_t policy) {
    if constexpr (kVec) {
      const uint4 raw = LoadWithPolicy(z + base, policy);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < P; ++k) x[k] = ToFloatDev(e[k]);
    } else {
      x[0] = ToFloatDev(z[base]);
    }
  }

  __device__ static void Store(T* z, int64_t base, const float (&x)[P], uint64_t policy) {
    if constexpr (kVec) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < P; ++k) e[k] = FromFloatDev<T>(x[k]);
      StoreWithPolicy(z + base, raw, policy);
    } else {
      z[base] = FromFloatDev<T>(x[0]);
    }
  }

  // f(first index, values) for each of this thread's packs, in increasing
  // order, two loads in flight at a time. kKeep: the row is read again next
  // (evict-last), else streamed (evict-first).
  template <bool kKeep, typename F>
  __device__ static void ForEach(const T* z, int64_t vocab, F&& f) {
    const uint64_t policy = kKeep ? L2EvictLast() : L2EvictFirst();
    int64_t base = threadIdx.x * int64_t{P};
    for (; base + kStride < vocab; base += 2 * kStride) {
      float a[P], b[P];
      Load(z, base, a, policy);
      Load(z, base + kStride, b, policy);
      f(base, a);
      f(base + kStride, b);
    }
    if (base < vocab) {
      float a[P];
      Load(z, base, a, policy);
      f(base, a);
    }
  }

  // Replaces each of this thread's packs by g(first index, values), two
  // packs in flight at a time; kReverse: last pack first (after a pass that
  // read the row front to back, its tail is what the L2 cache still holds),
  // else in increasing order. Reads and writes are evict-first: nothing
  // reads the row again before the GEMMs stream the whole chunk.
  template <bool kReverse, typename G>
  __device__ static void Update(T* z, int64_t vocab, G&& g) {
    Update<kReverse>(z, z, vocab, g);
  }

  // Update reading each pack from `src` and writing it to `dst` (which may
  // be `src`).
  template <bool kReverse, typename G>
  __device__ static void Update(const T* src, T* dst, int64_t vocab, G&& g) {
    const uint64_t policy = L2EvictFirst();
    const int64_t first = threadIdx.x * int64_t{P};
    if (first >= vocab) return;
    const int64_t last = first + (vocab - 1 - first) / kStride * kStride;
    const int64_t step = kReverse ? -kStride : kStride;
    int64_t pos = kReverse ? last : first;
    int64_t packs = (last - first) / kStride + 1;
    for (; packs >= 2; packs -= 2, pos += 2 * step) {
      float a[P], b[P];
      Load(src, pos, a, policy);
      Load(src, pos + step, b, policy);
      g(pos, a);
      g(pos + step, b);
      Store(dst, pos, a, policy);
      Store(dst, pos + step, b, policy);
    }
    if (packs == 1) {
      float a[P];
      Load(src, pos, a, policy);
      g(pos, a);
      Store(dst, pos, a, policy);
    }
  }
};

constexpr float kLog2e = 1.4426950408889634f;

// exp(x) as exp2: one multiply and the special-function unit, flushing
// subnormal results to zero (exp2f's subnormal path costs three more
// instructions an element). The two-pass kernels take x <= 0: a probability
// under 2^-126 is nothing beside the row's sum, which is at least 1, and its
// gradient term is under 2^-126 of the row's scale. The one-pass kernel
// also takes x up to its guard (OnePassRowsKernel), where the result is as
// accurate.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float FastExp(float x) { return FastExp2(x * kLog2e); }

// exp(x − offset) given offset_log2 = offset·log2(e), in one FMA and the
// special-function unit (the rounding of offset_log2 scales every result of
// a row by the same factor, within 2⁻²² for offsets under 64).
__device__ __forceinline__ float FastExpFrom(float x, float offset_log2) {
  return FastExp2(fmaf(x, kLog2e, -offset_log2));
}

// The gradient of a plain row's loss (no label smoothing, softcap or bias;
// row scale `scale`, target weight w_t, z-loss scale s): Coef()·p off the
// target (p = exp(z − lse), PlainOffTarget), AtTarget(p_t) on it, with
// p_t − 1 formed first in fp32. The row kernels and the fused dX GEMM's
// factors both form it here: they must agree bit for bit.
struct PlainGradient {
  float scale, wt, zc;  // zc = 2·s·lse

  __device__ __forceinline__ PlainGradient(float scale, float wt, float z_loss_scale, float lse)
      : scale(scale), wt(wt), zc(2.0f * z_loss_scale * lse) {}
  // scale·(w_t + 2·s·lse).
  __device__ __forceinline__ float Coef() const { return scale * (wt + zc); }
  // scale·(w_t·(p_t − 1) + 2·s·lse·p_t).
  __device__ __forceinline__ float AtTarget(float prob) const {
    return scale * (wt * (prob - 1.0f) + zc * prob);
  }
};

// A plain row's gradient off its target: coef·exp(z − lse).
__device__ __forceinline__ float PlainOffTarget(float coef, float z, float lse) {
  return coef * FastExp(z - lse);
}

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_DEVICE_PRIMITIVES_CUH_
