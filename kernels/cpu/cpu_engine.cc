#include "kernels/cpu/cpu_engine.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/buffer_pool.h"
#include "kernels/cpu/cpu_gemm.h"
#include "kernels/cpu/vector_exp.h"
#include "kernels/status_macros.h"

namespace flce {
namespace {

// ---------------------------------------------------------------------------
// The problem in fp32, prepared once per call.

struct Prepared {
  // v: the weight's rows, which are the vocabulary ids [first, first + v)
  // of a vocabulary of full_v (first 0 and full_v = v unless a shard).
  int64_t n = 0, h = 0, v = 0;
  int64_t first = 0, full_v = 0;
  bool shard = false;
  DType dtype = DType::kFloat32;
  // The GEMMs' operand dtype (CpuGemm::OperandDType): bf16 where the CPU
  // multiplies it natively, else fp32 (X chunks and W widened).
  DType gemm_dtype = DType::kFloat32;
  TensorView hidden;
  const void* w = nullptr;          // [V, H] in gemm_dtype
  PooledBuffer w_storage;           // w when widened from bf16/fp16
  std::vector<float> bias;          // [V] or empty
  std::vector<float> class_weight;  // [full_v] or empty (all 1)
  float class_weight_sum = 0;       // over the whole vocabulary
  std::vector<int64_t> target;      // [N], ids of the whole vocabulary
  LossOptions options;
  // Divisor of the reduction: sum of class weights over valid rows (mean),
  // 1 otherwise.
  double denom = 1.0;
  int64_t num_valid = 0;

