#ifndef FLCE_KERNELS_LOSS_ENGINE_H_
#define FLCE_KERNELS_LOSS_ENGINE_H_

// The LossEngine interface: the math of flce behind plain structs, with no
// transport. An engine computes
//
//   z    = X @ W^T + b                         [N, V], fp32 accumulation
//   z'   = c * tanh(z / c)   (logit softcap, when set; else z' = z)
//   lse  = log(sum_j exp(z'_j))                 per row
//   row  = (1 - eps) * w[t] * (lse - z'_t)
//        + (eps / V) * sum_j w[j] * (lse - z'_j)
//        + s * lse^2                            (0 for rows with t = ignore_index)
//   loss = sum(row) / D (mean; D = sum of w[t] over valid rows), sum(row)
//          (sum) or row (none)
//
// with w the class weights (1 without), eps the label smoothing and s the
// z-loss scale: PyTorch's cross_entropy(weight, ignore_index, reduction,
// label_smoothing) plus the softcap and z-loss extensions. Backward returns
// dX, dW, db for an upstream gradient.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device_memory.h"
#include "kernels/tensor.h"

namespace flce {

enum class Reduction { kMean, kSum, kNone };
enum class BackwardMode { kAuto, kStoreGrads, kRecompute };

const char* ReductionName(Reduction reduction);
const char* BackwardModeName(BackwardMode mode);

struct LossOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  float label_smoothing = 0.0f;        // in [0, 1)
  std::optional<float> logit_softcap;  // > 0 when set
  float z_loss_scale = 0.0f;           // >= 0
};

// Vocabulary parallelism: the problem's weight (and bias) hold the rows
// [first, first + V_s) of a vocabulary of `full_vocab` ids, split over
// shards that each compute their part. The targets are ids of the whole
// vocabulary and the class weights are the whole vocabulary's ([full_vocab]),
// so every shard knows each row's target weight and the reduction's
// normaliser. A shard's Forward gives per-row statistics (ShardStats)
// instead of a loss; whoever holds every shard's combines them:
//   m = max_s m_s,  S = Σ_s S_s·exp(m_s − m),  lse = m + log S,
//   z'_t = Σ_s t_s,  Σ_j w_j z'_j = Σ_s q_s,
//   row = (1−ε)·w_t·(lse − z'_t) + ε/V·(Σw·lse − Σ_j w_j z'_j) + s·lse²
// (V the whole vocabulary), reduced as usual, and gives every shard's
// Backward the global lse (BackwardSpec::global_lse): the shard returns its
// part of dX (the shards' parts sum to dX) and its own rows of dW and db.
struct VocabShard {
  int64_t first = 0;
  int64_t full_vocab = 0;
};

// The problem. All views stay valid for the duration of the call.
// hidden and weight may be in MemorySpace::kCuda (the engine's device):
// an engine with a device reads them in place, and a saved state that
// reads them again in Backward (RECOMPUTE) holds `device_owner`, which must
// keep that memory alive (and unchanged: like autograd's saved tensors).
// REQUIRES (checked by the server's validation, not again here):
//   hidden [N, H], weight [V, H], same floating dtype, H >= 1, V >= 1;
//   bias [V] in that dtype if present; target [N] int32/int64 with every
//   value in [0, V) or equal to ignore_index; class_weight fp32 [V] if present.
struct LossProblem {
  TensorView hidden;
  TensorView weight;
  std::optional<TensorView> bias;
  TensorView target;
  std::optional<TensorView> class_weight;
  LossOptions options;
  // Owner of the device memory hidden and weight point into, if any.
  std::shared_ptr<const void> device_owner;
  // When set, the engine's device work on this call's device memory runs
  // after this event (the worker recorded it after producing X and W).
  const DeviceEvent* ready = nullptr;
  // A vocabulary shard (see VocabShard); REQUIRES first + vocab() <=
  // full_vocab, class_weight [full_vocab], targets in [0, full_vocab).
  std::optional<VocabShard> shard;
  // The weight's rows kept where the engine computes them (a registered
  // weight's device copies), one view per part of WeightParts(vocab()), in
  // order; empty: `weight` serves. An engine that splits the vocabulary
  // over several memories reads each part from here instead of `weight`
  // (which keeps the dtype and shape, and may stay in host memory); the
  // rest ignore them. The views' owner goes in device_owner.
  std::vector<TensorView> weight_parts;

  int64_t rows() const { return hidden.dim(0); }
  int64_t hidden_size() const { return hidden.dim(1); }
  int64_t vocab() const { return weight.dim(0); }  // the shard's V_s for a shard
  // The vocabulary the targets and class weights index.
  int64_t full_vocab() const { return shard ? shard->full_vocab : vocab(); }
};

// A problem that owns its tensors.
struct OwnedProblem {
  HostTensor hidden, weight, target;
  std::optional<HostTensor> bias, class_weight;
  LossOptions options;
  std::optional<VocabShard> shard;

  // A view that stays valid while this object lives and is not moved.
  LossProblem view() const;
  // Bytes of all the tensors.
  int64_t bytes() const;
};

