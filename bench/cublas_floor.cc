#include "bench/cublas_floor.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/loss_kernels.h"
#include "kernels/status_macros.h"

namespace flce {

using internal_cuda::CublasHandle;
using internal_cuda::CublasStatus;
using internal_cuda::CudaStatus;
using internal_cuda::CudaStream;
using internal_cuda::DeviceBuffer;

struct GemmFloor::State {
  int64_t n = 0, h = 0, v = 0;
  int logits_gemms = 1;
  cudaDataType_t type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  CudaStream stream;
  CublasHandle blas;
  DeviceBuffer x, w, z, dx, dw;
  cudaEvent_t start = nullptr, stop = nullptr;

  ~State() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }

  absl::Status Sequence() {
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < logits_gemms; ++i) {
      // logits [N, V] = X · Wᵀ (the engine's column-major mapping).
      FLCE_RETURN_IF_ERROR(CublasStatus(
          cublasGemmEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, &one, w.data(), type, h,
                       x.data(), type, h, &zero, z.data(), type, v, compute,
                       CUBLAS_GEMM_DEFAULT),
          "logits"));
    }
    // dX [N, H] = dZ · W.
    FLCE_RETURN_IF_ERROR(CublasStatus(
        cublasGemmEx(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, &one, w.data(), type, h,
                     z.data(), type, v, &zero, dx.data(), type, h, compute, CUBLAS_GEMM_DEFAULT),
        "dX"));
    // dW [V, H] = dZᵀ · X.
    return CublasStatus(
        cublasGemmEx(blas.get(), CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, &one, x.data(), type, h,
                     z.data(), type, v, &zero, dw.data(), type, h, compute, CUBLAS_GEMM_DEFAULT),
        "dW");
  }
};

absl::StatusOr<std::unique_ptr<GemmFloor>> GemmFloor::Create(int64_t n, int64_t h, int64_t v,
                                                             DType dtype, int logits_gemms) {
  auto st = std::make_unique<State>();
  st->n = n;
  st->h = h;
  st->v = v;
  st->logits_gemms = logits_gemms;
  st->type = dtype == DType::kBFloat16  ? CUDA_R_16BF
             : dtype == DType::kFloat16 ? CUDA_R_16F
                                        : CUDA_R_32F;
  st->compute = dtype == DType::kFloat32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  FLCE_ASSIGN_OR_RETURN(st->stream, CudaStream::Create());
  cudaStream_t s = st->stream.get();
  FLCE_ASSIGN_OR_RETURN(st->blas, CublasHandle::Create(s));
  const int64_t elem = DTypeSize(dtype);
  FLCE_ASSIGN_OR_RETURN(st->x, DeviceBuffer::Allocate(n * h * elem, s));
  FLCE_ASSIGN_OR_RETURN(st->w, DeviceBuffer::Allocate(v * h * elem, s));
  FLCE_ASSIGN_OR_RETURN(st->z, DeviceBuffer::Allocate(n * v * elem, s));
  FLCE_ASSIGN_OR_RETURN(st->dx, DeviceBuffer::Allocate(n * h * elem, s));
  FLCE_ASSIGN_OR_RETURN(st->dw, DeviceBuffer::Allocate(v * h * elem, s));
  // Random-ish operands: small fp32 patterns converted to dtype (never zeros).
  std::vector<float> pattern(1 << 20);
  for (size_t i = 0; i < pattern.size(); ++i) {
    pattern[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  }
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer p, DeviceBuffer::Allocate(pattern.size() * 4, s));
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(p.data(), pattern.data(), pattern.size() * 4,
                                                  cudaMemcpyHostToDevice, s),
                                  "upload"));
  for (DeviceBuffer* b : {&st->x, &st->w, &st->z}) {
    const int64_t count = b->bytes() / elem;
    for (int64_t first = 0; first < count; first += static_cast<int64_t>(pattern.size())) {
      const int64_t m = std::min<int64_t>(pattern.size(), count - first);
      FLCE_RETURN_IF_ERROR(CudaStatus(
          internal_cuda::LaunchConvert(p.data(), DType::kFloat32, b->as<char>() + first * elem,
                                       dtype, m, 0.05f, s),
          "fill"));
    }
  }
  // The host pattern must outlive its upload.
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(s), "fill"));
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&st->start), "cudaEventCreate"));
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&st->stop), "cudaEventCreate"));
  return std::unique_ptr<GemmFloor>(new GemmFloor(std::move(st)));
}

GemmFloor::GemmFloor(std::unique_ptr<State> state) : state_(std::move(state)) {}

GemmFloor::~GemmFloor() = default;

absl::StatusOr<double> GemmFloor::RunMs() {
  cudaStream_t s = state_->stream.get();
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(state_->start, s), "cudaEventRecord"));
  FLCE_RETURN_IF_ERROR(state_->Sequence());
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(state_->stop, s), "cudaEventRecord"));
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(state_->stop), "floor"));
  float elapsed = 0;
  FLCE_RETURN_IF_ERROR(
      CudaStatus(cudaEventElapsedTime(&elapsed, state_->start, state_->stop), "floor"));
  return static_cast<double>(elapsed);
}

}  // namespace flce
