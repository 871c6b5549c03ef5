#ifndef FLCE_KERNELS_CUDA_DEVICE_PROBLEM_H_
#define FLCE_KERNELS_CUDA_DEVICE_PROBLEM_H_

// A problem on the device and the way results leave it: the inputs (X and
// W borrowed where they already live on the device, uploaded otherwise),
// the per-row buffers of a call, and the delivery of gradients into device
// destinations or host memory, rounded once to their final dtype.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/lane_pool.h"
#include "kernels/cuda/row_kernels.h"
#include "kernels/loss_engine.h"

namespace flce {
namespace internal_cuda {

struct DeviceInputs {
  DType dtype = DType::kFloat32;
  int64_t n = 0, h = 0, v = 0;  // v: the weight's rows (a shard's V_s)
  // A vocabulary shard: W's row j is the id first + j of full_vocab ids.
  std::optional<VocabShard> shard;
  LossOptions options;
  float class_weight_sum = 0;  // over the whole vocabulary
  // X [N, H] and W [V, H] in the input dtype: borrowed device memory, or
  // hidden_copy / weight_copy.
  const void* hidden = nullptr;
  const void* weight = nullptr;
  DeviceBuffer hidden_copy, weight_copy;  // empty when borrowed
  DeviceBuffer bias;                      // fp32 [V], or empty
  DeviceBuffer target;                    // int64 [N]
  DeviceBuffer class_weight;              // fp32 [full_vocab()], or empty
  // Keeps the borrowed memory alive (LossProblem::device_owner).
  std::shared_ptr<const void> owner;

  // Device memory these inputs own (borrowed memory is not counted).
  int64_t bytes() const {
    return hidden_copy.bytes() + weight_copy.bytes() + bias.bytes() + target.bytes() +
           class_weight.bytes();
  }
  int64_t full_vocab() const { return shard ? shard->full_vocab : v; }
  const char* x_row(int64_t r) const {
    return static_cast<const char*>(hidden) + r * h * DTypeSize(dtype);
  }
  const char* w_row(int64_t r) const {
    return static_cast<const char*>(weight) + r * h * DTypeSize(dtype);
  }
  // Whole rows [row0, row0 + rows).
  RowParams Params(int64_t row0, int64_t rows) const { return Params(row0, rows, 0, v); }
  // Columns [col0, col0 + cols) of rows [row0, row0 + rows).
  RowParams Params(int64_t row0, int64_t rows, int64_t col0, int64_t cols) const;
};

// `problem` on the lane's device: X and W in MemorySpace::kCuda are read in
// place (and `problem.device_owner` kept), host ones uploaded; bias, target
// and class_weight (host memory: FAILED_PRECONDITION otherwise) uploaded,
// bias as fp32, targets as int64.
absl::StatusOr<DeviceInputs> MakeDeviceInputs(const Lane& lane, const LossProblem& problem);

// Bytes MakeDeviceInputs allocates for `problem` (what a saved copy of the
// inputs holds): borrowed X and W take none.
int64_t DeviceInputBytes(const LossProblem& problem);

// Per-row forward outputs and the reduction scalars of one call.
struct RowBuffers {
  DeviceBuffer lse, loss, z_loss, correct, row_scale, denom, num_valid, totals;
  // The one-pass row kernel's per-row gradient factors ([N] fp32) and its
  // flag asking for the two-pass rerun (int32).
  DeviceBuffer row_factor, redo;
  RowOutputs outputs() const {
    return {lse.as<float>(), loss.as<float>(), z_loss.as<float>(), correct.as<int32_t>()};
  }
};

absl::StatusOr<RowBuffers> AllocateRows(const Lane& lane, int64_t n);

// A device gradient (`src`, in `src_dtype`: the fp32 sum, or already in its
// final dtype) × scale, rounded once on the device to `dtype`, queued on the
// lane: into a device `to` (added to what it holds when `to` accumulates),
// or into host memory (`to`, else a new tensor that is returned) through
// conversion slices of bounded size. The returned tensor has dtype and
// shape, and bytes only when it is that new tensor. Host memory is written
// when this returns (it waits); a device `to` is written in stream order,
// without a wait. `landed` (host memory only) is told the bytes written so
// far as they land, front to back: the copy then goes in a few slices (at
// least 1 MiB each), each reported once it is in.
absl::StatusOr<HostTensor> DeliverGradient(const Lane& lane, const void* src, DType src_dtype,
                                           std::vector<int64_t> shape, DType dtype, float scale,
                                           const std::optional<GradientDestination>& to,
                                           const std::function<void(int64_t)>& landed = nullptr);

// A device gradient already in its final dtype at `src`: copied to a host
// `to` or a new tensor; with a device `to`, `src` is that memory already.
// Waits for host memory, as DeliverGradient.
absl::StatusOr<HostTensor> DeliverFinalGradient(const Lane& lane, const void* src,
                                                std::vector<int64_t> shape, DType dtype,
                                                const std::optional<GradientDestination>& to);

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_DEVICE_PROBLEM_H_
