#ifndef FLCE_PROTO_CODEC_H_
#define FLCE_PROTO_CODEC_H_

// Conversions between the flce.v1 wire types and the plain types of
// kernels/: tensors, enums and statuses.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kernels/loss_engine.h"
#include "kernels/tensor.h"
#include "proto/flce/v1/loss_service.pb.h"

namespace flce {

// absl::Status <-> grpc::Status: the same code (proven equal by
// static_asserts in codec.cc) and message.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

absl::StatusOr<DType> FromProto(v1::DType dtype, const std::string& field);
v1::DType ToProto(DType dtype);
Reduction FromProto(v1::Reduction reduction);
v1::Reduction ToProto(Reduction reduction);
BackwardMode FromProto(v1::BackwardMode mode);
v1::BackwardMode ToProto(BackwardMode mode);

// The memory a shared-memory slice names.
struct SliceMemory {
  void* data = nullptr;
  MemorySpace space = MemorySpace::kHost;  // kCuda for a CUDA IPC region
};

// Finds the memory of a shared-memory slice.
// Where bytes live in a registered shared-memory region: the wire's
// SharedMemorySlice as the server's own type, so that what lies below the
// decoding (LossCore) sees no wire type.
struct SliceRef {
  std::string region_id;
  int64_t offset = 0;       // bytes from the region's start
  bool accumulate = false;  // add into it (gradient outputs in device memory)
};

inline SliceRef ToSliceRef(const v1::SharedMemorySlice& slice) {
  return SliceRef{slice.region_id(), slice.offset(), slice.accumulate()};
}

class SliceResolver {
 public:
  virtual ~SliceResolver() = default;
  // The address of `bytes` bytes at `slice`, valid as long as this resolver.
  // NOT_FOUND for an unknown region, INVALID_ARGUMENT (naming `field`) if the
  // bytes do not lie inside it.
  virtual absl::StatusOr<SliceMemory> Resolve(const SliceRef& slice, int64_t bytes,
                                              const std::string& field) const = 0;
  // The registered event `region_id` names (a CUDA IPC event), valid as
  // long as this resolver. NOT_FOUND for an unknown region, INVALID_ARGUMENT
  // (naming `field`) for a region that is memory, not an event.
  // (A resolver without events answers NOT_FOUND.)
  virtual absl::StatusOr<const DeviceEvent*> ResolveEvent(const std::string& region_id,
                                                          const std::string& field) const {
    return absl::NotFoundError(field + ": unknown event region");
  }
  // After a call: OK unless memory resolved by this resolver was taken
  // away under it (a client shrank its shared-memory object), in which case
  // what the call read or wrote there is void.
  virtual absl::Status CheckIntact() const { return absl::OkStatus(); }
};

// The bytes a wire tensor's dtype and shape call for. INVALID_ARGUMENT
// naming `field` for an unknown dtype, a negative dimension or a shape too
// large to address.
absl::StatusOr<int64_t> TensorBytes(const v1::Tensor& tensor, const std::string& field);

// A view of a wire tensor after checking its dtype is known, its dimensions
// are non-negative and its byte length is product(shape) × size(dtype).
// Errors are INVALID_ARGUMENT naming `field`, e.g.
// "hidden: expected 8192×4096 bf16 = 67108864 bytes, got 67108000".
// The view points into `tensor` (or, for a shared-memory slice, into the
// region `shm` resolves; FAILED_PRECONDITION without one), which must
// outlive it. A slice of GPU memory (a CUDA IPC region) is INVALID_ARGUMENT
// unless `allow_device`.
absl::StatusOr<TensorView> ViewOf(const v1::Tensor& tensor, const std::string& field,
                                  const SliceResolver* shm = nullptr, bool allow_device = false);

// Moves a host tensor's bytes into a wire tensor (no copy of the data).
void MoveToProto(HostTensor&& tensor, v1::Tensor* out);

// Copies a view into a wire tensor (without its bytes when !with_data).
void CopyToProto(const TensorView& view, v1::Tensor* out, bool with_data = true);

// Moves a wire tensor's bytes out into a host tensor (no copy of the data).
absl::StatusOr<HostTensor> MoveFromProto(v1::Tensor* tensor, const std::string& field);

}  // namespace flce

#endif  // FLCE_PROTO_CODEC_H_
