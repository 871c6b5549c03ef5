// The CUDA engine's fused row kernels. See row_kernels.h for what each
// computes.

#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/logit_gradient.h"
#include "kernels/cuda/row_kernels.h"

namespace flce {
namespace internal_cuda {
namespace {

// "Plain" rows: no bias, softcap, class weights or label smoothing (z-loss
// allowed). The kernels are compiled for them separately (kPlain), with the
// per-element work those options cost left out.
bool IsPlain(const RowParams& p) {
  return p.bias == nullptr && p.softcap <= 0.0f && p.class_weight == nullptr &&
         p.label_smoothing == 0.0f;
}

// The class weight of vocabulary id t (1 without class weights).
__device__ __forceinline__ float ClassWeight(const RowParams& p, int64_t t) {
  return p.class_weight != nullptr ? p.class_weight[t] : 1.0f;
}

// z' = softcap(z + b).
template <bool kPlain>
__device__ __forceinline__ float Transform(const RowParams& p, float z, int64_t j) {
  if constexpr (kPlain) return z;
  if (p.bias != nullptr) z += p.bias[j];
  if (p.softcap > 0.0f) z = p.softcap * tanhf(z / p.softcap);
  return z;
}

// Gradient of the row loss w.r.t. the logit of vocabulary id j (before the
// softcap chain factor):
//   (1−ε)·w_t·(p − δ_jt) + ε/V·(Σw·p − w_j) + 2·s·lse·p, then × (1 − (z'/c)²),
// V the whole vocabulary.
__device__ __forceinline__ float Gradient(const RowParams& p, float zp, int64_t j, int64_t t,
                                          float wt, float lse) {
  const float prob = expf(zp - lse);
  const float smooth = p.label_smoothing / static_cast<float>(p.full_vocab);
  const float wj = p.class_weight != nullptr ? p.class_weight[j] : 1.0f;
  float d;
  if (j == t) {
    // p_t − 1 first, in fp32.
    d = (1.0f - p.label_smoothing) * wt * (prob - 1.0f) +
        smooth * (p.class_weight_sum * prob - wj) + 2.0f * p.z_loss_scale * lse * prob;
  } else {
    d = ((1.0f - p.label_smoothing) * wt + smooth * p.class_weight_sum +
         2.0f * p.z_loss_scale * lse) *
            prob -
        smooth * wj;
  }
  if (p.softcap > 0.0f) {
    const float u = zp / p.softcap;
    d *= 1.0f - u * u;
  }
  return d;
}

// The target's position among the row's given columns, or -1.
__device__ __forceinline__ int64_t LocalColumn(const RowParams& p, int64_t t) {
  const int64_t j = t - p.first;
  return j >= p.col0 && j < p.col0 + p.cols ? j - p.col0 : -1;
}

// One pack of a whole row (its columns j0 … j0 + P − 1) into the row's
// online statistics: z' = Transform in place in x, the running maximum and
// its first index (the pack's maximum first, one rescale per pack; its
// index only when it is a new running maximum, which is rare), the sum
// relative to it (a NaN or +inf logit turns it into NaN, which marks the
// row), and with label smoothing Σ w_j z'_j (the class weights of the
// vocabulary ids first + j).
template <bool kPlain, int P>
__device__ __forceinline__ void AddPack(const RowParams& p, int64_t j0, float (&x)[P],
                                        SoftmaxState& s, float& weighted_z) {
  float m = -CUDART_INF_F;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    x[k] = Transform<kPlain>(p, x[k], j0 + k);
    m = fmaxf(m, x[k]);
  }
  if (m > s.max) {
    int k = 0;
    while (k + 1 < P && x[k] != m) ++k;
    s.sum *= FastExp(s.max - m);
    s.max = m;
    s.argmax = j0 + k;
  }
#pragma unroll
  for (int k = 0; k < P; ++k) s.sum += FastExp(x[k] - s.max);
  if (!kPlain && p.label_smoothing > 0.0f) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      weighted_z += (p.class_weight != nullptr ? p.class_weight[p.first + j0 + k] : 1.0f) * x[k];
    }
  }
}

