#include "server/handler_support.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/rpc_call.h"

namespace flce {

bool DeadlinePassed(const grpc::CallbackServerContext* context) {
  return std::chrono::system_clock::now() > context->deadline();
}

CancelFn CancelFor(const grpc::CallbackServerContext* context) {
  return [context] { return context->IsCancelled() || DeadlinePassed(context); };
}

// CANCELLED / DEADLINE_EXCEEDED if the caller is gone, else OK.
absl::Status CheckAlive(const grpc::CallbackServerContext* context, const char* where) {
  if (DeadlinePassed(context)) {
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded ", where));
  }
  if (context->IsCancelled()) {
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