  bool valid(int64_t row) const { return target[row] != options.ignore_index; }
  float weight_of(int64_t cls) const { return class_weight.empty() ? 1.0f : class_weight[cls]; }
  // The class weight of the weight's row j.
  float column_weight(int64_t j) const {
    return class_weight.empty() ? 1.0f : class_weight[first + j];
  }
  // The row's target as a row of the weight, or -1 where it is another
  // shard's (or ignored).
  int64_t local_target(int64_t row) const {
    if (!valid(row)) return -1;
    const int64_t t = target[row] - first;
    return t >= 0 && t < v ? t : -1;
  }
};

Prepared Prepare(const LossProblem& p, const CpuGemm& gemm, BufferPool& pool) {
  Prepared q;
  q.n = p.rows();
  q.h = p.hidden_size();
  q.v = p.vocab();
  q.shard = p.shard.has_value();
  q.first = p.shard ? p.shard->first : 0;
  q.full_v = p.full_vocab();
  q.dtype = p.hidden.dtype;
  q.hidden = p.hidden;
  q.options = p.options;
  q.gemm_dtype = gemm.OperandDType(p.weight.dtype);
  if (p.weight.dtype == q.gemm_dtype) {
    q.w = p.weight.data;
  } else {
    q.w_storage = pool.Take(q.v * q.h);
    ToFloat(p.weight.dtype, p.weight.data, q.v * q.h, q.w_storage.data());
    q.w = q.w_storage.data();
  }
  if (p.bias) {
    q.bias.resize(q.v);
    ToFloat(p.bias->dtype, p.bias->data, q.v, q.bias.data());
  }
  if (p.class_weight) {
    q.class_weight.resize(q.full_v);
    ToFloat(DType::kFloat32, p.class_weight->data, q.full_v, q.class_weight.data());
    double sum = 0;
    for (float w : q.class_weight) sum += w;
    q.class_weight_sum = static_cast<float>(sum);
  } else {
    q.class_weight_sum = static_cast<float>(q.full_v);
  }
  q.target.resize(q.n);
  for (int64_t i = 0; i < q.n; ++i) {
    q.target[i] = p.target.dtype == DType::kInt32 ? static_cast<const int32_t*>(p.target.data)[i]
                                                  : static_cast<const int64_t*>(p.target.data)[i];
  }
  double weight_sum = 0;
  for (int64_t i = 0; i < q.n; ++i) {
    if (!q.valid(i)) continue;
    ++q.num_valid;
    weight_sum += q.weight_of(q.target[i]);
  }
  q.denom = p.options.reduction == Reduction::kMean ? weight_sum : 1.0;
  return q;
}

// ---------------------------------------------------------------------------
// Row math.
//
// For one row of logits z (length V, fp32, already X·Wᵀ), with target t,
// class weights w (1 without), smoothing ε, z-loss scale s and softcap c:
//   z' = z + b, then c·tanh(z'/c) when softcapped   (in place)
//   lse = m + log Σ exp(z'_j − m), m = max z'
//   loss = (1−ε)·w_t·(lse − z'_t) + ε/V·(Σw·lse − Σ w_j z'_j) + s·lse²
//   dz'_j = (1−ε)·w_t·(p_j − δ_jt) + ε/V·(Σw·p_j − w_j) + 2·s·lse·p_j
//   dz_j  = g · dz'_j · (1 − (z'_j/c)²)   (the last factor only with softcap)
// The gradient overwrites the logits in place. Each row reads and writes its
// V floats two or three times (max, sum-exp, gradient); ignored rows are
// zeroed.

struct RowStats {
  float lse = 0;
  double loss = 0;
  double z_loss = 0;
  bool correct = false;
};

// Adds the bias and applies the softcap in place.
void TransformLogits(const Prepared& q, float* z) {
  if (!q.bias.empty()) {
    for (int64_t j = 0; j < q.v; ++j) z[j] += q.bias[j];
  }
  if (q.options.logit_softcap) {
    const float c = *q.options.logit_softcap;
    const float inv_c = 1.0f / c;
    for (int64_t j = 0; j < q.v; ++j) z[j] = c * std::tanh(z[j] * inv_c);
  }
}

// Writes the gradient of row `row` (scaled by g) over z. With `exp_in_z`,
// z holds exp(z'_j − m) and `inv_sum` = 1/Σ; otherwise z holds z' and the
// probabilities are exp(z'_j − lse).
void WriteRowGradient(const Prepared& q, int64_t row, float lse, float g, bool exp_in_z,
                      float inv_sum, float* z) {
  if (!q.valid(row)) {
    std::fill(z, z + q.v, 0.0f);
    return;
  }
  // The target's column, where it is among the weight's rows (always but
  // for a shard that holds another part of the vocabulary).
  const int64_t t = q.local_target(row);
  const float eps = q.options.label_smoothing;
  const float wt = q.weight_of(q.target[row]);
  const float smooth = eps / static_cast<float>(q.full_v);
  // Coefficient of p_j in dz'_j.
  const float a =
      (1.0f - eps) * wt + smooth * q.class_weight_sum + 2.0f * q.options.z_loss_scale * lse;
  const bool softcap = q.options.logit_softcap.has_value();
  const float inv_c = softcap ? 1.0f / *q.options.logit_softcap : 0.0f;
  const bool weighted = !q.class_weight.empty();
  // The target column: p_t − 1 formed in fp32 before anything else.
  float d_t = 0.0f;
  if (t >= 0) {
    const float p_t = exp_in_z ? z[t] * inv_sum : std::exp(z[t] - lse);
    d_t = (1.0f - eps) * wt * (p_t - 1.0f) + smooth * (q.class_weight_sum * p_t - wt) +
          2.0f * q.options.z_loss_scale * lse * p_t;
    if (softcap) {
      const float u = z[t] * inv_c;
      d_t *= 1.0f - u * u;
    }
  }
  for (int64_t j = 0; j < q.v; ++j) {
    const float p = exp_in_z ? z[j] * inv_sum : std::exp(z[j] - lse);
    float d = a * p - smooth * (weighted ? q.column_weight(j) : 1.0f);
    if (softcap) {
      const float u = z[j] * inv_c;
      d *= 1.0f - u * u;
    }
    z[j] = g * d;
  }
  if (t >= 0) z[t] = g * d_t;
}

// Forward over one row: statistics, and the gradient in place when g is set.
RowStats ForwardRow(const Prepared& q, int64_t row, const float* g, float* z) {
  TransformLogits(q, z);
  RowStats stats;
  float m = -std::numeric_limits<float>::infinity();
  int64_t argmax = 0;
  bool has_nan = false;
  for (int64_t j = 0; j < q.v; ++j) {
    if (z[j] > m) {
      m = z[j];
      argmax = j;
    }
    has_nan |= std::isnan(z[j]);
  }
  if (has_nan) m = std::numeric_limits<float>::quiet_NaN();
  const bool valid = q.valid(row);
  const int64_t t = valid ? q.target[row] : 0;
  const float z_t = z[t];
  const float eps = q.options.label_smoothing;
  double weighted_z = 0;  // Σ w_j z'_j, only needed with smoothing
  if (valid && eps > 0) {
    if (q.class_weight.empty()) {
      for (int64_t j = 0; j < q.v; ++j) weighted_z += z[j];
    } else {
      for (int64_t j = 0; j < q.v; ++j) weighted_z += q.class_weight[j] * z[j];
    }
  }
  // Storing exp in place saves the gradient pass an exp, but the softcap
  // derivative needs z', so softcapped rows recompute exp instead.
  const bool exp_in_z = g != nullptr && !q.options.logit_softcap && valid;
  const double sum = ShiftedExpSum(z, q.v, m, /*store=*/exp_in_z);
  stats.lse = m + static_cast<float>(std::log(sum));
  if (valid) {
    const double lse = stats.lse;
    const double wt = q.weight_of(t);
    stats.z_loss = q.options.z_loss_scale * lse * lse;
    stats.loss = (1.0 - eps) * wt * (lse - z_t) +
                 eps / q.full_v * (q.class_weight_sum * lse - weighted_z) + stats.z_loss;
    stats.correct = argmax == t;
  }
  if (g != nullptr) {
    WriteRowGradient(q, row, stats.lse, *g, exp_in_z, static_cast<float>(1.0 / sum), z);
  }
  return stats;
}

// A shard's statistics of one row (see ShardStats): m_s, S_s, t_s, q_s and
// the argmax, from z after the bias and softcap (which it applies in place).
struct ShardRowStats {
  float max = 0, sum_exp = 0, target_logit = 0, weighted_sum = 0;
  int64_t argmax = 0;  // a column of the weight
};

ShardRowStats ShardRow(const Prepared& q, int64_t row, float* z) {
  TransformLogits(q, z);
  ShardRowStats s;
  float m = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  for (int64_t j = 0; j < q.v; ++j) {
    if (z[j] > m) {
      m = z[j];
      s.argmax = j;
    }
    has_nan |= std::isnan(z[j]);
  }
  if (has_nan) m = std::numeric_limits<float>::quiet_NaN();
  const double sum = ShiftedExpSum(z, q.v, m, /*store=*/false);
  s.max = m;
  s.sum_exp = static_cast<float>(sum);
  const int64_t t = q.local_target(row);
  if (t >= 0) s.target_logit = z[t];
  if (q.options.label_smoothing > 0) {
    double weighted = 0;
    for (int64_t j = 0; j < q.v; ++j) weighted += q.column_weight(j) * z[j];
    s.weighted_sum = static_cast<float>(weighted);
  }
  return s;
}

// ---------------------------------------------------------------------------
// The chunk loop.

enum class Pass {
  kLoss,         // loss only
  kLossAndGrad,  // loss and gradients (STORE_GRADS forward)
  kGradFromLse,  // gradients from lse (RECOMPUTE backward; a shard's backward)
  kShardStats,   // a shard's per-row statistics (its forward)
};

struct LoopIO {
  const float* lse_in = nullptr;  // [N], for kGradFromLse
  float* lse_out = nullptr;       // [N], for the forward passes

