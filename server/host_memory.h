#ifndef FLCE_SERVER_HOST_MEMORY_H_
#define FLCE_SERVER_HOST_MEMORY_H_

// What the host can still give: the admission checks of streamed requests
// and registered weights compare an announced size with it before anything
// is allocated.

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace flce {

// MemAvailable of /proc/meminfo, in bytes (the kernel's estimate of what
// can be allocated without swapping); -1 when it cannot be read.
int64_t HostAvailableBytes();

// RESOURCE_EXHAUSTED naming `what` when `bytes` exceed what the host has
// available (`available` < 0: unknown, always OK).
absl::Status CheckHostMemory(int64_t bytes, int64_t available, const std::string& what);

}  // namespace flce

#endif  // FLCE_SERVER_HOST_MEMORY_H_
