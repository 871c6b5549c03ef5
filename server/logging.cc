#include "server/logging.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace flce {

absl::Status InitLogging(const std::string& level) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level: unknown level '", level,
                     "'; expected trace, debug, info, warn, error, critical or off"));
  }
  auto logger = std::make_shared<spdlog::logger>(
      "flce", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %L %t %v");
  logger->set_level(parsed);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return absl::OkStatus();
}

}  // namespace flce
