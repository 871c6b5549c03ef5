#include "server/random_id.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_format.h"

namespace flce {

std::string RandomId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // getrandom cannot fail on a supported kernel once the pool is ready.
      std::perror("getrandom");
      std::abort();
    }
    got += static_cast<size_t>(n);
  }
  std::string id;
  for (unsigned char b : bytes) absl::StrAppendFormat(&id, "%02x", b);
  return id;
}

}  // namespace flce
