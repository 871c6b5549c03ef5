#include "server/host_memory.h"

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace flce {

int64_t HostAvailableBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    long long value = 0;
    if (std::sscanf(line, "MemAvailable: %lld kB", &value) == 1) {
      kib = value;
      break;
    }
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

absl::Status CheckHostMemory(int64_t bytes, int64_t available, const std::string& what) {
  if (available >= 0 && bytes > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", bytes, " bytes, the host has ", available, " available"));
  }
  return absl::OkStatus();
}

}  // namespace flce
