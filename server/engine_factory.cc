#include "server/engine_factory.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/sharded_engine.h"
#include "kernels/spread_engine.h"
#include "kernels/status_macros.h"
#include "spdlog/spdlog.h"

#ifdef FLCE_WITH_CUDA
#include "kernels/cuda/cuda_engine.h"
#include "kernels/cuda/partial_sums.h"
#endif

namespace flce {
namespace {

absl::StatusOr<std::unique_ptr<LossEngine>> CreateCudaEngine(const EngineOptions& options) {
#ifdef FLCE_WITH_CUDA
  CudaEngineOptions one = options.cuda;
  if (options.cuda_devices.size() == 1) one.device = options.cuda_devices[0];
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(one);
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<LossEngine>(std::move(*engine));
#else
  (void)options;
  return absl::UnimplementedError(
      "--backend=cuda: this build of flce has no CUDA engine (built without a CUDA "
      "toolkit); use --backend=cpu or auto");
#endif
}

}  // namespace

bool CudaBuiltIn() {
#ifdef FLCE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

absl::StatusOr<std::unique_ptr<LossEngine>> CreateOneEngine(const std::string& backend,
                                                            const EngineOptions& options) {
  if (backend == "cpu") return std::make_unique<CpuEngine>(options.cpu);
  if (backend == "cuda") return CreateCudaEngine(options);
  if (backend == "auto") {
    absl::StatusOr<std::unique_ptr<LossEngine>> cuda = CreateCudaEngine(options);
    if (cuda.ok()) return cuda;
    SPDLOG_WARN("backend auto: serving on the CPU ({})", std::string(cuda.status().message()));
    return std::make_unique<CpuEngine>(options.cpu);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--backend: unknown value '", backend, "'; expected auto, cuda or cpu"));
}

}  // namespace

// An engine on each of options.cuda_devices, sharded over them.
absl::StatusOr<std::unique_ptr<LossEngine>> CreateMultiDeviceEngine(const EngineOptions& options) {
#ifdef FLCE_WITH_CUDA
  const std::vector<int>& devices = options.cuda_devices;
  std::vector<std::unique_ptr<LossEngine>> engines;
  for (int device : devices) {
    CudaEngineOptions one = options.cuda;
    one.device = device;
    absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(one);
    if (!engine.ok()) {
      return absl::UnavailableError(
          absl::StrCat("--cuda_devices: device ", device, ": ", engine.status().message()));
    }
    engines.push_back(std::move(*engine));
  }
  if (options.cuda_devices_mode == "spread") {
    SPDLOG_INFO("{} CUDA engines, each request on one of them", devices.size());
    return std::make_unique<SpreadEngine>(std::move(engines));
  }
  const std::set<int> distinct(devices.begin(), devices.end());
  absl::StatusOr<std::unique_ptr<PartialSum>> sum =
      distinct.size() == 1 ? DeviceLocalSum(devices[0]) : NcclSum(devices);
  if (!sum.ok()) {
    return absl::UnavailableError(absl::StrCat("--cuda_devices: ", sum.status().message()));
  }
  const int shards = std::max<int>(options.vocab_shards, static_cast<int>(devices.size()));
  SPDLOG_INFO("{} CUDA engines, every problem in {} vocabulary shards", devices.size(), shards);
  return std::make_unique<ShardedEngine>(std::move(engines), shards, std::move(*sum));
#else
  (void)options;
  return absl::UnimplementedError("--cuda_devices: this build of flce has no CUDA engine");
#endif
}

absl::StatusOr<std::unique_ptr<LossEngine>> CreateEngine(const std::string& backend,
                                                         const EngineOptions& options) {
  if (options.vocab_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab_shards: ", options.vocab_shards, "; expected >= 1"));
  }
  const std::set<int> distinct(options.cuda_devices.begin(), options.cuda_devices.end());
  if (distinct.size() > 1 && distinct.size() != options.cuda_devices.size()) {
    return absl::InvalidArgumentError(
        "--cuda_devices: distinct devices, or one device repeated (engines sharing it)");
  }
  if (options.cuda_devices_mode != "shard" && options.cuda_devices_mode != "spread") {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_devices_mode: unknown value '",
                                                   options.cuda_devices_mode,
                                                   "'; expected shard or spread"));
  }
  if (options.cuda_devices.size() > 1) {
    if (backend != "cuda" && backend != "auto") {
      return absl::InvalidArgumentError("--cuda_devices: for --backend=cuda (or auto)");
    }
    return CreateMultiDeviceEngine(options);
  }
  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<LossEngine> engine, CreateOneEngine(backend, options));
  if (options.vocab_shards == 1) return engine;
  if (!engine->supports_vocab_shards()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab_shards: the ", engine->backend(),
        " engine does not compute vocabulary shards in this version (the cpu engine does)"));
  }
  std::vector<std::unique_ptr<LossEngine>> engines;
  engines.push_back(std::move(engine));
  return std::make_unique<ShardedEngine>(std::move(engines), options.vocab_shards);
}

}  // namespace flce
