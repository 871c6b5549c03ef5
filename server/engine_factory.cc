#include "server/engine_factory.h"

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace flce {

absl::StatusOr<std::unique_ptr<LossEngine>> CreateEngine(
    const std::string& backend, const CpuEngineOptions& cpu_options) {
  if (backend == "cpu") return std::make_unique<CpuEngine>(cpu_options);
  if (backend == "cuda") {
    return absl::UnimplementedError(
        "--backend=cuda: this build of flce has no CUDA engine; use --backend=cpu "
        "or auto");
  }
  if (backend == "auto") {
    SPDLOG_WARN("backend auto: no CUDA engine in this build; serving on the CPU");
    return std::make_unique<CpuEngine>(cpu_options);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--backend: unknown value '", backend, "'; expected auto, cuda or cpu"));
}

}  // namespace flce