// A deep copy of `problem`'s tensors.
OwnedProblem CopyProblem(const LossProblem& problem);

// `problem` for the engine that computes weight part k: its weight is
// problem.weight_parts[k], and it carries no parts. REQUIRES: k < parts.
LossProblem ProblemOnPart(const LossProblem& problem, size_t k);

struct ForwardSpec {
  // No gradient work and no saved state when false (evaluation).
  bool need_backward = false;
  // kStoreGrads or kRecompute; the caller resolves kAuto.
  // REQUIRES: not kStoreGrads with Reduction::kNone.
  BackwardMode mode = BackwardMode::kStoreGrads;
  bool want_lse = false;
  bool want_per_row_loss = false;
};

// What an engine keeps between Forward and Backward. Opaque to callers.
class SavedState {
 public:
  virtual ~SavedState() = default;
  // Memory held by this state, in bytes (host or device).
  virtual int64_t bytes() const = 0;
};

// A shard's per-row statistics of its logits z' (bias and softcap
// applied), fp32 [N] unless named; see VocabShard for the combine.
struct ShardStats {
  HostTensor max;           // m_s = max_j z'_j
  HostTensor sum_exp;       // S_s = Σ_j exp(z'_j − m_s)
  HostTensor target_logit;  // t_s = z'_t where the row's target is in the shard, else 0
  // q_s = Σ_j w_j z'_j over the shard's columns (1 without class weights);
  // with label smoothing only.
  std::optional<HostTensor> weighted_logit_sum;
  HostTensor argmax;  // int64 [N]: the vocabulary id of the shard's largest z'
};

struct ForwardResult {
  // For a shard: empty (shard_stats holds the result).
  HostTensor loss;                         // fp32, shape {} (mean/sum) or {N} (none)
  HostTensor z_loss;                       // fp32, shaped like loss
  std::optional<HostTensor> lse;           // fp32 {N}
  std::optional<HostTensor> per_row_loss;  // fp32 {N}
  int64_t num_valid = 0;
  int64_t num_correct = 0;
  // Present iff ForwardSpec::need_backward.
  std::unique_ptr<SavedState> saved;
  // Present iff the problem is a shard.
  std::optional<ShardStats> shard_stats;
};

// Memory a gradient is written into instead of being returned: shape ×
// the gradient's dtype bytes, in `space`.
struct GradientDestination {
  void* data = nullptr;
  MemorySpace space = MemorySpace::kHost;
  // Add the gradient to what `data` holds instead of overwriting it (device
  // memory only): fp32 sums add the fp32 gradient; a bf16 or fp16
  // destination gets round(old + round(new)), as PyTorch's autograd adds a
  // new gradient into a parameter's .grad of that dtype.
  bool accumulate = false;
};

struct BackwardSpec {
  // fp32 {} for mean/sum or {N} for none; absent means 1 everywhere.
  std::optional<TensorView> grad_output;
  // dtype of dX, and of dW and db unless weight_grad_dtype says otherwise:
  // the input dtype (when absent) or kFloat32.
  std::optional<DType> grad_dtype;
  std::optional<DType> weight_grad_dtype;
  // The caller frees the state after this call, so the engine may hand the
  // state's buffers over to the result instead of copying them.
  bool last_use = false;
  // The caller keeps the state but never needs its dW and db again (they
  // go into an accumulator; a later Backward on the state sets
  // hidden_grad_only), so the engine may hand those over.
  bool weight_grads_last_use = false;
  // Only dX is wanted: grad_weight and grad_bias may come back empty. For a
  // state whose weight gradients were handed over.
  bool hidden_grad_only = false;
  // dX is not wanted: grad_hidden may come back empty (a STORE_GRADS state
  // does not scale it).
  bool weight_grads_only = false;
  // Where given, the engine writes that gradient there; the returned tensor
  // then has its dtype and shape but no bytes.
  std::optional<GradientDestination> grad_hidden_to, grad_weight_to, grad_bias_to;
  // dW and db by part of the engine's WeightParts(V) (a registered
  // weight's gradient sums on several devices), in order, instead of
  // grad_weight_to and grad_bias_to: each part's rows go to its own
  // destination, in its part's memory. Empty: not used. Only an engine
  // whose WeightParts has several parts reads them.
  std::vector<GradientDestination> grad_weight_parts_to, grad_bias_parts_to;
  // When set, the engine writes device destinations only after this event
  // (the worker recorded it after its last use of that memory).
  const DeviceEvent* ready = nullptr;
  // For a shard's state: fp32 [N], each row's log-sum-exp over the whole
  // vocabulary (the shards' statistics combined). REQUIRED for a shard.
  std::optional<TensorView> global_lse;
  // For a shard's state: fp32 [N, H], added to the shard's part of dX
  // before it is rounded and delivered — the parts of the shards before it,
  // so that the last one delivers the whole dX, rounded once. In the
  // engine's memory: its device's (MemorySpace::kCuda) for an engine with a
  // device, host memory otherwise. It may be grad_hidden_to's memory.
  std::optional<TensorView> grad_hidden_addend;
  // When set, called once before grad_hidden_addend is read (after the
  // shard's own part is made): the addend is complete when it returns OK;
  // an error fails the call. It may block (on other engines' work).
  std::function<absl::Status()> grad_hidden_addend_ready;
  // When set and grad_hidden_to is host memory: may be called on the
  // call's thread as dX lands there front to back, with the bytes written
  // so far, so that a reader of its first bytes need not wait for the rest
  // (the CUDA engine does; the CPU engine writes dX in place and does not).
  std::function<void(int64_t bytes)> grad_hidden_landed;

