#include "kernels/cuda/cuda_resources.h"

#include "absl/strings/str_cat.h"

namespace flce {
namespace internal_cuda {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat("CUDA ", what, ": ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat("GPU out of memory: ", message));
  }
  return absl::InternalError(message);
}

absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat("cuBLAS ", what, ": ", cublasGetStatusName(status), " (",
                   cublasGetStatusString(status), ")");
  if (status == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("GPU out of memory: ", message));
  }
  return absl::InternalError(message);
}

bool IsStickyError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<CudaStream> CudaStream::Create() {
  cudaStream_t s = nullptr;
  absl::Status status =
      CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
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

absl::StatusOr<CublasHandle> CublasHandle::Create(cudaStream_t stream) {
  cublasHandle_t h = nullptr;
  absl::Status status = CublasStatus(cublasCreate(&h), "cublasCreate");
  if (!status.ok()) return status;
  CublasHandle handle(h);
  status = CublasStatus(cublasSetStream(h, stream), "cublasSetStream");
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

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(int64_t bytes, cudaStream_t stream) {
  void* data = nullptr;
  if (bytes > 0) {
    const cudaError_t error = cudaMallocAsync(&data, static_cast<size_t>(bytes), stream);
    if (error != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky: clear it
      return CudaStatus(error, absl::StrCat("allocating ", bytes, " bytes").c_str());
    }
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
