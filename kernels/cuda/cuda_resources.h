#ifndef FLCE_KERNELS_CUDA_CUDA_RESOURCES_H_
#define FLCE_KERNELS_CUDA_CUDA_RESOURCES_H_

// Move-only RAII owners of CUDA and cuBLAS resources (no chains of cudaFree
// on error paths), and a timer of device work. Their errors go through a
// DeviceHealth (device_health.h).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/device_health.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {

class CudaStream {
 public:
  static absl::StatusOr<CudaStream> Create(DeviceHealth& health);
  CudaStream() = default;
  CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept;
  ~CudaStream();
  cudaStream_t get() const { return stream_; }

 private:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  cudaStream_t stream_ = nullptr;
};

// An event without timing (cudaEventDisableTiming).
class CudaEvent {
 public:
  static absl::StatusOr<CudaEvent> Create(DeviceHealth& health);
  CudaEvent() = default;
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  ~CudaEvent();
  cudaEvent_t get() const { return event_; }

 private:
  explicit CudaEvent(cudaEvent_t e) : event_(e) {}
  cudaEvent_t event_ = nullptr;
};

class CublasHandle {
 public:
  // A handle bound to `stream`.
  static absl::StatusOr<CublasHandle> Create(cudaStream_t stream, DeviceHealth& health);
  CublasHandle() = default;
  CublasHandle(CublasHandle&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  CublasHandle& operator=(CublasHandle&& o) noexcept;
  ~CublasHandle();
  cublasHandle_t get() const { return handle_; }

 private:
  explicit CublasHandle(cublasHandle_t h) : handle_(h) {}
  cublasHandle_t handle_ = nullptr;
};

// Device memory from the stream-ordered allocator (cudaMallocAsync on the
// device's default pool, which the engine keeps from releasing memory, so a
// request reuses what the last one freed). Freed on the allocating stream.
class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes, cudaStream_t stream,
                                               DeviceHealth& health);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)),
        stream_(o.stream_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  ~DeviceBuffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  DeviceBuffer(void* data, int64_t bytes, cudaStream_t stream)
      : data_(data), bytes_(bytes), stream_(stream) {}
  void Free();
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

// Device time of the work a callable puts on a stream, from CUDA events
// recorded around it.
class EventTimer {
 public:
  explicit EventTimer(DeviceHealth& health) : health_(health) {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Milliseconds of f()'s work on `stream`, waited for.
  template <typename F>
  absl::StatusOr<float> Time(cudaStream_t stream, F&& f) {
    FLCE_RETURN_IF_ERROR(health_.Check(cudaEventRecord(start_, stream), "timer event"));
    FLCE_RETURN_IF_ERROR(f());
    FLCE_RETURN_IF_ERROR(health_.Check(cudaEventRecord(stop_, stream), "timer event"));
    FLCE_RETURN_IF_ERROR(health_.Check(cudaEventSynchronize(stop_), "timed work"));
    float ms = 0;
    FLCE_RETURN_IF_ERROR(health_.Check(cudaEventElapsedTime(&ms, start_, stop_), "timer event"));
    return ms;
  }

  // The median of `iters` timed runs of f after `untimed` runs.
  template <typename F>
  absl::StatusOr<double> MedianMs(cudaStream_t stream, int untimed, int iters, F&& f) {
    std::vector<float> ms;
    for (int i = 0; i < untimed + iters; ++i) {
      FLCE_ASSIGN_OR_RETURN(const float t, Time(stream, f));
      if (i >= untimed) ms.push_back(t);
    }
    if (ms.empty()) return 0.0;
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

 private:
  DeviceHealth& health_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_CUDA_RESOURCES_H_
