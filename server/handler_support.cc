#include "server/handler_support.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace flce {

bool DeadlinePassed(const Call& call) { return absl::Now() > call.deadline(); }

CancelFn CancelFor(const Call* call) {
  return [call] { return call->IsCancelled() || DeadlinePassed(*call); };
}

// CANCELLED / DEADLINE_EXCEEDED if the caller is gone, else OK.
absl::Status CheckAlive(const Call& call, const char* where) {
  if (DeadlinePassed(call)) {
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded ", where));
  }
  if (call.IsCancelled()) {
    return absl::CancelledError(absl::StrCat("cancelled by the client ", where));
  }
  return absl::OkStatus();
}

double MillisSince(absl::Time start) {
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

std::string SessionDetail(const std::string& id) {
  return id.empty() ? "" : absl::StrCat("session=", LogSafe(id, 8), " ");
}

}  // namespace flce
