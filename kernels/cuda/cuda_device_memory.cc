#include "kernels/cuda/cuda_device_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {
namespace {

// Device memory given back by `release` (on the block's device) when
// destroyed: another process's allocation mapped through CUDA IPC (closed),
// or a staged copy's memory from the stream-ordered pool (freed on the
// staging stream, after the copy; the calls that read it synchronized
// their lanes before they returned).
class ReleasedBlock : public DeviceBlock {
 public:
  ReleasedBlock(int device, void* data, int64_t bytes, std::function<void(void*)> release)
      : device_(device), data_(data), bytes_(bytes), release_(std::move(release)) {}
  ~ReleasedBlock() override {
    cudaSetDevice(device_);
    release_(data_);
  }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  const int device_;
  void* const data_;
  const int64_t bytes_;
  const std::function<void(void*)> release_;
};

// An event (another process's, opened through CUDA IPC, or a staged
// copy's); destroyed with this.
class OwnedEvent : public DeviceEvent {
 public:
  OwnedEvent(int device, cudaEvent_t event) : device_(device), event_(event) {}
  ~OwnedEvent() override {
    cudaSetDevice(device_);
    cudaEventDestroy(event_);
  }
  void* native() const override { return event_; }

 private:
  const int device_;
  const cudaEvent_t event_;
};

// Device memory of CudaDeviceMemory::Allocate, freed when destroyed;
// counted in `allocated` (shared with the engine, which it may outlive)
// while alive.
class OwnedDeviceBlock : public DeviceBlock {
 public:
  OwnedDeviceBlock(int device, void* data, int64_t bytes,
                   std::shared_ptr<std::atomic<int64_t>> allocated)
      : device_(device), data_(data), bytes_(bytes), allocated_(std::move(allocated)) {
    *allocated_ += bytes_;
  }
  ~OwnedDeviceBlock() override {
    cudaSetDevice(device_);
    cudaFree(data_);
    *allocated_ -= bytes_;
  }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  const int device_;
  void* const data_;
  const int64_t bytes_;
  const std::shared_ptr<std::atomic<int64_t>> allocated_;
};

// The size of the allocation that starts at `base`, from the driver's
// cuMemGetAddressRange (reached through the runtime, so the binary needs
// no link against the driver library).
absl::StatusOr<int64_t> AllocationBytes(void* base) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetAddressRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get_range == nullptr) return absl::InternalError("cuMemGetAddressRange is not available");
  CUdeviceptr start = 0;
  size_t size = 0;
  const CUresult result = get_range(&start, &size, reinterpret_cast<CUdeviceptr>(base));
  if (result != CUDA_SUCCESS || start != reinterpret_cast<CUdeviceptr>(base)) {
    return absl::InternalError(
        absl::StrCat("cuMemGetAddressRange failed on a mapped IPC handle (", result, ")"));
  }
  return static_cast<int64_t>(size);
}

// A CUDA IPC handle (`Handle`, a cudaIpc*Handle_t) from the wire, its size
// checked (INVALID_ARGUMENT naming `field` and `type`).
template <typename Handle>
absl::StatusOr<Handle> ParseIpcHandle(const std::string& bytes, const char* field,
                                      const char* type) {
  if (bytes.size() != sizeof(Handle)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", sizeof(Handle), " bytes (",
                                                   type, "), got ", bytes.size()));
  }
  Handle handle;
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  return handle;
}

}  // namespace

absl::Status CudaDeviceMemory::SetDevice() {
  FLCE_RETURN_IF_ERROR(health_.status());
  return health_.Check(cudaSetDevice(device_), "cudaSetDevice");
}

absl::StatusOr<std::unique_ptr<DeviceBlock>> CudaDeviceMemory::Allocate(int64_t bytes) {
  FLCE_RETURN_IF_ERROR(SetDevice());
  void* data = nullptr;
  const cudaError_t error = cudaMalloc(&data, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("device memory: ", bytes, " bytes do not fit on the GPU"));
  }
  FLCE_RETURN_IF_ERROR(health_.Check(error, "cudaMalloc"));
  auto memory = std::make_unique<OwnedDeviceBlock>(device_, data, bytes, allocated_);
  FLCE_RETURN_IF_ERROR(health_.Check(cudaMemset(data, 0, bytes), "zero device memory"));
  return std::unique_ptr<DeviceBlock>(std::move(memory));
}