  double* row_loss = nullptr;  // [N]
  double* row_z_loss = nullptr;
  int64_t num_correct = 0;
  // Per-row upstream scale (already divided by the reduction's divisor).
  const float* row_scale = nullptr;  // [N]
  float* dx = nullptr;               // [N, H] fp32, overwritten
  float* dw = nullptr;               // [V, H] fp32, overwritten
  float* db = nullptr;               // [V] fp32, overwritten, or null

  // kShardStats: [N] each, and (a shard's STORE_GRADS) z' of every row
  // [N, V] when `logits_out` is set.
  ShardRowStats* shard_rows = nullptr;
  float* logits_out = nullptr;
  // kGradFromLse: z' of every row [N, V] instead of computing it (a shard
  // that kept them), or null.
  const float* logits_in = nullptr;
};

absl::Status RunChunks(const Prepared& q, int64_t chunk_rows, Pass pass, const CancelFn& cancelled,
                       CpuGemm& gemm, BufferPool& pool, LoopIO& io) {
  const int64_t n = q.n, h = q.h, v = q.v;
  const bool grad = pass == Pass::kLossAndGrad || pass == Pass::kGradFromLse;
  if (grad && n == 0) {
    // No chunk will write dW and db.
    std::fill(io.dw, io.dw + v * h, 0.0f);
    if (io.db) std::fill(io.db, io.db + v, 0.0f);
  }
  const int64_t max_rows = std::min(chunk_rows, n);
  const DType operands = q.gemm_dtype;
  PooledBuffer logits = pool.Take(max_rows * v);
  // X's rows widened to fp32 for fp32 GEMMs of another dtype's inputs.
  PooledBuffer x_chunk;
  if (q.dtype != operands) x_chunk = pool.Take(max_rows * h);
  // The chunk's gradient rounded to bf16 for bf16 GEMMs (as PyTorch's and
  // the CUDA engine's: the dX and dW GEMMs take it in the input dtype).
  PooledBuffer dz_narrow;
  const bool narrow = grad && operands != DType::kFloat32;
  if (narrow) dz_narrow = pool.Take((max_rows * v + 1) / 2);
  uint16_t* dz16 = narrow ? reinterpret_cast<uint16_t*>(dz_narrow.data()) : nullptr;
  const std::vector<float> ones(grad && io.db ? chunk_rows : 0, 1.0f);
  for (int64_t r0 = 0; r0 < n; r0 += chunk_rows) {
    if (cancelled && cancelled()) {
      return absl::CancelledError("cancelled between chunks");
    }
    const int64_t rows = std::min(chunk_rows, n - r0);
    const char* x_rows = static_cast<const char*>(q.hidden.data) + r0 * h * DTypeSize(q.dtype);
    const void* x = x_rows;
    if (q.dtype != operands) {
      ToFloat(q.dtype, x_rows, rows * h, x_chunk.data());
      x = x_chunk.data();
    }
    if (io.logits_in != nullptr) {
      // The kept z' (bias and softcap applied) instead of X·Wᵀ.
      std::memcpy(logits.data(), io.logits_in + r0 * v,
                  static_cast<size_t>(rows * v) * sizeof(float));
    } else {
      // logits[rows, V] = X_c[rows, H] · Wᵀ  (W is [V, H] row-major, read
      // transposed with leading dimension H).
      FLCE_RETURN_IF_ERROR(gemm.Multiply(operands, rows, v, h, {x, h, Transpose::kNo},
                                         {q.w, h, Transpose::kYes}, logits.data(), v,
                                         /*accumulate=*/false));
    }
    int64_t correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : correct)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = r0 + r;
      float* z = logits.data() + r * v;
      if (pass == Pass::kGradFromLse) {
        if (io.logits_in == nullptr) TransformLogits(q, z);
        // p = exp(z' − lse), in place but where the softcap's derivative
        // needs z' itself.
        const bool exp_in_z = !q.options.logit_softcap && q.valid(row);
        if (exp_in_z) ShiftedExpSum(z, v, io.lse_in[row], /*store=*/true);
        WriteRowGradient(q, row, io.lse_in[row], io.row_scale[row], exp_in_z, 1.0f, z);
        if (narrow) FromFloat(operands, z, v, dz16 + r * v);  // (the row is in cache)
        continue;
      }
      if (pass == Pass::kShardStats) {
        io.shard_rows[row] = ShardRow(q, row, z);
        if (io.logits_out != nullptr) {
          std::memcpy(io.logits_out + row * v, z, static_cast<size_t>(v) * sizeof(float));
        }
        continue;
      }
      const RowStats s = ForwardRow(q, row, grad ? &io.row_scale[row] : nullptr, z);
      if (narrow) FromFloat(operands, z, v, dz16 + r * v);
      io.lse_out[row] = s.lse;
      io.row_loss[row] = s.loss;
      io.row_z_loss[row] = s.z_loss;
      correct += s.correct ? 1 : 0;
    }
    io.num_correct += correct;
    if (!grad) continue;
    const void* dz = narrow ? static_cast<const void*>(dz16) : logits.data();
    // dX_c[rows, H] = dZ[rows, V] · W[V, H].
    FLCE_RETURN_IF_ERROR(gemm.Multiply(operands, rows, h, v, {dz, v, Transpose::kNo},
                                       {q.w, h, Transpose::kNo}, io.dx + r0 * h, h,
                                       /*accumulate=*/false));
    // dW[V, H] (+)= dZᵀ · X_c: dZ is [rows, V] row-major, read transposed.
    // The first chunk overwrites, so dW needs no zeroing pass.
    FLCE_RETURN_IF_ERROR(gemm.Multiply(operands, v, h, rows, {dz, v, Transpose::kYes},
                                       {x, h, Transpose::kNo}, io.dw, h,
                                       /*accumulate=*/r0 != 0));
    if (io.db) {
      // db[V] (+)= dZᵀ · 1, from the fp32 gradient.
      cblas_sgemv(CblasRowMajor, CblasTrans, rows, v, 1.0f, logits.data(), v, ones.data(), 1,
                  r0 == 0 ? 0.0f : 1.0f, io.db, 1);
    }
  }
  return absl::OkStatus();
}

