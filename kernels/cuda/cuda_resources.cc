#include "kernels/cuda/cuda_resources.h"

#include "absl/strings/str_cat.h"

namespace flce {
namespace internal_cuda {

absl::StatusOr<CudaStream> CudaStream::Create(DeviceHealth& health) {
  cudaStream_t s = nullptr;
  absl::Status status =
      health.Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  if (!status.ok()) return status;
  return CudaStream(s);
}

CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<CudaEvent> CudaEvent::Create(DeviceHealth& health) {
  cudaEvent_t e = nullptr;
  absl::Status status =
      health.Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  if (!status.ok()) return status;
  return CudaEvent(e);
}

CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

absl::StatusOr<CublasHandle> CublasHandle::Create(cudaStream_t stream, DeviceHealth& health) {
  cublasHandle_t h = nullptr;
  absl::Status status = health.Check(cublasCreate(&h), "cublasCreate");
  if (!status.ok()) return status;
  CublasHandle handle(h);
  status = health.Check(cublasSetStream(h, stream), "cublasSetStream");
  if (!status.ok()) return status;
  // Split-K partial sums are added in fp32, never in a bf16/fp16 output
  // type (cuBLAS's default allows that): a GEMM writing its result in a
  // half type rounds once, as the engine's accuracy bar assumes.
  status = health.Check(
      cublasSetMathMode(h, static_cast<cublasMath_t>(
                               CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
      "cublasSetMathMode");
  if (!status.ok()) return status;
  return handle;
}

CublasHandle& CublasHandle::operator=(CublasHandle&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) cublasDestroy(handle_);
    handle_ = std::exchange(o.handle_, nullptr);
  }
  return *this;
}

CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(int64_t bytes, cudaStream_t stream,
                                                    DeviceHealth& health) {
  void* data = nullptr;
  if (bytes > 0) {
    FLCE_RETURN_IF_ERROR(health.Check(cudaMallocAsync(&data, static_cast<size_t>(bytes), stream),
                                      absl::StrCat("allocating ", bytes, " bytes")));
  }
  return DeviceBuffer(data, bytes, stream);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Free();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    stream_ = o.stream_;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Free(); }

void DeviceBuffer::Free() {
  if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  data_ = nullptr;
}

}  // namespace internal_cuda
}  // namespace flce
