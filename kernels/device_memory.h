#ifndef FLCE_KERNELS_DEVICE_MEMORY_H_
#define FLCE_KERNELS_DEVICE_MEMORY_H_

// Device memory as a service beside the loss math (kernels/loss_engine.h):
// what the registries of weights and shared memory ask an engine with a
// device for. An engine without one has none (LossEngine::device_memory()
// is null).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace flce {

// A block of device memory: an allocation of this process (freed when
// destroyed) or another process's mapped through CUDA IPC (unmapped when
// destroyed). Either may outlive the engine that made it.
class DeviceBlock {
 public:
  virtual ~DeviceBlock() = default;
  virtual void* data() const = 0;
  virtual int64_t bytes() const = 0;
};

// An event another process (a same-host worker) records on its stream,
// mapped through CUDA IPC: device work made to wait for it runs after the
// work that process queued before its latest record. Closed when destroyed.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // The engine's native handle (a cudaEvent_t for the CUDA engine).
  virtual void* native() const = 0;
};

// A device copy of host bytes made ahead of the call that reads them
// (DeviceMemory::StageToDevice): its memory, given back when destroyed
// (after the copy), and the event recorded after the copy.
struct StagedCopy {
  std::unique_ptr<DeviceBlock> block;
  std::unique_ptr<DeviceEvent> ready;
};

// Bytes of a cudaIpcMemHandle_t and of a cudaIpcEventHandle_t.
inline constexpr int kCudaIpcHandleBytes = 64;

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // Maps the device allocation a cudaIpcMemHandle_t (kCudaIpcHandleBytes)
  // names, for views and destinations in MemorySpace::kCuda.
  // INVALID_ARGUMENT for a handle that does not open.
  virtual absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpc(const std::string& handle) = 0;

  // Opens the event a cudaIpcEventHandle_t (kCudaIpcHandleBytes) names (an
  // event made with cudaEventInterprocess | cudaEventDisableTiming).
  // INVALID_ARGUMENT for a handle that does not open.
  virtual absl::StatusOr<std::unique_ptr<DeviceEvent>> ImportCudaIpcEvent(
      const std::string& handle) = 0;

  // `bytes` of zeroed device memory, for long-lived tensors such as a
  // registered weight's device copy and gradient sum. RESOURCE_EXHAUSTED
  // when it does not fit.
  virtual absl::StatusOr<std::unique_ptr<DeviceBlock>> Allocate(int64_t bytes) = 0;

  // Copies `bytes` of device memory (an Allocate or ImportCudaIpc block) to
  // host memory, after all of the engine's work queued before the call.
  virtual absl::Status CopyToHost(const void* device, void* host, int64_t bytes) = 0;

  // Copies `bytes` of host memory into an Allocate block, complete when it
  // returns.
  virtual absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) = 0;

  // Zeroes `bytes` of an Allocate block, after all of the engine's work
  // queued before the call; complete when it returns.
  virtual absl::Status Zero(void* device, int64_t bytes) = 0;

  // Page-locks `bytes` of this process's host memory at `host` (whole
  // pages) so that copies between it and the device run at the bus's rate
  // (cudaHostRegister); unlocked when the returned block (data() = host) is
  // destroyed, which must come before the memory is unmapped. An error
  // leaves the memory as it was (copies then go through staging).
  virtual absl::StatusOr<std::unique_ptr<DeviceBlock>> PinHostMemory(void* host, int64_t bytes) = 0;

  // Starts a device copy of `bytes` of page-locked host memory at `host`
  // on a stream of its own, beside the engine's calls, and returns at once:
  // device work made to wait for `ready` sees the bytes. The host bytes
  // must stay as they are until then. FAILED_PRECONDITION for pageable
  // memory (its copy would hold the calling thread), RESOURCE_EXHAUSTED
  // when the device has no room; UNIMPLEMENTED without a device.
  virtual absl::StatusOr<StagedCopy> StageToDevice(const void* host, int64_t bytes) {
    return absl::UnimplementedError("staging: no device");
  }
};

}  // namespace flce

#endif  // FLCE_KERNELS_DEVICE_MEMORY_H_
