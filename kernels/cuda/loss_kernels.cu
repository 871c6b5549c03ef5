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

  // Replaces each of this thread's packs by g(first index, values), last
  // pack first: the block read the row front to back just before, so its
  // tail is what the L2 cache still holds. Reads and writes are evict-first:
  // nothing reads the row again before the GEMMs stream the whole chunk.
  template <typename G>
  __device__ static void UpdateBackwards(T* z, int64_t vocab, G&& g) {
    const uint64_t policy = L2EvictFirst();
    const int64_t first = threadIdx.x * int64_t{P};
    if (first >= vocab) return;
    int64_t last = first + (vocab - 1 - first) / kStride * kStride;
    for (; last - kStride >= first; last -= 2 * kStride) {
      float a[P], b[P];
      Load(z, last, a, policy);
      Load(z, last - kStride, b, policy);
      g(last, a);
      g(last - kStride, b);
      Store(z, last, a, policy);
      Store(z, last - kStride, b, policy);
    }
    if (last >= first) {
      float a[P];
      Load(z, last, a, policy);
      g(last, a);
      Store(z, last, a, policy);
    }
  }
};

// Overwrites a row of logits with its scaled gradient (zeros for an ignored
// row). Each element is read and written by the same thread.
constexpr float kLog2e = 1.4426950408889634f;

// exp(x) for x <= 0 as exp2: one multiply and the special-function unit,
// flushing subnormal results to zero (exp2f's subnormal path costs three
// more instructions an element; a probability under 2^-126 is nothing
// beside the row's sum, which is at least 1, and its gradient term is
// under 2^-126 of the row's scale).
__device__ __forceinline__ float ExpNonPositive(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2e));
  return y;
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
    Packs::UpdateBackwards(z, p.cols, [](int64_t, float (&x)[Packs::P]) {
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
    Packs::UpdateBackwards(z, p.cols, [&](int64_t, float (&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) x[k] = c * ExpNonPositive(x[k] - lse);
    });
    __syncthreads();
    const int64_t local_t = LocalColumn(p, t);
    if (threadIdx.x == 0 && local_t >= 0) {
      const float prob = ExpNonPositive(zt - lse);
      z[local_t] = FromFloatDev<T>(scale * (wt * (prob - 1.0f) + zc * prob));
    }
  } else {
    Packs::UpdateBackwards(z, p.cols, [&](int64_t j0, float (&x)[Packs::P]) {
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
      s.sum *= ExpNonPositive(s.max - m);
      s.max = m;
      s.argmax = j0 + k;
    }
    // A NaN or +inf logit turns the sum into NaN (below), which marks the row.
#pragma unroll
    for (int k = 0; k < Packs::P; ++k) s.sum += ExpNonPositive(x[k] - s.max);
    if (!kPlain && p.label_smoothing > 0.0f) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) {
        weighted_z += (p.class_weight != nullptr ? p.class_weight[j0 + k] : 1.0f) * x[k];
      }
    }
  });
  nan = isnan(s.sum);
  s = BlockCombine(s, shared_state);
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
