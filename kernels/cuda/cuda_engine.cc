#include "kernels/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_device_memory.h"
#include "kernels/cuda/device_health.h"
#include "kernels/cuda/device_pipeline.h"
#include "kernels/cuda/device_problem.h"
#include "kernels/cuda/device_runner.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lane_pool.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {

// The engine's parts. Members are destroyed in reverse: the lanes (waiting
// for their work) before the GEMM runner, the health last.
class EngineImpl {
 public:
  EngineImpl(const CudaEngineOptions& options) : options(options), memory(options.device, health) {}

  absl::Status Init() {
    FLCE_RETURN_IF_ERROR(SetDevice());
    FLCE_RETURN_IF_ERROR(
        health.Check(cudaGetDeviceProperties(&props, options.device), "cudaGetDeviceProperties"));
    // Keep freed memory in the stream-ordered pool so requests reuse it.
    cudaMemPool_t pool;
    FLCE_RETURN_IF_ERROR(health.Check(cudaDeviceGetDefaultMemPool(&pool, options.device),
                                      "cudaDeviceGetDefaultMemPool"));
    uint64_t threshold = std::numeric_limits<uint64_t>::max();
    FLCE_RETURN_IF_ERROR(
        health.Check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
                     "cudaMemPoolSetAttribute"));
    GemmTuning tuning;
    tuning.enabled = options.tune_gemms;
    tuning.hopper = options.hopper_gemms;
    FLCE_ASSIGN_OR_RETURN(gemms, GemmRunner::Create(tuning, health));
    FLCE_ASSIGN_OR_RETURN(lanes, LanePool::Create(options.lanes, health));
    return absl::OkStatus();
  }

  // The calling thread on the engine's device, while the engine is healthy.
  absl::Status SetDevice() {
    FLCE_RETURN_IF_ERROR(health.status());
    return health.Check(cudaSetDevice(options.device), "cudaSetDevice");
  }

  PipelineParts parts() { return {options, *gemms, *lanes}; }

  const CudaEngineOptions options;
  cudaDeviceProp props{};
  DeviceHealth health;
  CudaDeviceMemory memory;
  std::unique_ptr<GemmRunner> gemms;
  std::unique_ptr<LanePool> lanes;
  // Forward calls whose one-pass rows asked for the two-pass rerun.
  std::atomic<int64_t> forward_reruns{0};
};

}  // namespace internal_cuda

using internal_cuda::CallContext;
using internal_cuda::LanePool;

namespace {

// The lane's later work runs after the worker's `ready` event, if any: a
// wait on the device, not on the host.
absl::Status WaitFor(const internal_cuda::Lane& lane, const DeviceEvent* ready) {
  if (ready == nullptr) return absl::OkStatus();
  return lane.Check(
      cudaStreamWaitEvent(lane.stream(), static_cast<cudaEvent_t>(ready->native()), 0),
      "waiting for the worker's event");
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(const CudaEngineOptions& options) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: ", cudaGetErrorString(error)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", options.device, " not present (", count, " device(s))"));
  }
  auto impl = std::make_unique<internal_cuda::EngineImpl>(options);
  FLCE_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

CudaEngine::CudaEngine(std::unique_ptr<internal_cuda::EngineImpl> impl) : impl_(std::move(impl)) {}

CudaEngine::~CudaEngine() = default;

std::vector<DeviceInfo> CudaEngine::devices() const {
  DeviceInfo info;
  info.name = impl_->props.name;
  info.total_memory_bytes = static_cast<int64_t>(impl_->props.totalGlobalMem);
  return {info};
}

absl::Status CudaEngine::health() const { return impl_->health.status(); }

int CudaEngine::tuned_gemm_shapes() const { return impl_->gemms->counts().tuned; }

int CudaEngine::hopper_gemm_shapes() const { return impl_->gemms->counts().hopper; }

void CudaEngine::InjectGemmFaultForTesting() { impl_->gemms->InjectFaultForTesting(); }

int64_t CudaEngine::forward_reruns() const { return impl_->forward_reruns.load(); }

int64_t CudaEngine::device_memory_bytes() const {
  // The stream-ordered pool's reservation (freed workspace stays in it) and
  // the long-lived allocations (registered weights, their accumulators).
  cudaMemPool_t pool;
  uint64_t reserved = 0;
  if (cudaDeviceGetDefaultMemPool(&pool, impl_->options.device) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) != cudaSuccess) {
    cudaGetLastError();
    return impl_->memory.allocated_bytes();
  }
  return static_cast<int64_t>(reserved) + impl_->memory.allocated_bytes();
}

int64_t CudaEngine::SavedStateBytes(const LossProblem& problem, BackwardMode mode) const {
  return internal_cuda::SavedStateBytes(impl_->options, problem, mode);
}

absl::StatusOr<ForwardResult> CudaEngine::Forward(const LossProblem& problem,
                                                  const ForwardSpec& spec,
                                                  const CancelFn& cancelled) {
  FLCE_RETURN_IF_ERROR(impl_->SetDevice());
  LanePool::Lease lane(*impl_->lanes);
  const CallContext call{impl_->options, *impl_->gemms, *lane, cancelled};
  FLCE_RETURN_IF_ERROR(WaitFor(*lane, problem.ready));
  FLCE_ASSIGN_OR_RETURN(internal_cuda::DeviceInputs in,
                        internal_cuda::MakeDeviceInputs(*lane, problem));
  FLCE_ASSIGN_OR_RETURN(
      internal_cuda::DeviceForward forward,
      internal_cuda::ForwardOnDevice(
          call, std::make_shared<const internal_cuda::DeviceInputs>(std::move(in)), spec));
  if (forward.reran) impl_->forward_reruns.fetch_add(1);
  return std::move(forward.result);
}

absl::StatusOr<Gradients> CudaEngine::Backward(SavedState& state, const BackwardSpec& spec,
                                               const CancelFn& cancelled) {
  FLCE_RETURN_IF_ERROR(impl_->SetDevice());
  LanePool::Lease lane(*impl_->lanes);
  const CallContext call{impl_->options, *impl_->gemms, *lane, cancelled};
  FLCE_RETURN_IF_ERROR(WaitFor(*lane, spec.ready));
  return internal_cuda::BackwardOnDevice(call, state, spec);
}

DeviceMemory* CudaEngine::device_memory() const { return &impl_->memory; }

absl::StatusOr<std::unique_ptr<DeviceRun>> CudaEngine::PrepareDeviceRun(const LossProblem& problem,
                                                                        BackwardMode mode) {
  FLCE_RETURN_IF_ERROR(impl_->SetDevice());
  return internal_cuda::PrepareDeviceRun(impl_->parts(), problem, mode);
}

}  // namespace flce