  DType hidden_dtype(DType input) const { return grad_dtype.value_or(input); }
  DType weight_dtype(DType input) const { return weight_grad_dtype.value_or(hidden_dtype(input)); }
};

struct Gradients {
  HostTensor grad_hidden;               // [N, H]
  HostTensor grad_weight;               // [V, H]
  std::optional<HostTensor> grad_bias;  // [V], iff the problem had a bias
};

// FAILED_PRECONDITION naming the first of `problem`'s tensors that is not
// in host memory (for engines that compute there).
absl::Status RequireHostMemory(const LossProblem& problem);

// `spec` for the engine that computes weight part k: dW and db go to
// grad_weight_parts_to[k] and grad_bias_parts_to[k] (none without a bias),
// and it carries no parts. REQUIRES: k < grad_weight_parts_to.size(), and
// grad_bias_parts_to empty or as long.
BackwardSpec BackwardOnPart(const BackwardSpec& spec, size_t k);

// For engines that compute in host memory: copies each gradient that has a
// destination there and drops its bytes. FAILED_PRECONDITION for a
// destination in device memory.
absl::Status WriteToHostDestinations(const BackwardSpec& spec, Gradients& grads);

// Polled between chunks; true stops the call with CANCELLED.
using CancelFn = std::function<bool()>;

struct DeviceInfo {
  std::string name;
  int64_t total_memory_bytes = 0;
};

// Rows [first, first + rows) of a weight, computed in `memory` (a device's;
// null: the engine reads them from host memory).
struct WeightPart {
  int64_t first = 0;
  int64_t rows = 0;
  DeviceMemory* memory = nullptr;
};

class LossEngine {
 public:
  virtual ~LossEngine() = default;

  // "cpu" or "cuda".
  virtual std::string backend() const = 0;
  virtual std::vector<DeviceInfo> devices() const = 0;

  // Device memory the engine holds now (pooled workspace, sessions' state
  // on the device, device_memory()'s allocations), in bytes; 0 for
  // engines without a device.
  virtual int64_t device_memory_bytes() const { return 0; }

  // Forward calls the engine ran a second time on its exact, slower path
  // because the data left its fast path's range (the CUDA engine's
  // one-pass rows); 0 for engines without one.
  virtual int64_t forward_reruns() const { return 0; }

  // Whether Forward takes a vocabulary shard (LossProblem::shard).
  virtual bool supports_vocab_shards() const { return false; }

  // OK while the engine can serve; UNAVAILABLE after an unrecoverable
  // device failure, after which every call fails with it.
  virtual absl::Status health() const { return absl::OkStatus(); }

  // Bytes the SavedState of `mode` will hold for `problem`'s shapes, so the
  // caller can reserve its memory budget before computing.
  virtual int64_t SavedStateBytes(const LossProblem& problem, BackwardMode mode) const = 0;

  // Computes the loss and, with spec.need_backward, the state for Backward.
  // Errors: CANCELLED if `cancelled` returned true, RESOURCE_EXHAUSTED if
  // memory ran out, INTERNAL on a broken invariant.
  virtual absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                                const CancelFn& cancelled) = 0;

  // Gradients for `state` (made by this engine's Forward). Unless
  // spec.last_use (or, for dW and db, spec.weight_grads_last_use), the
  // state is left as it was, so Backward may run on it again; on error it
  // is always left as it was.
  // REQUIRES: spec.grad_output has the shape the reduction implies; the
  // caller holds the state exclusively for the call.
  virtual absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                             const CancelFn& cancelled) = 0;

  // The engine's device memory, or null for an engine without a device.
  virtual DeviceMemory* device_memory() const { return nullptr; }

  // What page-locks host memory for the engine's devices (its
  // PinHostMemory locks for every device: copies between that memory and
  // any of them run at the bus's rate), or null for an engine without a
  // device: device_memory() for an engine with one device, one of its
  // engines' for an engine over several.
  virtual DeviceMemory* host_locker() const { return device_memory(); }

  // Where a weight of `vocab` rows is best kept between calls (a
  // registered weight's copies and gradient sums): its rows in consecutive
  // parts, each in the memory that computes them. One part in
  // device_memory() by default; a part per vocabulary shard for an engine
  // that shards over several devices (LossProblem::weight_parts,
  // BackwardSpec::grad_weight_parts_to).
  virtual std::vector<WeightPart> WeightParts(int64_t vocab) const {
    return {WeightPart{0, vocab, device_memory()}};
  }
};

}  // namespace flce

#endif  // FLCE_KERNELS_LOSS_ENGINE_H_
