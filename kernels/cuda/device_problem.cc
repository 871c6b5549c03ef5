#include "kernels/cuda/device_problem.h"

#include <algorithm>
#include <utility>

#include "kernels/cuda/elementwise.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {
namespace {

// Elements converted per slice when narrowing fp32 results for host memory:
// bounds the conversion buffer (64 MiB of bf16) whatever the size of dW.
constexpr int64_t kSliceElements = int64_t{32} << 20;
// Slices of a gradient whose landing is reported (DeliverGradient's
// `landed`): as many as a client reads it in ranges.
constexpr int64_t kLandedSlices = 4;

// A device copy of `bytes` at `data` (host memory).
absl::StatusOr<DeviceBuffer> Upload(const Lane& lane, const void* data, int64_t bytes) {
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer buffer, lane.Allocate(bytes));
  if (bytes > 0) {
    FLCE_RETURN_IF_ERROR(lane.Check(
        cudaMemcpyAsync(buffer.data(), data, bytes, cudaMemcpyDefault, lane.stream()), "upload"));
  }
  return buffer;
}

// X or W: borrowed where it lives on the device, else uploaded into `copy`.
absl::StatusOr<const void*> Operand(const Lane& lane, const TensorView& view, DeviceBuffer& copy) {
  if (view.space == MemorySpace::kCuda) return view.data;
  FLCE_ASSIGN_OR_RETURN(copy, Upload(lane, view.data, view.bytes()));
  return static_cast<const void*>(copy.data());
}

}  // namespace

RowParams DeviceInputs::Params(int64_t row0, int64_t rows, int64_t col0, int64_t cols) const {
  RowParams p;
  p.rows = rows;
  p.row0 = row0;
  p.vocab = v;
  p.col0 = col0;
  p.cols = cols;
  p.first = shard ? shard->first : 0;
  p.full_vocab = full_vocab();
  p.bias = bias.bytes() > 0 ? bias.as<const float>() : nullptr;
  p.class_weight = class_weight.bytes() > 0 ? class_weight.as<const float>() : nullptr;
  p.class_weight_sum = class_weight_sum;
  p.target = target.as<const int64_t>();
  p.ignore_index = options.ignore_index;
  p.label_smoothing = options.label_smoothing;
  p.z_loss_scale = options.z_loss_scale;
  p.softcap = options.logit_softcap.value_or(0.0f);
  return p;
}

absl::StatusOr<DeviceInputs> MakeDeviceInputs(const Lane& lane, const LossProblem& p) {
  for (const TensorView* view :
       {p.bias ? &*p.bias : nullptr, &p.target, p.class_weight ? &*p.class_weight : nullptr}) {
    if (view != nullptr && view->space != MemorySpace::kHost) {
      return absl::FailedPreconditionError("bias, target and class_weight must be in host memory");
    }
  }
  DeviceInputs in;
  in.dtype = p.hidden.dtype;
  in.n = p.rows();
  in.h = p.hidden_size();
  in.v = p.vocab();
  in.shard = p.shard;
  in.options = p.options;
  FLCE_ASSIGN_OR_RETURN(in.hidden, Operand(lane, p.hidden, in.hidden_copy));
  FLCE_ASSIGN_OR_RETURN(in.weight, Operand(lane, p.weight, in.weight_copy));
  if (p.hidden.space == MemorySpace::kCuda || p.weight.space == MemorySpace::kCuda) {
    in.owner = p.device_owner;
  }
  if (p.bias) {
    const std::vector<float> bias = TensorToFloats(*p.bias);
    FLCE_ASSIGN_OR_RETURN(in.bias, Upload(lane, bias.data(), in.v * 4));
    // The host vector must outlive the copy.
    FLCE_RETURN_IF_ERROR(lane.Synchronize("upload bias"));
  }
  if (p.target.dtype == DType::kInt64) {
    FLCE_ASSIGN_OR_RETURN(in.target, Upload(lane, p.target.data, in.n * 8));
  } else {
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer narrow, Upload(lane, p.target.data, in.n * 4));
    FLCE_ASSIGN_OR_RETURN(in.target, lane.Allocate(in.n * 8));
    FLCE_RETURN_IF_ERROR(lane.Check(
        LaunchWidenTargets(narrow.as<int32_t>(), in.n, in.target.as<int64_t>(), lane.stream()),
        "widen targets"));
  }
  const int64_t classes = in.full_vocab();
  in.class_weight_sum = static_cast<float>(classes);
  if (p.class_weight) {
    FLCE_ASSIGN_OR_RETURN(in.class_weight, Upload(lane, p.class_weight->data, classes * 4));
    double sum = 0;
    const float* w = static_cast<const float*>(p.class_weight->data);
    for (int64_t j = 0; j < classes; ++j) sum += w[j];
    in.class_weight_sum = static_cast<float>(sum);
  }
  return in;
}

