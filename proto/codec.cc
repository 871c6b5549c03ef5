#include "proto/codec.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flce {

// grpc::StatusCode spells codes in upper case; list the pairs explicitly.
static_assert(static_cast<int>(absl::StatusCode::kOk) == grpc::StatusCode::OK);
static_assert(static_cast<int>(absl::StatusCode::kCancelled) == grpc::StatusCode::CANCELLED);
static_assert(static_cast<int>(absl::StatusCode::kUnknown) == grpc::StatusCode::UNKNOWN);
static_assert(static_cast<int>(absl::StatusCode::kInvalidArgument) ==
              grpc::StatusCode::INVALID_ARGUMENT);
static_assert(static_cast<int>(absl::StatusCode::kDeadlineExceeded) ==
              grpc::StatusCode::DEADLINE_EXCEEDED);
static_assert(static_cast<int>(absl::StatusCode::kNotFound) == grpc::StatusCode::NOT_FOUND);
static_assert(static_cast<int>(absl::StatusCode::kAlreadyExists) ==
              grpc::StatusCode::ALREADY_EXISTS);
static_assert(static_cast<int>(absl::StatusCode::kPermissionDenied) ==
              grpc::StatusCode::PERMISSION_DENIED);
static_assert(static_cast<int>(absl::StatusCode::kResourceExhausted) ==
              grpc::StatusCode::RESOURCE_EXHAUSTED);
static_assert(static_cast<int>(absl::StatusCode::kFailedPrecondition) ==
              grpc::StatusCode::FAILED_PRECONDITION);
static_assert(static_cast<int>(absl::StatusCode::kAborted) == grpc::StatusCode::ABORTED);
static_assert(static_cast<int>(absl::StatusCode::kOutOfRange) == grpc::StatusCode::OUT_OF_RANGE);
static_assert(static_cast<int>(absl::StatusCode::kUnimplemented) ==
              grpc::StatusCode::UNIMPLEMENTED);
static_assert(static_cast<int>(absl::StatusCode::kInternal) == grpc::StatusCode::INTERNAL);
static_assert(static_cast<int>(absl::StatusCode::kUnavailable) == grpc::StatusCode::UNAVAILABLE);
static_assert(static_cast<int>(absl::StatusCode::kDataLoss) == grpc::StatusCode::DATA_LOSS);
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              grpc::StatusCode::UNAUTHENTICATED);

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<DType> FromProto(v1::DType dtype, const std::string& field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_INT32:
      return DType::kInt32;
    case v1::DTYPE_INT64:
      return DType::kInt64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": unknown dtype ", static_cast<int>(dtype)));
  }
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kInt32:
      return v1::DTYPE_INT32;
    case DType::kInt64:
      return v1::DTYPE_INT64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

Reduction FromProto(v1::Reduction reduction) {
  switch (reduction) {
    case v1::REDUCTION_SUM:
      return Reduction::kSum;
    case v1::REDUCTION_NONE:
      return Reduction::kNone;
    default:
      return Reduction::kMean;
  }
}

v1::Reduction ToProto(Reduction reduction) {
  switch (reduction) {
    case Reduction::kSum:
      return v1::REDUCTION_SUM;
    case Reduction::kNone:
      return v1::REDUCTION_NONE;
    default:
      return v1::REDUCTION_MEAN;
  }
}

BackwardMode FromProto(v1::BackwardMode mode) {
  switch (mode) {
    case v1::BACKWARD_MODE_STORE_GRADS:
      return BackwardMode::kStoreGrads;
    case v1::BACKWARD_MODE_RECOMPUTE:
      return BackwardMode::kRecompute;
    default:
      return BackwardMode::kAuto;
  }
}

v1::BackwardMode ToProto(BackwardMode mode) {
  switch (mode) {
    case BackwardMode::kStoreGrads:
      return v1::BACKWARD_MODE_STORE_GRADS;
    case BackwardMode::kRecompute:
      return v1::BACKWARD_MODE_RECOMPUTE;
    default:
      return v1::BACKWARD_MODE_AUTO;
  }
}

absl::StatusOr<int64_t> TensorBytes(const v1::Tensor& tensor, const std::string& field) {
  auto dtype = FromProto(tensor.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  // Overflow-safe element count: every dimension is checked before it is
  // multiplied in.
  int64_t count = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t d = tensor.shape(i);
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dimension ", i, " is ", d, "; dimensions must be >= 0"));
    }
    if (d != 0 && count > std::numeric_limits<int64_t>::max() / 8 / d) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": shape ",
          ShapeString(std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end())),
          " is too large"));
    }
    count *= d;
  }
  return count * DTypeSize(*dtype);
}

absl::StatusOr<TensorView> ViewOf(const v1::Tensor& tensor, const std::string& field,
                                  const SliceResolver* shm, bool allow_device) {
  auto expected_or = TensorBytes(tensor, field);
  if (!expected_or.ok()) return expected_or.status();
  const int64_t expected = *expected_or;
  TensorView view;
  view.dtype = *FromProto(tensor.dtype(), field);
  view.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (tensor.has_shm()) {
    if (tensor.shm().accumulate()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ".shm.accumulate: only gradient outputs (grad_weight_out, grad_bias_out) "
                       "accumulate"));
    }
    if (shm == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": shared memory is not enabled on this server (--enable_shared_memory)"));
    }
    auto memory = shm->Resolve(ToSliceRef(tensor.shm()), expected, field);
    if (!memory.ok()) return memory.status();
    if (memory->space != MemorySpace::kHost && !allow_device) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ": GPU memory (a CUDA IPC region) is accepted for hidden and weight only; "
                       "send it inline or through POSIX shared memory"));
    }
    view.data = memory->data;
    view.space = memory->space;
    return view;
  }
  if (static_cast<int64_t>(tensor.data().size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", ShapeString(view.shape),
                                                   " ", DTypeName(view.dtype), " = ", expected,
                                                   " bytes, got ", tensor.data().size()));
  }
  view.data = tensor.data().data();
  return view;
}

void MoveToProto(HostTensor&& tensor, v1::Tensor* out) {
  out->set_dtype(ToProto(tensor.dtype));
  out->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  out->set_data(std::move(tensor.data));
}

void CopyToProto(const TensorView& view, v1::Tensor* out, bool with_data) {
  out->set_dtype(ToProto(view.dtype));
  out->mutable_shape()->Assign(view.shape.begin(), view.shape.end());
  if (with_data) {
    out->set_data(static_cast<const char*>(view.data), static_cast<size_t>(view.bytes()));
  }
}

absl::StatusOr<HostTensor> MoveFromProto(v1::Tensor* tensor, const std::string& field) {
  auto view = ViewOf(*tensor, field);
  if (!view.ok()) return view.status();
  HostTensor out;
  out.dtype = view->dtype;
  out.shape = std::move(view->shape);
  out.data = std::move(*tensor->mutable_data());
  return out;
}

}  // namespace flce