// A new tensor of `shape` holding src × scale rounded once to `dtype`, in
// blocks on the OpenMP threads.
HostTensor ScaledCopy(const float* src, std::vector<int64_t> shape, float scale, DType dtype) {
  HostTensor out(dtype, std::move(shape));
  const int64_t count = out.num_elements();
  char* dst = &out.data[0];
  const int64_t elem = DTypeSize(dtype);
  constexpr int64_t kBlock = 1 << 16;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; i += kBlock) {
    const int64_t m = std::min(kBlock, count - i);
    if (scale == 1.0f) {
      FromFloat(dtype, src + i, m, dst + i * elem);
      continue;
    }
    float buffer[4096];
    for (int64_t j = 0; j < m; j += 4096) {
      const int64_t b = std::min<int64_t>(4096, m - j);
      for (int64_t k = 0; k < b; ++k) buffer[k] = src[i + j + k] * scale;
      FromFloat(dtype, buffer, b, dst + (i + j) * elem);
    }
  }
  return out;
}

// An fp32 sum that becomes a result tensor. For an fp32 result it lives in
// the result's own memory, handed over without a copy; for a bf16 or fp16
// result in warm workspace reused from call to call, rounded into a result
// of half the bytes: fresh memory's page faults cost more than the copy on
// the machines measured (bench/RESULTS.md).
class GradientSum {
 public:
  GradientSum() = default;
  GradientSum(std::vector<int64_t> shape, DType result, BufferPool& pool) : shape_(shape) {
    if (result == DType::kFloat32) {
      tensor_ = HostTensor(DType::kFloat32, std::move(shape));
    } else {
      buffer_ = pool.Take(NumElements(shape_));
    }
  }
  float* data() { return tensor_.data.empty() ? buffer_.data() : tensor_.mutable_data<float>(); }
  int64_t bytes() const { return NumElements(shape_) * 4; }

