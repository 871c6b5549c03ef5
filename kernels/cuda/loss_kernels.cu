// The CUDA engine's row kernels. See loss_kernels.h for what each computes.

#include "kernels/cuda/loss_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <algorithm>
#include <cstdint>

namespace flce {
namespace internal_cuda {
namespace {

constexpr int kRowThreads = 1024;
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

__device__ float BlockSum(float v, float* shared) {
  return BlockReduce(v, shared, 0.0f, [](float a, float b) { return a + b; });
}

// The maximum, ignoring NaNs (fmaxf).
__device__ float BlockMax(float v, float* shared) {
  return BlockReduce(v, shared, -CUDART_INF_F, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ bool BlockAny(bool v) { return __syncthreads_or(v ? 1 : 0) != 0; }

// ---------------------------------------------------------------------------
// The row kernel.

// "Plain" rows: no bias, softcap, class weights or label smoothing (z-loss
// allowed). The kernels are compiled for them separately (kPlain), with the
// per-element work those options cost left out.
bool IsPlain(const RowParams& p) {
  return p.bias == nullptr && p.softcap <= 0.0f && p.class_weight == nullptr &&
         p.label_smoothing == 0.0f;
}

// z' = softcap(z + b).
template <bool kPlain>
__device__ __forceinline__ float Transform(const RowParams& p, float z, int64_t j) {
  if constexpr (kPlain) return z;
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

// L2 eviction priorities for the row kernels' 16-byte accesses. The
// statistics pass marks what it reads evict-last when the gradient pass will
// read it again, so other blocks' streaming traffic (their gradient passes'
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
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(ptr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
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
    const uint64_t policy = L2EvictFirst();
    const int64_t first = threadIdx.x * int64_t{P};
    if (first >= vocab) return;
    const int64_t last = first + (vocab - 1 - first) / kStride * kStride;
    const int64_t step = kReverse ? -kStride : kStride;
    int64_t pos = kReverse ? last : first;
    int64_t packs = (last - first) / kStride + 1;
    for (; packs >= 2; packs -= 2, pos += 2 * step) {
      float a[P], b[P];
      Load(z, pos, a, policy);
      Load(z, pos + step, b, policy);
      g(pos, a);
      g(pos + step, b);
      Store(z, pos, a, policy);
      Store(z, pos + step, b, policy);
    }
    if (packs == 1) {
      float a[P];
      Load(z, pos, a, policy);
      g(pos, a);
      Store(z, pos, a, policy);
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

// The target's position among the row's given columns, or -1.
__device__ __forceinline__ int64_t LocalColumn(const RowParams& p, int64_t t) {
  return t >= p.col0 && t < p.col0 + p.cols ? t - p.col0 : -1;
}

// Overwrites a row of logits (its columns [col0, col0 + cols)) with its
// scaled gradient (zeros for an ignored row). Each element is read and
// written by the same thread. zt, the target's logit as read before the
// call, is needed by thread 0 only, and only when the target is a given
// column.
template <typename T, bool kVec, bool kPlain>
__device__ void WriteGradientRow(const RowParams& p, T* z, int64_t t, bool valid, float wt,
                                 float lse, float scale, float zt) {
  using Packs = RowPacks<T, kVec>;
  if (!valid) {
    Packs::template Update<true>(z, p.cols, [](int64_t, float (&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) x[k] = 0.0f;
    });
    return;
  }
  if constexpr (kPlain) {
    // Gradient() without the options: (w_t + 2·s·lse)·p off the target;
    // the target element, (w_t·(p_t − 1) + 2·s·lse·p_t) with p_t − 1 first
    // as there, is written by thread 0 once the block is done.
    const float zc = 2.0f * p.z_loss_scale * lse;
    const float c = scale * (wt + zc);
    Packs::template Update<true>(z, p.cols, [&](int64_t, float (&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) x[k] = c * FastExp(x[k] - lse);
    });
    __syncthreads();
    const int64_t local_t = LocalColumn(p, t);
    if (threadIdx.x == 0 && local_t >= 0) {
      const float prob = FastExp(zt - lse);
      z[local_t] = FromFloatDev<T>(scale * (wt * (prob - 1.0f) + zc * prob));
    }
  } else {
    Packs::template Update<true>(z, p.cols, [&](int64_t j0, float (&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) {
        const int64_t j = p.col0 + j0 + k;
        x[k] = scale * Gradient(p, Transform<false>(p, x[k], j), j, t, wt, lse);
      }
    });
  }
}

// One block per row: statistics, the row's loss outputs, and with
// kWriteGrad the gradient in place. Reads the row twice, writes it once.
// Plain rows run two blocks per multiprocessor (32 registers a thread, so
// enough loads stay in flight: one block per multiprocessor with more loads
// each measured slower, bench/RESULTS.md); the options' kernels may take
// more registers than that.
template <typename T, bool kVec, bool kWriteGrad, bool kPlain>
__global__ void __launch_bounds__(kRowThreads, kPlain ? 2 : 1)
    ForwardRowsKernel(RowParams p, T* logits, const float* row_scale, RowOutputs out) {
  __shared__ SoftmaxState shared_state[kWarps];
  __shared__ float shared_sum[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  T* z = logits + r * p.vocab;  // whole rows: cols = V, col0 = 0
  const int64_t t = p.target[row];
  const bool valid = t != p.ignore_index;

  SoftmaxState s{-CUDART_INF_F, 0.0f, INT64_MAX};
  float weighted_z = 0.0f;  // Σ w_j z'_j, for label smoothing
  bool nan = false;
  using Packs = RowPacks<T, kVec>;
  Packs::template ForEach<kWriteGrad>(z, p.vocab, [&](int64_t j0, float (&x)[Packs::P]) {
    // The pack's maximum first (one rescale per pack); its index only when
    // it is a new running maximum (first index on ties), which is rare.
    float m = -CUDART_INF_F;
#pragma unroll
    for (int k = 0; k < Packs::P; ++k) {
      x[k] = Transform<kPlain>(p, x[k], j0 + k);
      m = fmaxf(m, x[k]);
    }
    if (m > s.max) {
      int k = 0;
      while (k + 1 < Packs::P && x[k] != m) ++k;
      s.sum *= FastExp(s.max - m);
      s.max = m;
      s.argmax = j0 + k;
    }
    // A NaN or +inf logit turns the sum into NaN (below), which marks the row.
#pragma unroll
    for (int k = 0; k < Packs::P; ++k) s.sum += FastExp(x[k] - s.max);
    if (!kPlain && p.label_smoothing > 0.0f) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) {
        weighted_z += (p.class_weight != nullptr ? p.class_weight[j0 + k] : 1.0f) * x[k];
      }
    }
  });
  nan = isnan(s.sum);
  s = BlockCombine<true>(s, shared_state);
  if (p.label_smoothing > 0.0f) weighted_z = BlockSum(weighted_z, shared_sum);
  nan = BlockAny(nan);
  const float lse = nan ? CUDART_NAN_F : s.max + logf(s.sum);
  const float wt = valid ? (p.class_weight != nullptr ? p.class_weight[t] : 1.0f) : 0.0f;

  float zt = 0.0f;  // the target's logit, on thread 0
  if (threadIdx.x == 0) {
    out.lse[row] = lse;
    if (valid) {
      zt = Transform<kPlain>(p, ToFloatDev(z[t]), t);
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
    WriteGradientRow<T, kVec, kPlain>(p, z, t, valid, wt, lse, row_scale[row], zt);
  }
}

template <typename T, bool kVec, bool kPlain>
__global__ void __launch_bounds__(kRowThreads, kPlain ? 2 : 1)
    GradientRowsKernel(RowParams p, T* logits, const float* lse, const float* row_scale) {
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  const int64_t t = p.target[row];
  const bool valid = t != p.ignore_index;
  const float wt = valid ? (p.class_weight != nullptr ? p.class_weight[t] : 1.0f) : 0.0f;
  T* z = logits + r * p.cols;
  float zt = 0.0f;  // the target's logit, on thread 0 (when it is a given column)
  const int64_t local_t = LocalColumn(p, t);
  if (kPlain && valid && threadIdx.x == 0 && local_t >= 0) zt = ToFloatDev(z[local_t]);
  __syncthreads();  // read before the row is overwritten
  WriteGradientRow<T, kVec, kPlain>(p, z, t, valid, wt, lse[row], row_scale[row], zt);
}

// ---------------------------------------------------------------------------
// The one-pass row kernel (deferred normalisation).

// The guard on the one-pass row sum S = Σ exp(z' − m̂): at most 2^64, so
// every written u ≤ S, the dX GEMM's fp32 sums of u·w and the row factor
// a = scale·(w_t + 2·s·lse)/S stay far from fp32's range limits.
constexpr float kMaxOnePassSum = 0x1p64f;

// One block per row without label smoothing, each logit read once. With
// z' = softcap(z + b) (ForwardRowsKernel's Transform), the block first
// takes m̂, the maximum of z' over the row's first tile (each thread's
// first pack; the pass reads it again from L2), then streams the row once:
// u_j = exp(z'_j − m̂), S = Σ u_j, the true maximum and its first index,
// and in place of z_j the value u_j·d_j, d_j = 1 − (z'_j/c)² the softcap's
// chain factor (1 without one). Then lse = m̂ + log S and the row's loss
// outputs as ForwardRowsKernel gives them. The gradient is a·u_j·d_j off the
// target, with the row factor
//   a = scale·(w_t + 2·s·lse) / S
// (w_t: the target's class weight; s: the z-loss scale)
// written to row_factor[row] (0 for an ignored row, whose logits become
// zeros) for the chunk's GEMMs to apply: dX rows are scaled after the dX
// GEMM, X rows before the dW GEMM, bias gradient terms in the weighted
// column sums. The target element is rewritten as
// g_t / a = d_t·(u_t − w_t·S/(w_t + 2·s·lse)), formed in fp32 (p_t − 1
// without cancellation in the input dtype). Since m̂ ≤ max z', u's largest
// value is at least 1 and nothing the row's sum would notice underflows
// (bf16 has fp32's exponent range; fp16's is too narrow, so fp16 stays
// two-pass). A row whose sum exceeds kMaxOnePassSum (a logit ~44 nats above
// its first tile's maximum) or is not finite (NaN or inf logits), or whose
// factor is not finite or is zero while its target term is not, sets
// *redo: the caller runs the whole call again with the two-pass kernel.
// kPlain: no bias, softcap or class weights (compiled without their
// per-element work, two blocks per multiprocessor as the two-pass kernels).
template <typename T, bool kPlain>
__global__ void __launch_bounds__(kRowThreads, kPlain ? 2 : 1)
    OnePassRowsKernel(RowParams p, T* logits, const float* row_scale, RowOutputs out,
                      float* row_factor, int32_t* redo) {
  __shared__ SoftmaxState shared_state[kWarps];
  __shared__ float shared_max[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  T* z = logits + r * p.vocab;
  const int64_t t = p.target[row];
  const bool valid = t != p.ignore_index;
  const bool softcap = !kPlain && p.softcap > 0.0f;
  using Packs = RowPacks<T, true>;

  float zt = 0.0f;  // the target's z', on thread 0
  if (threadIdx.x == 0 && valid) zt = Transform<kPlain>(p, ToFloatDev(z[t]), t);
  float m = -CUDART_INF_F;
  const int64_t first = threadIdx.x * int64_t{Packs::P};
  if (first < p.vocab) {
    float x[Packs::P];
    Packs::Load(z, first, x, L2EvictLast());
#pragma unroll
    for (int k = 0; k < Packs::P; ++k) m = fmaxf(m, Transform<kPlain>(p, x[k], first + k));
  }
  // Its barriers also order thread 0's read of z[t] before any store.
  const float offset = BlockMax(m, shared_max);
  const float offset_log2 = offset * kLog2e;

  SoftmaxState s{-CUDART_INF_F, 0.0f, INT64_MAX};  // sum relative to offset
  Packs::template Update<false>(z, p.vocab, [&](int64_t j0, float (&x)[Packs::P]) {
    // Each element is used once, as soon as it is converted.
    float pm = -CUDART_INF_F;
    int pk = 0;
#pragma unroll
    for (int k = 0; k < Packs::P; ++k) {
      const float zp = Transform<kPlain>(p, x[k], j0 + k);
      if (zp > pm) {
        pm = zp;
        pk = k;
      }
      float u = FastExpFrom(zp, offset_log2);
      s.sum += u;
      if (softcap) {
        const float q = zp / p.softcap;
        u *= 1.0f - q * q;
      }
      x[k] = valid ? u : 0.0f;
    }
    if (pm > s.max) {
      s.max = pm;
      s.argmax = j0 + pk;
    }
  });
  s = BlockCombine<false>(s, shared_state);
  const float lse = offset + logf(s.sum);
  const float zc = 2.0f * p.z_loss_scale * lse;
  const float wt = valid ? (!kPlain && p.class_weight != nullptr ? p.class_weight[t] : 1.0f)
                         : 0.0f;
  if (threadIdx.x == 0) {
    out.lse[row] = lse;
    bool ok = s.sum <= kMaxOnePassSum;  // false for NaN
    if (valid) {
      const float z_row = p.z_loss_scale * lse * lse;
      out.loss[row] = wt * (lse - zt) + z_row;
      out.z_loss[row] = z_row;
      out.correct[row] = s.argmax == t ? 1 : 0;
      const float factor = row_scale[row] * (wt + zc) / s.sum;
      ok = ok && isfinite(factor) && (factor != 0.0f || wt == 0.0f);
      row_factor[row] = factor;
    } else {
      out.loss[row] = 0.0f;
      out.z_loss[row] = 0.0f;
      out.correct[row] = 0;
      row_factor[row] = 0.0f;
    }
    if (!ok) *redo = 1;
  }
  if (valid && wt != 0.0f) {
    __syncthreads();  // every thread's packs are written
    if (threadIdx.x == 0) {
      float target = FastExpFrom(zt, offset_log2) - wt * s.sum / (wt + zc);
      if (softcap) {
        const float q = zt / p.softcap;
        target *= 1.0f - q * q;
      }
      z[t] = FromFloatDev<T>(target);
    }
  }
}

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

// Blocks of `threads` covering `count` elements (grid x allows 2³¹ − 1).
unsigned int Blocks(int64_t count, int threads) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > INT32_MAX ? INT32_MAX : blocks));
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
          reinterpret_cast<const Quad<Src>*>(src), reinterpret_cast<Quad<Dst>*>(dst), quads,
          scale);
    }
    done = quads * 4;
  }
  if (done < count) {
    ConvertKernel<<<Blocks(count - done, 256), 256, 0, stream>>>(src + done, dst + done,
                                                                 count - done, scale);
  }
}

template <typename Src>
cudaError_t ConvertFrom(const Src* src, void* dst, DType dst_dtype, int64_t count, float scale,
                        cudaStream_t stream) {
  switch (dst_dtype) {
    case DType::kFloat32:
      ConvertTo(src, static_cast<float*>(dst), count, scale, stream);
      break;
    case DType::kFloat16:
      ConvertTo(src, static_cast<__half*>(dst), count, scale, stream);
      break;
    case DType::kBFloat16:
      ConvertTo(src, static_cast<__nv_bfloat16*>(dst), count, scale, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// One block of kRowThreads per row.
template <typename Kernel, typename... Args>
cudaError_t LaunchRows(Kernel kernel, int64_t rows, cudaStream_t stream, Args... args) {
  kernel<<<static_cast<unsigned int>(rows), kRowThreads, 0, stream>>>(args...);
  return cudaGetLastError();
}

template <typename T, bool kVec, bool kPlain>
cudaError_t ForwardRowsWith(const RowParams& p, T* z, bool write_grad, const float* row_scale,
                            const RowOutputs& out, cudaStream_t stream) {
  auto kernel = write_grad ? ForwardRowsKernel<T, kVec, true, kPlain>
                           : ForwardRowsKernel<T, kVec, false, kPlain>;
  return LaunchRows(kernel, p.rows, stream, p, z, row_scale, out);
}

template <typename T>
cudaError_t ForwardRowsFor(const RowParams& p, void* logits, bool write_grad,
                           const float* row_scale, const RowOutputs& out, cudaStream_t stream) {
  T* z = static_cast<T*>(logits);
  if (p.vocab % kPack<T> == 0) {
    return IsPlain(p) ? ForwardRowsWith<T, true, true>(p, z, write_grad, row_scale, out, stream)
                      : ForwardRowsWith<T, true, false>(p, z, write_grad, row_scale, out, stream);
  }
  return IsPlain(p) ? ForwardRowsWith<T, false, true>(p, z, write_grad, row_scale, out, stream)
                    : ForwardRowsWith<T, false, false>(p, z, write_grad, row_scale, out, stream);
}

template <typename T>
cudaError_t GradientRowsFor(const RowParams& p, void* logits, const float* lse,
                            const float* row_scale, cudaStream_t stream) {
  T* z = static_cast<T*>(logits);
  const bool vec = p.cols % kPack<T> == 0;
  auto kernel = vec ? (IsPlain(p) ? GradientRowsKernel<T, true, true>
                                  : GradientRowsKernel<T, true, false>)
                    : (IsPlain(p) ? GradientRowsKernel<T, false, true>
                                  : GradientRowsKernel<T, false, false>);
  return LaunchRows(kernel, p.rows, stream, p, z, lse, row_scale);
}

}  // namespace

cudaError_t LaunchForwardRows(const RowParams& p, void* logits, DType dtype, bool write_grad,
                              const float* row_scale, const RowOutputs& out,
                              cudaStream_t stream) {
  if (p.col0 != 0 || p.cols != p.vocab) return cudaErrorInvalidValue;
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
  if (p.col0 < 0 || p.cols < 0 || p.col0 + p.cols > p.vocab) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
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

bool OnePassRowsSupported(const RowParams& p, DType dtype) {
  if (p.col0 != 0 || p.cols != p.vocab || p.label_smoothing != 0.0f) return false;
  switch (dtype) {
    case DType::kFloat32:
      return p.vocab % kPack<float> == 0;
    case DType::kBFloat16:
      return p.vocab % kPack<__nv_bfloat16> == 0;
    default:
      return false;
  }
}

template <typename T>
cudaError_t OnePassRowsFor(const RowParams& p, void* logits, const float* row_scale,
                           const RowOutputs& out, float* row_factor, int32_t* redo,
                           cudaStream_t stream) {
  auto kernel = IsPlain(p) ? OnePassRowsKernel<T, true> : OnePassRowsKernel<T, false>;
  return LaunchRows(kernel, p.rows, stream, p, static_cast<T*>(logits), row_scale, out,
                    row_factor, redo);
}

cudaError_t LaunchOnePassRows(const RowParams& p, void* logits, DType dtype,
                              const float* row_scale, const RowOutputs& out, float* row_factor,
                              int32_t* redo, cudaStream_t stream) {
  if (!OnePassRowsSupported(p, dtype)) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (dtype == DType::kFloat32) {
    return OnePassRowsFor<float>(p, logits, row_scale, out, row_factor, redo, stream);
  }
  return OnePassRowsFor<__nv_bfloat16>(p, logits, row_scale, out, row_factor, redo, stream);
}

cudaError_t LaunchScaleRows(const void* src, void* dst, DType dtype, const float* factor,
                            int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  const unsigned int blocks = static_cast<unsigned int>(rows);
  switch (dtype) {
    case DType::kFloat32:
      ScaleRowsKernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(src),
                                                  static_cast<float*>(dst), factor, cols);
      break;
    case DType::kFloat16:
      ScaleRowsKernel<<<blocks, 256, 0, stream>>>(static_cast<const __half*>(src),
                                                  static_cast<__half*>(dst), factor, cols);
      break;
    case DType::kBFloat16:
      ScaleRowsKernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(src),
                                                  static_cast<__nv_bfloat16*>(dst), factor, cols);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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
                             int64_t ld, const float* row_weight, bool accumulate, float* db,
                             cudaStream_t stream) {
  const unsigned int blocks = Blocks(vocab, 256);
  switch (grad_dtype) {
    case DType::kFloat32:
      ColumnSumsKernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(grad), rows, vocab,
                                                   ld, row_weight, accumulate, db);
      break;
    case DType::kFloat16:
      ColumnSumsKernel<<<blocks, 256, 0, stream>>>(static_cast<const __half*>(grad), rows,
                                                   vocab, ld, row_weight, accumulate, db);
      break;
    case DType::kBFloat16:
      ColumnSumsKernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(grad),
                                                   rows, vocab, ld, row_weight, accumulate, db);
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

__global__ void AccumulateKernel(const float* src, float* dst, int64_t count, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] += src[i] * scale;
  }
}

cudaError_t LaunchAccumulate(const float* src, float* dst, int64_t count, float scale,
                             cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  AccumulateKernel<<<Blocks(count, 256), 256, 0, stream>>>(src, dst, count, scale);
  return cudaGetLastError();
}

cudaError_t LaunchWidenTargets(const int32_t* src, int64_t count, int64_t* dst,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  WidenTargetsKernel<<<Blocks(count, 256), 256, 0, stream>>>(src, count, dst);
  return cudaGetLastError();
}

cudaError_t LaunchHashMatrix(const void* c, int elem_bytes, int64_t m, int64_t n, int64_t ld,
                             unsigned long long* hash, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (ld < m) return cudaErrorInvalidValue;
  const unsigned int blocks = std::min(Blocks(m * n, 256), 8192u);
  switch (elem_bytes) {
    case 2:
      HashMatrixKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(c), m, n, ld,
                                                   hash);
      break;
    case 4:
      HashMatrixKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(c), m, n, ld,
                                                   hash);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace internal_cuda
}  // namespace flce