// Writes a row's scaled gradient (zeros for an ignored row) over its
// columns [col0, col0 + cols) at z, from its logits at src (which may be
// z). Each element is read and written by the same thread. zt, the
// target's logit as read before the call, is needed by thread 0 only, and
// only when the target is a given column.
template <typename T, bool kVec, bool kPlain>
__device__ void WriteGradientRow(const RowParams& p, const T* src, T* z, int64_t t, bool valid,
                                 float wt, float lse, float scale, float zt) {
  using Packs = RowPacks<T, kVec>;
  if (!valid) {
    Packs::template Update<true>(src, z, p.cols, [](int64_t, float(&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) x[k] = 0.0f;
    });
    return;
  }
  if constexpr (kPlain) {
    // Gradient() without the options: (w_t + 2·s·lse)·p off the target;
    // the target element, (w_t·(p_t − 1) + 2·s·lse·p_t) with p_t − 1 first
    // as there, is written by thread 0 once the block is done.
    const PlainGradient g(scale, wt, p.z_loss_scale, lse);
    const float c = g.Coef();
    Packs::template Update<true>(src, z, p.cols, [&](int64_t, float(&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) x[k] = PlainOffTarget(c, x[k], lse);
    });
    __syncthreads();
    const int64_t local_t = LocalColumn(p, t);
    if (threadIdx.x == 0 && local_t >= 0) {
      z[local_t] = FromFloatDev<T>(g.AtTarget(FastExp(zt - lse)));
    }
  } else {
    Packs::template Update<true>(src, z, p.cols, [&](int64_t j0, float(&x)[Packs::P]) {
#pragma unroll
      for (int k = 0; k < Packs::P; ++k) {
        const int64_t j = p.col0 + j0 + k;
        x[k] = scale * Gradient(p, Transform<false>(p, x[k], j), p.first + j, t, wt, lse);
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
  Packs::template ForEach<kWriteGrad>(z, p.vocab, [&](int64_t j0, float(&x)[Packs::P]) {
    AddPack<kPlain>(p, j0, x, s, weighted_z);
  });
  nan = isnan(s.sum);
  s = BlockCombine<true>(s, shared_state);
  if (p.label_smoothing > 0.0f) weighted_z = BlockSum(weighted_z, shared_sum);
  nan = BlockAny(nan);
  const float lse = nan ? CUDART_NAN_F : s.max + logf(s.sum);
  const float wt = valid ? ClassWeight(p, t) : 0.0f;

  float zt = 0.0f;  // the target's logit, on thread 0
  if (threadIdx.x == 0) {
    out.lse[row] = lse;
    if (valid) {
      zt = Transform<kPlain>(p, ToFloatDev(z[t]), t);
      const float z_row = p.z_loss_scale * lse * lse;
      const float eps = p.label_smoothing;
      out.loss[row] = (1.0f - eps) * wt * (lse - zt) +
                      eps / static_cast<float>(p.vocab) * (p.class_weight_sum * lse - weighted_z) +
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
    WriteGradientRow<T, kVec, kPlain>(p, z, z, t, valid, wt, lse, row_scale[row], zt);
  }
}

template <typename T, bool kVec, bool kPlain>
__global__ void __launch_bounds__(kRowThreads, kPlain ? 2 : 1)
    GradientRowsKernel(RowParams p, const T* src, int64_t src_stride, T* logits, const float* lse,
                       const float* row_scale) {
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  const int64_t t = p.target[row];
  const bool valid = t != p.ignore_index;
  const float wt = valid ? ClassWeight(p, t) : 0.0f;
  T* z = logits + r * p.cols;
  const T* from = src + r * src_stride;
  float zt = 0.0f;  // the target's logit, on thread 0 (when it is a given column)
  const int64_t local_t = LocalColumn(p, t);
  if (kPlain && valid && threadIdx.x == 0 && local_t >= 0) zt = ToFloatDev(from[local_t]);
  __syncthreads();  // read before the row is overwritten
  WriteGradientRow<T, kVec, kPlain>(p, from, z, t, valid, wt, lse[row], row_scale[row], zt);
}

// A shard's statistics, one block per whole row: ForwardRowsKernel's
// online maximum and sum (first index on ties), the target's z' where the
// target is the shard's, and Σ w_j z'_j with label smoothing. Reads the row
// once.
template <typename T, bool kVec, bool kPlain>
__global__ void __launch_bounds__(kRowThreads, kPlain ? 2 : 1)
    ShardStatsKernel(RowParams p, const T* logits, ShardRowOutputs out) {
  __shared__ SoftmaxState shared_state[kWarps];
  __shared__ float shared_sum[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t row = p.row0 + r;
  const T* z = logits + r * p.vocab;
  const int64_t t = p.target[row];
  const bool smoothing = !kPlain && p.label_smoothing > 0.0f;

  SoftmaxState s{-CUDART_INF_F, 0.0f, INT64_MAX};
  float weighted_z = 0.0f;
  using Packs = RowPacks<T, kVec>;
  Packs::template ForEach<false>(z, p.vocab, [&](int64_t j0, float(&x)[Packs::P]) {
    AddPack<kPlain>(p, j0, x, s, weighted_z);
  });
  // A NaN z' (or +inf, whose exp(inf − inf) is NaN) makes the row's sum NaN.
  const bool nan = BlockAny(isnan(s.sum));
  s = BlockCombine<true>(s, shared_state);
  if (smoothing) weighted_z = BlockSum(weighted_z, shared_sum);
  if (threadIdx.x == 0) {
    out.max[row] = nan ? CUDART_NAN_F : s.max;
    out.sum_exp[row] = nan ? CUDART_NAN_F : s.sum;
    const int64_t local_t = t != p.ignore_index ? t - p.first : -1;
    out.target_logit[row] = local_t >= 0 && local_t < p.vocab
                                ? Transform<kPlain>(p, ToFloatDev(z[local_t]), local_t)
                                : 0.0f;
    if (out.weighted_sum != nullptr) out.weighted_sum[row] = weighted_z;
    out.argmax[row] = p.first + (s.argmax == INT64_MAX ? 0 : s.argmax);
  }
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
  Packs::template Update<false>(z, p.vocab, [&](int64_t j0, float(&x)[Packs::P]) {
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
  const float wt = valid ? (!kPlain && p.class_weight != nullptr ? p.class_weight[t] : 1.0f) : 0.0f;
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

// Whether rows of `cols` elements at `data` with row stride `stride` all
// start 16-byte aligned.
template <typename T>
bool Aligned16(const void* data, int64_t cols, int64_t stride) {
  return cols % kPack<T> == 0 && stride % kPack<T> == 0 &&
         reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

template <typename T>
cudaError_t GradientRowsFor(const RowParams& p, const void* src, int64_t src_stride, void* logits,
                            const float* lse, const float* row_scale, cudaStream_t stream) {
  T* z = static_cast<T*>(logits);
  const bool vec = Aligned16<T>(logits, p.cols, p.cols) && Aligned16<T>(src, p.cols, src_stride);
  auto kernel =
      vec ? (IsPlain(p) ? GradientRowsKernel<T, true, true> : GradientRowsKernel<T, true, false>)
          : (IsPlain(p) ? GradientRowsKernel<T, false, true> : GradientRowsKernel<T, false, false>);
  return LaunchRows(kernel, p.rows, stream, p, static_cast<const T*>(src), src_stride, z, lse,
                    row_scale);
}

template <typename T>
cudaError_t ShardStatsFor(const RowParams& p, const void* logits, const ShardRowOutputs& out,
                          cudaStream_t stream) {
  const bool vec = Aligned16<T>(logits, p.vocab, p.vocab);
  auto kernel =
      vec ? (IsPlain(p) ? ShardStatsKernel<T, true, true> : ShardStatsKernel<T, true, false>)
          : (IsPlain(p) ? ShardStatsKernel<T, false, true> : ShardStatsKernel<T, false, false>);
  return LaunchRows(kernel, p.rows, stream, p, static_cast<const T*>(logits), out);
}

// Whole rows of a whole vocabulary.
bool WholeVocabulary(const RowParams& p) {
  return p.col0 == 0 && p.cols == p.vocab && p.first == 0 && p.full_vocab == p.vocab;
}

template <typename T>
cudaError_t OnePassRowsFor(const RowParams& p, void* logits, const float* row_scale,
                           const RowOutputs& out, float* row_factor, int32_t* redo,
                           cudaStream_t stream) {
  auto kernel = IsPlain(p) ? OnePassRowsKernel<T, true> : OnePassRowsKernel<T, false>;
  return LaunchRows(kernel, p.rows, stream, p, static_cast<T*>(logits), row_scale, out, row_factor,
                    redo);
}

// One thread per row: LaunchGradientFactors.
template <typename T>
__global__ void GradientFactorsKernel(RowParams p, const T* logits, int64_t src_stride,
                                      const float* lse, const float* row_scale, float* coef,
                                      int32_t* column, float* target) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= p.rows) return;
  const int64_t row = p.row0 + r;
  const int64_t t = p.target[row];
  if (t == p.ignore_index) {
    coef[r] = 0.0f;
    column[r] = LogitGradient::kIgnoredRow;
    target[r] = 0.0f;
    return;
  }
  // As WriteGradientRow's plain rows.
  const PlainGradient g(row_scale[row], ClassWeight(p, t), p.z_loss_scale, lse[row]);
  coef[r] = g.Coef();
  const int64_t local_t = LocalColumn(p, t);
  column[r] = static_cast<int32_t>(local_t);
  target[r] = local_t >= 0
                  ? g.AtTarget(FastExp(ToFloatDev(logits[r * src_stride + local_t]) - lse[row]))
                  : 0.0f;
}

}  // namespace

bool FusedGradientSupported(const RowParams& p) {
  return p.bias == nullptr && p.softcap <= 0.0f && p.label_smoothing == 0.0f;
}

cudaError_t LaunchGradientFactors(const RowParams& p, const void* logits, int64_t src_stride,
                                  DType dtype, const float* lse, const float* row_scale,
                                  float* coef, int32_t* column, float* target,
                                  cudaStream_t stream) {
  if (!FusedGradientSupported(p) || p.col0 < 0 || p.cols < 0 || p.col0 + p.cols > p.vocab ||
      p.cols >= (int64_t{1} << 31) || src_stride < p.cols) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const unsigned blocks = static_cast<unsigned>((p.rows + kThreads - 1) / kThreads);
  return FLCE_DISPATCH_FLOAT_DTYPE(dtype, T, [&] {
    GradientFactorsKernel<T><<<blocks, kThreads, 0, stream>>>(
        p, static_cast<const T*>(logits), src_stride, lse, row_scale, coef, column, target);
    return cudaGetLastError();
  });
}

cudaError_t LaunchForwardRows(const RowParams& p, void* logits, DType dtype, bool write_grad,
                              const float* row_scale, const RowOutputs& out, cudaStream_t stream) {
  if (!WholeVocabulary(p)) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  return FLCE_DISPATCH_FLOAT_DTYPE(
      dtype, T, [&] { return ForwardRowsFor<T>(p, logits, write_grad, row_scale, out, stream); });
}

cudaError_t LaunchGradientRows(const RowParams& p, void* logits, DType dtype, const float* lse,
                               const float* row_scale, cudaStream_t stream) {
  return LaunchGradientRowsFrom(p, logits, p.cols, logits, dtype, lse, row_scale, stream);
}

cudaError_t LaunchGradientRowsFrom(const RowParams& p, const void* src, int64_t src_stride,
                                   void* logits, DType dtype, const float* lse,
                                   const float* row_scale, cudaStream_t stream) {
  if (p.col0 < 0 || p.cols < 0 || p.col0 + p.cols > p.vocab || src_stride < p.cols) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  return FLCE_DISPATCH_FLOAT_DTYPE(dtype, T, [&] {
    return GradientRowsFor<T>(p, src, src_stride, logits, lse, row_scale, stream);
  });
}

cudaError_t LaunchShardStats(const RowParams& p, const void* logits, DType dtype,
                             const ShardRowOutputs& out, cudaStream_t stream) {
  if (p.col0 != 0 || p.cols != p.vocab) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  return FLCE_DISPATCH_FLOAT_DTYPE(dtype, T,
                                   [&] { return ShardStatsFor<T>(p, logits, out, stream); });
}

bool OnePassRowsSupported(const RowParams& p, DType dtype) {
  if (!WholeVocabulary(p) || p.label_smoothing != 0.0f) return false;
  // bf16 and fp32 only: fp16's exponent range is too narrow for deferred
  // normalisation (so no fp16 one-pass kernel is compiled).
  if (dtype == DType::kFloat32) return p.vocab % kPack<float> == 0;
  if (dtype == DType::kBFloat16) return p.vocab % kPack<__nv_bfloat16> == 0;
  return false;
}

cudaError_t LaunchOnePassRows(const RowParams& p, void* logits, DType dtype, const float* row_scale,
                              const RowOutputs& out, float* row_factor, int32_t* redo,
                              cudaStream_t stream) {
  if (!OnePassRowsSupported(p, dtype)) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (dtype == DType::kFloat32) {
    return OnePassRowsFor<float>(p, logits, row_scale, out, row_factor, redo, stream);
  }
  return OnePassRowsFor<__nv_bfloat16>(p, logits, row_scale, out, row_factor, redo, stream);
}

}  // namespace internal_cuda
}  // namespace flce