int64_t DeviceInputBytes(const LossProblem& p) {
  const int64_t n = p.rows(), v = p.vocab();
  const int64_t x = p.hidden.space == MemorySpace::kCuda ? 0 : p.hidden.bytes();
  const int64_t w = p.weight.space == MemorySpace::kCuda ? 0 : p.weight.bytes();
  return x + w + (p.bias ? v * 4 : 0) + n * 8 + (p.class_weight ? p.full_vocab() * 4 : 0);
}

absl::StatusOr<RowBuffers> AllocateRows(const Lane& lane, int64_t n) {
  RowBuffers b;
  for (DeviceBuffer* row : {&b.lse, &b.loss, &b.z_loss, &b.correct, &b.row_scale, &b.row_factor}) {
    FLCE_ASSIGN_OR_RETURN(*row, lane.Allocate(n * 4));
  }
  FLCE_ASSIGN_OR_RETURN(b.denom, lane.Allocate(8));
  FLCE_ASSIGN_OR_RETURN(b.num_valid, lane.Allocate(8));
  FLCE_ASSIGN_OR_RETURN(b.totals, lane.Allocate(3 * 8));
  FLCE_ASSIGN_OR_RETURN(b.redo, lane.Allocate(4));
  return b;
}

absl::StatusOr<HostTensor> DeliverGradient(const Lane& lane, const void* src, DType src_dtype,
                                           std::vector<int64_t> shape, DType dtype, float scale,
                                           const std::optional<GradientDestination>& to,
                                           const std::function<void(int64_t)>& landed) {
  HostTensor out;
  out.dtype = dtype;
  out.shape = std::move(shape);
  const int64_t count = out.num_elements();
  cudaStream_t s = lane.stream();
  if (to && to->space == MemorySpace::kCuda) {
    if (count > 0) {
      FLCE_RETURN_IF_ERROR(lane.Check(
          to->accumulate ? LaunchAccumulate(src, src_dtype, to->data, dtype, count, scale, s)
                         : LaunchConvert(src, src_dtype, to->data, dtype, count, scale, s),
          "convert"));
    }
    return out;
  }
  const int64_t elem = DTypeSize(dtype);
  char* dst = to ? static_cast<char*>(to->data) : nullptr;
  if (dst == nullptr) {
    out = HostTensor(dtype, out.shape);
    dst = out.data.data();
  }
  if (count == 0) return out;
  // Reported as it lands: a few slices, so that a reader of the first bytes
  // (a bulk read waiting for them) starts while the rest come down.
  const int64_t per_slice =
      landed ? std::min(kSliceElements, std::max((count + kLandedSlices - 1) / kLandedSlices,
                                                 (int64_t{1} << 20) / elem))
             : kSliceElements;
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer slice, lane.Allocate(std::min(count, per_slice) * elem));
  std::vector<CudaEvent> done;
  for (int64_t first = 0; first < count; first += per_slice) {
    const int64_t m = std::min(per_slice, count - first);
    FLCE_RETURN_IF_ERROR(
        lane.Check(LaunchConvert(static_cast<const char*>(src) + first * DTypeSize(src_dtype),
                                 src_dtype, slice.data(), dtype, m, scale, s),
                   "convert"));
    FLCE_RETURN_IF_ERROR(lane.Check(
        cudaMemcpyAsync(dst + first * elem, slice.data(), m * elem, cudaMemcpyDeviceToHost, s),
        "download"));
    if (landed) {
      FLCE_ASSIGN_OR_RETURN(CudaEvent event, CudaEvent::Create(lane.health()));
      FLCE_RETURN_IF_ERROR(lane.Check(cudaEventRecord(event.get(), s), "download"));
      done.push_back(std::move(event));
    }
  }
  for (size_t i = 0; i < done.size(); ++i) {
    FLCE_RETURN_IF_ERROR(lane.Check(cudaEventSynchronize(done[i].get()), "download"));
    landed(std::min(count, static_cast<int64_t>(i + 1) * per_slice) * elem);
  }
  // Host memory is written when this returns (a short tensor's bytes live
  // inside `out`, which moves).
  FLCE_RETURN_IF_ERROR(lane.Synchronize("download"));
  return out;
}

absl::StatusOr<HostTensor> DeliverFinalGradient(const Lane& lane, const void* src,
                                                std::vector<int64_t> shape, DType dtype,
                                                const std::optional<GradientDestination>& to) {
  HostTensor out;
  out.dtype = dtype;
  out.shape = std::move(shape);
  if (to && to->space == MemorySpace::kCuda) return out;
  void* dst = to ? to->data : nullptr;
  if (dst == nullptr) {
    out = HostTensor(dtype, out.shape);
    dst = out.data.data();
  }
  const int64_t bytes = out.num_elements() * DTypeSize(dtype);
  if (bytes > 0) {
    FLCE_RETURN_IF_ERROR(lane.Check(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, lane.stream()), "download"));
  }
  FLCE_RETURN_IF_ERROR(lane.Synchronize("download"));  // as DeliverGradient
  return out;
}

}  // namespace internal_cuda
}  // namespace flce
