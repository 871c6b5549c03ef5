#ifndef FLCE_KERNELS_CUDA_DEVICE_PIPELINE_H_
#define FLCE_KERNELS_CUDA_DEVICE_PIPELINE_H_

// The CUDA engine's device pipeline: Forward and Backward on a problem that
// is on the device (device_problem.h), on one lane. The engine's Forward and
// Backward and the benchmark's runner (device_run.h) both call these, so
// the one-pass try and its two-pass rerun, the saved state of each backward
// mode and the narrowing of the gradients live here and nowhere else.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_engine_options.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/device_problem.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lane_pool.h"
#include "kernels/cuda/loss_passes.h"
#include "kernels/loss_engine.h"

namespace flce {
namespace internal_cuda {

// The parts of the engine a call runs with (the engine owns them).
struct PipelineParts {
  const CudaEngineOptions& options;
  GemmRunner& gemms;
  LanePool& lanes;
};

// STORE_GRADS over several token chunks: the gradients for grad_output 1,
// fp32, on the device (dW summed over the chunks).
class StoredGradients : public SavedState {
 public:
  DType dtype = DType::kFloat32;
  int64_t n = 0, h = 0, v = 0;
  DeviceBuffer dx, dw, db;
  int64_t bytes() const override { return dx.bytes() + dw.bytes() + db.bytes(); }
};

// STORE_GRADS of a problem whose rows fit one token chunk: the gradient in
// the logit form the Forward's row kernel left ([N, V] in the input dtype,
// the chunk buffer itself), its per-row factors (`one_pass`: each row of
// `logits` is to be multiplied by its factor; else `logits` is the
// gradient and the factors are unused), and the inputs (as RecomputeState)
// for the dX and dW GEMMs, which Backward runs with grad_output known: dW
// comes out of its GEMM in its final dtype, rounded once (no fp32 dW to
// write, keep and narrow), at most the chunk's bytes are kept, and a repeated
// Backward reads them again.
class KeptLogits : public SavedState {
 public:
  std::shared_ptr<const DeviceInputs> inputs;
  DeviceBuffer logits;      // [N, V], input dtype
  DeviceBuffer row_factor;  // fp32 [N]
  bool one_pass = false;
  int64_t bytes() const override { return inputs->bytes() + logits.bytes() + row_factor.bytes(); }
};

// RECOMPUTE: the inputs (X and W borrowed where they were on the device,
// their owner held) and the per-row lse, on the device.
class RecomputeState : public SavedState {
 public:
  std::shared_ptr<const DeviceInputs> inputs;
  DeviceBuffer lse;
  int64_t bytes() const override { return inputs->bytes() + lse.bytes(); }
};

// A vocabulary shard's: the inputs (as RecomputeState) and, for
// STORE_GRADS, its logits [N, V_s] in the input dtype as the Forward's GEMM
// gave them, which Backward reads instead of a logits GEMM (the
// reference's high-performance mode; RECOMPUTE is its memory-saving one).
// The gradient needs the whole vocabulary's lse, known only after every
// shard's Forward, so nothing of it can be made before Backward.
class ShardState : public SavedState {
 public:
  std::shared_ptr<const DeviceInputs> inputs;
  DeviceBuffer logits;  // STORE_GRADS only
  int64_t bytes() const override { return inputs->bytes() + logits.bytes(); }
};

// Bytes the saved state of `mode` holds for `problem` under `options`
// (StoredGradients, KeptLogits, RecomputeState or ShardState with the
// inputs MakeDeviceInputs makes).
int64_t SavedStateBytes(const CudaEngineOptions& options, const LossProblem& problem,
                        BackwardMode mode);

struct DeviceForward {
  ForwardResult result;
  // The one-pass rows asked for the two-pass rerun, which ran.
  bool reran = false;
};

// Forward on the device: the row scales; the token chunks (STORE_GRADS: one
// pass where OnePassRows allows, run again with two when a row leaves its
// range; RECOMPUTE and evaluation: the loss alone); the totals and the
// per-row results `spec` asks for, downloaded. Waits for them. With
// spec.need_backward, result.saved holds `in` (RECOMPUTE), the kept
// logits (STORE_GRADS in one chunk) or the gradients (STORE_GRADS).
// A shard (in->shard): its statistics instead (result.shard_stats) and a
// ShardState.
absl::StatusOr<DeviceForward> ForwardOnDevice(const CallContext& call,
                                              std::shared_ptr<const DeviceInputs> in,
                                              const ForwardSpec& spec);

// Backward on the device for a state ForwardOnDevice made: the gradients
// scaled by spec.grad_output (STORE_GRADS: when narrowed; RECOMPUTE: in the
// row scales before the GEMMs), rounded once to their final dtype and
// delivered where `spec` says (device destinations written or accumulated
// in place, host ones copied, else returned). Waits for them. A shard's
// state takes spec.global_lse and spec.grad_hidden_addend.
absl::StatusOr<Gradients> BackwardOnDevice(const CallContext& call, SavedState& state,
                                           const BackwardSpec& spec);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_DEVICE_PIPELINE_H_
