#include "kernels/cuda/device_health.h"

#include "absl/strings/str_cat.h"

namespace flce {
namespace internal_cuda {

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

absl::Status DeviceHealth::MarkSticky(cudaError_t error, absl::string_view what) {
  {
    absl::MutexLock lock(&mu_);
    if (healthy_.exchange(false)) {
      first_sticky_ = absl::StrCat(what, ": ", cudaGetErrorName(error));
    }
  }
  return absl::UnavailableError(
      absl::StrCat("CUDA engine stopped after an unrecoverable device error in ", what, ": ",
                   cudaGetErrorName(error)));
}

absl::Status DeviceHealth::Check(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  if (IsStickyError(error)) return MarkSticky(error, what);
  cudaGetLastError();  // not sticky: clear it
  const std::string message = absl::StrCat("CUDA ", what, ": ", cudaGetErrorName(error), " (",
                                           cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat("GPU out of memory: ", message));
  }
  return absl::InternalError(message);
}

absl::Status DeviceHealth::Check(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat("cuBLAS ", what, ": ", cublasGetStatusName(status), " (",
                                           cublasGetStatusString(status), ")");
  if (status == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("GPU out of memory: ", message));
  }
  // cuBLAS reports a failed launch as its own status; the runtime says
  // whether the context behind it is gone.
  const cudaError_t runtime = cudaPeekAtLastError();
  if (IsStickyError(runtime)) return MarkSticky(runtime, absl::StrCat("cuBLAS ", what));
  return absl::InternalError(message);
}

absl::Status DeviceHealth::status() const {
  if (healthy_.load()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return absl::UnavailableError(
      absl::StrCat("CUDA engine stopped after an unrecoverable device error: ", first_sticky_));
}

}  // namespace internal_cuda
}  // namespace flce
