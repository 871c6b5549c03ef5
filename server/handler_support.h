#ifndef FLCE_SERVER_HANDLER_SUPPORT_H_
#define FLCE_SERVER_HANDLER_SUPPORT_H_

// What the handler files of LossServiceImpl (loss_service.cc,
// compute_handlers.cc, weight_handlers.cc) share about a call in progress.

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/loss_engine.h"
#include "server/rpc_call.h"

namespace flce {

bool DeadlinePassed(const Call& call);

// True once the caller cancelled or its deadline passed (what the engine
// checks between chunks). `call` must outlive the function.
CancelFn CancelFor(const Call* call);

// CANCELLED / DEADLINE_EXCEEDED if the caller is gone, else OK; `where`
// ends the message ("while queued").
absl::Status CheckAlive(const Call& call, const char* where);

double MillisSince(absl::Time start);

// "session=3f2a1b0c " for the access line ("" without a session).
std::string SessionDetail(const std::string& id);

}  // namespace flce

#endif  // FLCE_SERVER_HANDLER_SUPPORT_H_