  // The sum × scale in `dtype`; `last`: the sum is not needed again.
  HostTensor Result(float scale, DType dtype, bool last) {
    if (last && dtype == DType::kFloat32 && !tensor_.data.empty()) {
      if (scale != 1.0f) {
        float* f = tensor_.mutable_data<float>();
        const int64_t count = tensor_.num_elements();
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < count; ++i) f[i] *= scale;
      }
      return std::move(tensor_);
    }
    return ScaledCopy(data(), shape_, scale, dtype);
  }

 private:
  std::vector<int64_t> shape_;
  HostTensor tensor_;
  PooledBuffer buffer_;
};

HostTensor FloatTensor(std::vector<int64_t> shape) {
  return HostTensor(DType::kFloat32, std::move(shape));
}

// ---------------------------------------------------------------------------
// Saved states.

// STORE_GRADS: the gradients for grad_output = 1, as fp32 sums whose
// results are expected in the inputs' dtype.
class StoredGradients : public SavedState {
 public:
  DType dtype = DType::kFloat32;  // of the inputs
  GradientSum dx, dw;
  std::optional<GradientSum> db;
  int64_t bytes() const override { return dx.bytes() + dw.bytes() + (db ? db->bytes() : 0); }
};

// RECOMPUTE: the inputs (own copies) and per-row lse.
class RecomputeInputs : public SavedState {
 public:
  OwnedProblem inputs;
  std::vector<float> lse;
  int64_t bytes() const override {
    return inputs.bytes() + static_cast<int64_t>(lse.size() * sizeof(float));
  }
};

// A vocabulary shard's: the inputs (own copies) and, for STORE_GRADS (the
// reference's high-performance mode), every row's z' [N, V_s], so Backward
// skips the logits GEMM; for RECOMPUTE (memory-saving), not.
class ShardInputs : public SavedState {
 public:
  OwnedProblem inputs;
  std::vector<float> logits;
  int64_t bytes() const override {
    return inputs.bytes() + static_cast<int64_t>(logits.size() * sizeof(float));
  }
};

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "cpu";
}

absl::Status OutOfMemory(const LossProblem& p, const char* where) {
  return absl::ResourceExhaustedError(absl::StrCat("CPU engine: out of host memory in ", where,
                                                   " for N=", p.rows(), " H=", p.hidden_size(),
                                                   " V=", p.vocab()));
}

}  // namespace

CpuEngine::CpuEngine(CpuEngineOptions options)
    : options_(options),
      pool_(std::make_unique<BufferPool>(options.workspace_cache_bytes)),
      gemm_(std::make_unique<CpuGemm>(options.bf16_gemms, options.onednn_fp32)) {}

