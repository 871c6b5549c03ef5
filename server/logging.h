#ifndef FLCE_SERVER_LOGGING_H_
#define FLCE_SERVER_LOGGING_H_

// The one place that configures spdlog: a stderr sink with the pattern
// "2026-11-30 12:00:00.123 I 1234 message". Code logs with SPDLOG_* macros.

#include <string>

#include "absl/status/status.h"

namespace flce {

// Sets up the default logger at `level` (trace, debug, info, warn, error,
// critical, off). INVALID_ARGUMENT naming --log_level for anything else.
absl::Status InitLogging(const std::string& level);

}  // namespace flce

#endif  // FLCE_SERVER_LOGGING_H_
