#ifndef FLCE_SERVER_ENGINE_FACTORY_H_
#define FLCE_SERVER_ENGINE_FACTORY_H_

#include <memory>
#include <string>

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
};

// True if this build has the CUDA engine.
bool CudaBuiltIn();

// The engine for --backend: "cpu"; "cuda" (UNIMPLEMENTED when this build has
// no CUDA engine, UNAVAILABLE without a usable device); "auto": CUDA when
// built in and a device is usable, else CPU (with a logged warning saying
// why). INVALID_ARGUMENT for anything else. With options.vocab_shards > 1,
// the engine behind a ShardedEngine (INVALID_ARGUMENT where the engine has
// no shards).
absl::StatusOr<std::unique_ptr<LossEngine>> CreateEngine(const std::string& backend,
                                                         const EngineOptions& options);

}  // namespace flce

#endif  // FLCE_SERVER_ENGINE_FACTORY_H_
