#ifndef FLCE_SERVER_ENGINE_FACTORY_H_
#define FLCE_SERVER_ENGINE_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/loss_engine.h"

namespace flce {

// The engine for --backend: "cpu"; "cuda" (UNIMPLEMENTED when this build has
// no CUDA engine); "auto": CUDA when built in and a device is present, else
// CPU (with a logged warning). INVALID_ARGUMENT for anything else.
absl::StatusOr<std::unique_ptr<LossEngine>> CreateEngine(
    const std::string& backend, const CpuEngineOptions& cpu_options);

}  // namespace flce

#endif  // FLCE_SERVER_ENGINE_FACTORY_H_