CpuEngine::~CpuEngine() = default;

std::vector<DeviceInfo> CpuEngine::devices() const {
  DeviceInfo info;
  info.name = absl::StrCat(CpuModelName(), " (", omp_get_max_threads(), " threads; bf16 GEMMs in ",
                           gemm_->OperandDType(DType::kBFloat16) == DType::kBFloat16 ? "bf16"
                                                                                      : "fp32",
                           ")");
  return {info};
}

int64_t CpuEngine::ChunkRows(int64_t rows, int64_t vocab, int64_t hidden) const {
  // The chunk's fp32 logits and its fp32 copy of X share the budget; the
  // rows go in chunks of even size (one GEMM shape, no small last chunk).
  const int64_t by_budget = options_.chunk_bytes / ((vocab + hidden) * int64_t{4});
  const int64_t most = std::max(kMinChunkRows, by_budget);
  if (rows <= most) return std::max<int64_t>(1, rows);
  const int64_t chunks = (rows + most - 1) / most;
  return (rows + chunks - 1) / chunks;
}

int64_t CpuEngine::SavedStateBytes(const LossProblem& p, BackwardMode mode) const {
  const int64_t n = p.rows(), h = p.hidden_size(), v = p.vocab();
  if (p.shard) {
    const int64_t elem = DTypeSize(p.hidden.dtype);
    return (n * h + v * h + (p.bias ? v : 0)) * elem + n * DTypeSize(p.target.dtype) +
           (p.class_weight ? p.full_vocab() * 4 : 0) +
           (mode == BackwardMode::kStoreGrads ? n * v * 4 : 0);
  }
  if (mode == BackwardMode::kStoreGrads) {
    return (n * h + v * h + (p.bias ? v : 0)) * int64_t{4};
  }
  const int64_t elem = DTypeSize(p.hidden.dtype);
  return (n * h + v * h + (p.bias ? v : 0)) * elem + n * DTypeSize(p.target.dtype) + n * 4 +
         (p.class_weight ? v * 4 : 0);
}

absl::StatusOr<ForwardResult> CpuEngine::Forward(const LossProblem& problem,
                                                 const ForwardSpec& spec,
                                                 const CancelFn& cancelled) {
  FLCE_RETURN_IF_ERROR(RequireHostMemory(problem));
  try {
    return ForwardImpl(problem, spec, cancelled);
  } catch (const std::bad_alloc&) {
    return OutOfMemory(problem, "Forward");
  }
}

absl::StatusOr<Gradients> CpuEngine::Backward(SavedState& state, const BackwardSpec& spec,
                                              const CancelFn& cancelled) {
  try {
    absl::StatusOr<Gradients> grads = BackwardImpl(state, spec, cancelled);
    if (grads.ok()) FLCE_RETURN_IF_ERROR(WriteToHostDestinations(spec, *grads));
    return grads;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "CPU engine: out of host memory in Backward (session state ", state.bytes(), " bytes)"));
  }
}

