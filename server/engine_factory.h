#ifndef FLCE_SERVER_ENGINE_FACTORY_H_
#define FLCE_SERVER_ENGINE_FACTORY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/cuda/cuda_engine_options.h"
#include "kernels/loss_engine.h"

namespace flce {

struct EngineOptions {
  CpuEngineOptions cpu;
  CudaEngineOptions cuda;  // used when the build has the CUDA engine
  // Every problem's vocabulary in this many shards (kernels/sharded_engine.h),
  // combined in the server: the path of a server with one engine per device,
  // on one (--vocab_shards). 1: off. Needs an engine with shards.
  int vocab_shards = 1;
  // --cuda_devices: a CUDA engine on each device listed (cuda.device is then
  // ignored), every problem sharded over them by vocabulary (at least one
  // shard per engine), dX's parts summed with NCCL across distinct devices.
  // A device listed more than once gives engines sharing it (their sums
  // added on it): the several-engine path on one GPU, for tests. Empty or
  // one device: one engine.
  std::vector<int> cuda_devices;
  // With several cuda_devices: "shard" every problem over them, or
  // "spread" requests over them whole (kernels/spread_engine.h).
  std::string cuda_devices_mode = "shard";
};

// True if this build has the CUDA engine.
bool CudaBuiltIn();

// The engine for --backend: "cpu"; "cuda" (UNIMPLEMENTED when this build has
// no CUDA engine, UNAVAILABLE without a usable device); "auto": CUDA when
// built in and a device is usable, else CPU (with a logged warning saying
// why). INVALID_ARGUMENT for anything else. With options.vocab_shards > 1,
// the engine behind a ShardedEngine (INVALID_ARGUMENT where the engine has
// no shards). With several options.cuda_devices ("cuda" or "auto"), a
// ShardedEngine over an engine per device (UNAVAILABLE when one does not
// start or NCCL does not load).
absl::StatusOr<std::unique_ptr<LossEngine>> CreateEngine(const std::string& backend,
                                                         const EngineOptions& options);

}  // namespace flce

#endif  // FLCE_SERVER_ENGINE_FACTORY_H_