absl::Status CudaDeviceMemory::CopyToHost(const void* device, void* host, int64_t bytes) {
  FLCE_RETURN_IF_ERROR(SetDevice());
  FLCE_RETURN_IF_ERROR(health_.Check(cudaDeviceSynchronize(), "copy to host"));
  return health_.Check(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

absl::Status CudaDeviceMemory::CopyToDevice(const void* host, void* device, int64_t bytes) {
  FLCE_RETURN_IF_ERROR(SetDevice());
  return health_.Check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "copy to device");
}

absl::Status CudaDeviceMemory::Zero(void* device, int64_t bytes) {
  FLCE_RETURN_IF_ERROR(SetDevice());
  FLCE_RETURN_IF_ERROR(health_.Check(cudaDeviceSynchronize(), "zero device memory"));
  FLCE_RETURN_IF_ERROR(health_.Check(cudaMemset(device, 0, bytes), "zero device memory"));
  return health_.Check(cudaDeviceSynchronize(), "zero device memory");
}

absl::StatusOr<StagedCopy> CudaDeviceMemory::StageToDevice(const void* host, int64_t bytes) {
  FLCE_RETURN_IF_ERROR(SetDevice());
  cudaPointerAttributes where{};
  if (cudaPointerGetAttributes(&where, host) != cudaSuccess) {
    cudaGetLastError();
    where.type = cudaMemoryTypeUnregistered;
  }
  if (where.type != cudaMemoryTypeHost) {
    return absl::FailedPreconditionError("staging: the host memory is not page-locked");
  }
  std::shared_ptr<CudaStream> stream;
  {
    absl::MutexLock lock(&stage_mu_);
    if (stage_stream_ == nullptr) {
      FLCE_ASSIGN_OR_RETURN(CudaStream created, CudaStream::Create(health_));
      stage_stream_ = std::make_shared<CudaStream>(std::move(created));
    }
    stream = stage_stream_;
  }
  void* data = nullptr;
  const cudaError_t error =
      cudaMallocAsync(&data, static_cast<size_t>(std::max<int64_t>(bytes, 1)), stream->get());
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("staging: ", bytes, " bytes do not fit on the GPU"));
  }
  FLCE_RETURN_IF_ERROR(health_.Check(error, "staging: cudaMallocAsync"));
  StagedCopy staged;
  // The stream lives as long as any of its blocks.
  staged.block = std::make_unique<ReleasedBlock>(
      device_, data, bytes, [stream](void* memory) { cudaFreeAsync(memory, stream->get()); });
  FLCE_RETURN_IF_ERROR(health_.Check(
      cudaMemcpyAsync(data, host, bytes, cudaMemcpyHostToDevice, stream->get()), "staging a copy"));
  cudaEvent_t event = nullptr;
  FLCE_RETURN_IF_ERROR(health_.Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                     "staging: cudaEventCreate"));
  staged.ready = std::make_unique<OwnedEvent>(device_, event);
  FLCE_RETURN_IF_ERROR(
      health_.Check(cudaEventRecord(event, stream->get()), "staging: cudaEventRecord"));
  return staged;
}

namespace {

// Host memory page-locked by cudaHostRegister, unlocked when destroyed.
class PinnedHostBlock : public DeviceBlock {
 public:
  PinnedHostBlock(void* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  ~PinnedHostBlock() override { cudaHostUnregister(data_); }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* const data_;
  const int64_t bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBlock>> CudaDeviceMemory::PinHostMemory(void* host,
                                                                             int64_t bytes) {
  FLCE_RETURN_IF_ERROR(SetDevice());
  // Portable: locked for every device's context, so that a weight's parts
  // on several devices all copy into it at the bus's rate.
  const cudaError_t error =
      cudaHostRegister(host, static_cast<size_t>(bytes), cudaHostRegisterPortable);
  if (error != cudaSuccess && !IsStickyError(error)) {
    cudaGetLastError();  // e.g. over the locked-memory limit: not the device's fault
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot page-lock ", bytes, " bytes of host memory: ", cudaGetErrorName(error)));
  }
  FLCE_RETURN_IF_ERROR(health_.Check(error, "cudaHostRegister"));
  return std::unique_ptr<DeviceBlock>(std::make_unique<PinnedHostBlock>(host, bytes));
}

absl::Status CudaDeviceMemory::OpenError(cudaError_t error, const char* call, const char* field,
                                         const char* origin) {
  if (IsStickyError(error)) return health_.Check(error, call);
  cudaGetLastError();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": cannot open it (", cudaGetErrorName(error), "); it must come from ", origin));
}

absl::StatusOr<std::unique_ptr<DeviceBlock>> CudaDeviceMemory::ImportCudaIpc(
    const std::string& handle) {
  FLCE_RETURN_IF_ERROR(health_.status());
  FLCE_ASSIGN_OR_RETURN(
      const cudaIpcMemHandle_t ipc,
      ParseIpcHandle<cudaIpcMemHandle_t>(handle, "cuda_ipc_handle", "cudaIpcMemHandle_t"));
  FLCE_RETURN_IF_ERROR(SetDevice());
  void* base = nullptr;
  const cudaError_t error = cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    return OpenError(error, "cudaIpcOpenMemHandle", "cuda_ipc_handle",
                     "cudaIpcGetMemHandle in another process on this host, for an allocation "
                     "that is still alive");
  }
  absl::StatusOr<int64_t> bytes = AllocationBytes(base);
  if (!bytes.ok()) {
    cudaIpcCloseMemHandle(base);
    return bytes.status();
  }
  return std::unique_ptr<DeviceBlock>(new ReleasedBlock(
      device_, base, *bytes, [](void* memory) { cudaIpcCloseMemHandle(memory); }));
}

absl::StatusOr<std::unique_ptr<DeviceEvent>> CudaDeviceMemory::ImportCudaIpcEvent(
    const std::string& handle) {
  FLCE_RETURN_IF_ERROR(health_.status());
  FLCE_ASSIGN_OR_RETURN(const cudaIpcEventHandle_t ipc,
                        ParseIpcHandle<cudaIpcEventHandle_t>(handle, "cuda_ipc_event_handle",
                                                             "cudaIpcEventHandle_t"));
  FLCE_RETURN_IF_ERROR(SetDevice());
  cudaEvent_t event = nullptr;
  const cudaError_t error = cudaIpcOpenEventHandle(&event, ipc);
  if (error != cudaSuccess) {
    return OpenError(error, "cudaIpcOpenEventHandle", "cuda_ipc_event_handle",
                     "cudaIpcGetEventHandle in another process on this host, for an event made "
                     "with cudaEventInterprocess | cudaEventDisableTiming");
  }
  return std::unique_ptr<DeviceEvent>(new OwnedEvent(device_, event));
}

}  // namespace internal_cuda
}  // namespace flce