absl::StatusOr<ForwardResult> CpuEngine::ShardForward(const LossProblem& problem,
                                                      const ForwardSpec& spec,
                                                      const CancelFn& cancelled) {
  const Prepared q = Prepare(problem, *gemm_, *pool_);
  const int64_t n = q.n;
  const bool store = spec.need_backward && spec.mode == BackwardMode::kStoreGrads;
  std::vector<ShardRowStats> rows(n);
  std::unique_ptr<ShardInputs> saved;
  LoopIO io;
  io.shard_rows = rows.data();
  if (spec.need_backward) {
    saved = std::make_unique<ShardInputs>();
    if (store) {
      saved->logits.resize(static_cast<size_t>(n * q.v));
      io.logits_out = saved->logits.data();
    }
  }
  FLCE_RETURN_IF_ERROR(
      RunChunks(q, ChunkRows(n, q.v, q.h), Pass::kShardStats, cancelled, *gemm_, *pool_, io));
  ForwardResult result;
  result.num_valid = q.num_valid;
  ShardStats stats;
  stats.max = FloatTensor({n});
  stats.sum_exp = FloatTensor({n});
  stats.target_logit = FloatTensor({n});
  stats.argmax = HostTensor(DType::kInt64, {n});
  if (q.options.label_smoothing > 0) stats.weighted_logit_sum = FloatTensor({n});
  for (int64_t i = 0; i < n; ++i) {
    stats.max.mutable_data<float>()[i] = rows[i].max;
    stats.sum_exp.mutable_data<float>()[i] = rows[i].sum_exp;
    stats.target_logit.mutable_data<float>()[i] = rows[i].target_logit;
    stats.argmax.mutable_data<int64_t>()[i] = q.first + rows[i].argmax;
    if (stats.weighted_logit_sum) {
      stats.weighted_logit_sum->mutable_data<float>()[i] = rows[i].weighted_sum;
    }
  }
  result.shard_stats = std::move(stats);
  if (saved != nullptr) {
    saved->inputs = CopyProblem(problem);
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<ForwardResult> CpuEngine::ForwardImpl(const LossProblem& problem,
                                                     const ForwardSpec& spec,
                                                     const CancelFn& cancelled) {
  if (problem.shard) return ShardForward(problem, spec, cancelled);
  const Prepared q = Prepare(problem, *gemm_, *pool_);
  const int64_t n = q.n;
  const bool store = spec.need_backward && spec.mode == BackwardMode::kStoreGrads;
  if (store && q.options.reduction == Reduction::kNone) {
    return absl::InternalError("STORE_GRADS with reduction none");
  }
  std::vector<float> lse(n);
  std::vector<double> row_loss(n), row_z(n);
  std::vector<float> scale;
  LoopIO io;
  io.lse_out = lse.data();
  io.row_loss = row_loss.data();
  io.row_z_loss = row_z.data();
  std::unique_ptr<StoredGradients> grads;
  if (store) {
    scale.assign(n, static_cast<float>(1.0 / q.denom));
    grads = std::make_unique<StoredGradients>();
    grads->dtype = q.dtype;
    grads->dx = GradientSum({n, q.h}, q.dtype, *pool_);
    grads->dw = GradientSum({q.v, q.h}, q.dtype, *pool_);
    if (!q.bias.empty()) grads->db.emplace(std::vector<int64_t>{q.v}, q.dtype, *pool_);
    io.row_scale = scale.data();
    io.dx = grads->dx.data();
    io.dw = grads->dw.data();
    io.db = grads->db ? grads->db->data() : nullptr;
  }
  absl::Status status =
      RunChunks(q, ChunkRows(n, q.v, q.h), store ? Pass::kLossAndGrad : Pass::kLoss, cancelled,
                *gemm_, *pool_, io);
  if (!status.ok()) return status;

  ForwardResult result;
  result.num_valid = q.num_valid;
  result.num_correct = io.num_correct;
  if (q.options.reduction == Reduction::kNone) {
    result.loss = FloatTensor({n});
    result.z_loss = FloatTensor({n});
    for (int64_t i = 0; i < n; ++i) {
      result.loss.mutable_data<float>()[i] = static_cast<float>(row_loss[i]);
      result.z_loss.mutable_data<float>()[i] = static_cast<float>(row_z[i]);
    }
  } else {
    double total = 0, z_total = 0;
    for (int64_t i = 0; i < n; ++i) {
      total += row_loss[i];
      z_total += row_z[i];
    }
    result.loss = FloatTensor({});
    result.z_loss = FloatTensor({});
    // mean over zero valid rows is 0/0 = NaN, as in PyTorch.
    result.loss.mutable_data<float>()[0] = static_cast<float>(total / q.denom);
    result.z_loss.mutable_data<float>()[0] = static_cast<float>(z_total / q.denom);
  }
  if (spec.want_lse) {
    result.lse = FloatTensor({n});
    if (n > 0) std::memcpy(result.lse->mutable_data<float>(), lse.data(), n * sizeof(float));
  }
  if (spec.want_per_row_loss) {
    result.per_row_loss = FloatTensor({n});
    for (int64_t i = 0; i < n; ++i) {
      result.per_row_loss->mutable_data<float>()[i] = static_cast<float>(row_loss[i]);
    }
  }
  if (store) {
    result.saved = std::move(grads);
  } else if (spec.need_backward) {
    auto saved = std::make_unique<RecomputeInputs>();
    saved->inputs = CopyProblem(problem);
    saved->lse = std::move(lse);
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<Gradients> CpuEngine::BackwardImpl(SavedState& state, const BackwardSpec& spec,
                                                  const CancelFn& cancelled) {
  std::vector<float> grad_output;
  if (spec.grad_output) grad_output = TensorToFloats(*spec.grad_output);
  Gradients out;
  const bool shard_state = dynamic_cast<const ShardInputs*>(&state) != nullptr;
  if (!shard_state && (spec.global_lse || spec.grad_hidden_addend)) {
    return absl::InvalidArgumentError(
        "global_lse, grad_hidden_addend: for a vocabulary shard's session only");
  }

  if (auto* stored = dynamic_cast<StoredGradients*>(&state)) {
    const DType dtype = spec.hidden_dtype(stored->dtype);
    const DType wdtype = spec.weight_dtype(stored->dtype);
    const float g = grad_output.empty() ? 1.0f : grad_output[0];
    // (The state is dropped after a last use; dW and db after their last.)
    const bool weights_last = spec.last_use || spec.weight_grads_last_use;
    if (!spec.weight_grads_only) out.grad_hidden = stored->dx.Result(g, dtype, spec.last_use);
    if (!spec.hidden_grad_only) {
      out.grad_weight = stored->dw.Result(g, wdtype, weights_last);
      if (stored->db) out.grad_bias = stored->db->Result(g, wdtype, weights_last);
    }
    return out;
  }

  const OwnedProblem* inputs = nullptr;
  const float* lse = nullptr;
  const float* logits = nullptr;
  std::vector<float> global_lse;
  if (const auto* recompute = dynamic_cast<const RecomputeInputs*>(&state)) {
    inputs = &recompute->inputs;
    lse = recompute->lse.data();
  } else if (const auto* shard = dynamic_cast<const ShardInputs*>(&state)) {
    if (!spec.global_lse) {
      return absl::InvalidArgumentError("global_lse: required by a vocabulary shard's session");
    }
    inputs = &shard->inputs;
    const int64_t rows = inputs->hidden.shape[0], h = inputs->hidden.shape[1];
    if (spec.global_lse->num_elements() != rows) {
      return absl::InvalidArgumentError(absl::StrCat("global_lse: expected [", rows, "] values"));
    }
    if (spec.grad_hidden_addend && (spec.grad_hidden_addend->dtype != DType::kFloat32 ||
                                    spec.grad_hidden_addend->space != MemorySpace::kHost ||
                                    spec.grad_hidden_addend->num_elements() != rows * h)) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_hidden_addend: must be fp32 [", rows, ", ", h, "] in host memory"));
    }
    global_lse = TensorToFloats(*spec.global_lse);
    lse = global_lse.data();
    if (!shard->logits.empty()) logits = shard->logits.data();
  } else {
    return absl::InternalError("saved state was not made by the CPU engine");
  }
  const Prepared q = Prepare(inputs->view(), *gemm_, *pool_);
  const int64_t n = q.n;
  std::vector<float> scale(n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad_output.empty()       ? 1.0
                     : grad_output.size() == 1 ? grad_output[0]
                                               : grad_output[i];
    scale[i] = static_cast<float>(g / q.denom);
  }
  // fp32 sums, rounded once into the results.
  const DType dx_dtype = spec.hidden_dtype(q.dtype), w_dtype = spec.weight_dtype(q.dtype);
  GradientSum dx({n, q.h}, dx_dtype, *pool_), dw({q.v, q.h}, w_dtype, *pool_);
  std::optional<GradientSum> db;
  if (!q.bias.empty()) db.emplace(std::vector<int64_t>{q.v}, w_dtype, *pool_);
  LoopIO io;
  io.lse_in = lse;
  io.logits_in = logits;
  io.row_scale = scale.data();
  io.dx = dx.data();
  io.dw = dw.data();
  io.db = db ? db->data() : nullptr;
  absl::Status status =
      RunChunks(q, ChunkRows(n, q.v, q.h), Pass::kGradFromLse, cancelled, *gemm_, *pool_, io);
  if (!status.ok()) return status;
  // Computed together; only what was asked for is kept.
  if (!spec.weight_grads_only) {
    if (spec.grad_hidden_addend) {
      if (spec.grad_hidden_addend_ready) FLCE_RETURN_IF_ERROR(spec.grad_hidden_addend_ready());
      const float* add = static_cast<const float*>(spec.grad_hidden_addend->data);
      float* sum = dx.data();
      for (int64_t i = 0; i < n * q.h; ++i) sum[i] += add[i];
    }
    out.grad_hidden = dx.Result(1.0f, dx_dtype, /*last=*/true);
  }
  if (!spec.hidden_grad_only) {
    out.grad_weight = dw.Result(1.0f, w_dtype, /*last=*/true);
    if (db) out.grad_bias = db->Result(1.0f, w_dtype, /*last=*/true);
  }
  return out;
}

}  // namespace flce
