#include "server/engine_factory.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/sharded_engine.h"
#include "kernels/status_macros.h"
#include "spdlog/spdlog.h"

#ifdef FLCE_WITH_CUDA
#include "kernels/cuda/cuda_engine.h"
#endif

namespace flce {
namespace {

absl::StatusOr<std::unique_ptr<LossEngine>> CreateCudaEngine(const EngineOptions& options) {
#ifdef FLCE_WITH_CUDA
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(options.cuda);
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

absl::StatusOr<std::unique_ptr<LossEngine>> CreateEngine(const std::string& backend,
                                                         const EngineOptions& options) {
  if (options.vocab_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab_shards: ", options.vocab_shards, "; expected >= 1"));
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
