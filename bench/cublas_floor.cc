#include "bench/cublas_floor.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/device_health.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/status_macros.h"

namespace flce {

using internal_cuda::CublasHandle;
using internal_cuda::CudaStream;
using internal_cuda::DeviceBuffer;
using internal_cuda::GemmRunner;
using internal_cuda::GemmShape;

internal_cuda::DeviceHealth& BenchHealth() {
  static auto* health = new internal_cuda::DeviceHealth();
  return *health;
}

namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  return BenchHealth().Check(error, what);
}

}  // namespace

absl::Status FillPattern(const DeviceBuffer& b, DType dtype, cudaStream_t s) {
  std::vector<float> pattern(1 << 20);
  for (size_t i = 0; i < pattern.size(); ++i) {
    pattern[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  }
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer p,
                        DeviceBuffer::Allocate(pattern.size() * 4, s, BenchHealth()));
  FLCE_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(p.data(), pattern.data(), pattern.size() * 4, cudaMemcpyHostToDevice, s),
      "upload"));
  const int64_t elem = DTypeSize(dtype), count = b.bytes() / elem;
  for (int64_t first = 0; first < count; first += static_cast<int64_t>(pattern.size())) {
    const int64_t m = std::min<int64_t>(pattern.size(), count - first);
    FLCE_RETURN_IF_ERROR(
        CudaStatus(internal_cuda::LaunchConvert(p.data(), DType::kFloat32,
                                                b.as<char>() + first * elem, dtype, m, 0.05f, s),
                   "fill"));
  }
  return CudaStatus(cudaStreamSynchronize(s), "fill");
}

absl::StatusOr<GemmFloor> MeasureGemmFloor(int64_t n, int64_t h, int64_t v, DType dtype,
                                           int logits_gemms, bool tuned, int warmup, int iters) {
  FLCE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(BenchHealth()));
  cudaStream_t s = stream.get();
  FLCE_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create(s, BenchHealth()));
  const int64_t elem = DTypeSize(dtype);
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::Allocate(n * h * elem, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(v * h * elem, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer z, DeviceBuffer::Allocate(n * v * elem, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer dx, DeviceBuffer::Allocate(n * h * elem, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer dw, DeviceBuffer::Allocate(v * h * elem, s, BenchHealth()));
  for (const DeviceBuffer* b : {&x, &w, &z}) FLCE_RETURN_IF_ERROR(FillPattern(*b, dtype, s));
  internal_cuda::GemmTuning tuning;
  tuning.enabled = tuned;
  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<GemmRunner> gemms,
                        GemmRunner::Create(tuning, BenchHealth()));
  auto gemm = [&](cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t gn, int64_t k,
                  const DeviceBuffer& a, int64_t lda, const DeviceBuffer& b, int64_t ldb,
                  DeviceBuffer& c, int64_t ldc) {
    const GemmShape shape{op_a, op_b, m, gn, k, dtype, lda, dtype, ldb, dtype, ldc};
    return gemms->Run(blas.get(), s, shape, a.data(), b.data(), 0.0f, c.data());
  };
  auto sequence = [&]() -> absl::Status {
    for (int i = 0; i < logits_gemms; ++i) {
      // logits [N, V] = X · Wᵀ (the engine's column-major mapping).
      FLCE_RETURN_IF_ERROR(gemm(CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, w, h, x, h, z, v));
    }
    // dX [N, H] = dZ · W.
    FLCE_RETURN_IF_ERROR(gemm(CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, w, h, z, v, dx, h));
    // dW [V, H] = dZᵀ · X.
    return gemm(CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, x, h, z, v, dw, h);
  };
  internal_cuda::EventTimer timer(BenchHealth());
  FLCE_ASSIGN_OR_RETURN(const double median, timer.MedianMs(s, warmup, iters, sequence));
  GemmFloor floor;
  floor.ms = median;
  floor.tflops = 2.0 * n * h * v * (logits_gemms + 2) / (floor.ms * 1e9);
  return floor;
}

absl::StatusOr<GemmFloor> MeasureGemmCeiling(int64_t size, DType dtype, int warmup, int iters) {
  FLCE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(BenchHealth()));
  cudaStream_t s = stream.get();
  FLCE_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create(s, BenchHealth()));
  const int64_t bytes = size * size * DTypeSize(dtype);
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Allocate(bytes, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(bytes, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer c, DeviceBuffer::Allocate(bytes, s, BenchHealth()));
  for (const DeviceBuffer* m : {&a, &b}) FLCE_RETURN_IF_ERROR(FillPattern(*m, dtype, s));
  const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N, size, size, size, dtype, size, dtype, size,
                        dtype, size};
  internal_cuda::EventTimer timer(BenchHealth());
  double best = 0;
  for (bool tuned : {false, true}) {
    internal_cuda::GemmTuning tuning;
    tuning.enabled = tuned;
    FLCE_ASSIGN_OR_RETURN(std::unique_ptr<GemmRunner> gemms,
                          GemmRunner::Create(tuning, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(const double ms, timer.MedianMs(s, warmup, iters, [&] {
      return gemms->Run(blas.get(), s, shape, a.data(), b.data(), 0.0f, c.data());
    }));
    if (best == 0 || ms < best) best = ms;
  }
  GemmFloor ceiling;
  ceiling.ms = best;
  ceiling.tflops = 2.0 * size * size * size / (best * 1e9);
  return ceiling;
}

}  // namespace flce
