#ifndef FLCE_SERVER_REGION_MARKS_H_
#define FLCE_SERVER_REGION_MARKS_H_

// Marks posted on a region of server memory, so that a read of the region's
// bytes can go out before the call that writes them has finished: a remote
// client's row piece sends its Forward (which writes the piece's dX into the
// region, ForwardRequest.backward.written_mark) and the bulk GET of that dX
// (after_mark, server/bulk_http.h) at once, and the GET waits here until the
// Forward posts its mark. A mark is a number the client picks (not 0); its
// post carries the writing call's outcome: OK once the bytes are written,
// else why they never will be. The first post of a mark wins (the call's
// end posts a failure whatever it ended with; after an OK post that changes
// nothing). The board remembers the last kMaxPosts posts.

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flce {

class MarkBoard {
 public:
  static constexpr int kMaxPosts = 256;

  // Posts `mark` with `outcome` (its code and message) unless it was
  // posted already; wakes the waiters. REQUIRES: mark != 0.
  void Post(uint64_t mark, const absl::Status& outcome);

  // The outcome posted for `mark`, waiting until it is posted or
  // `deadline` passes (nullopt), checking `stop` every `poll` while
  // waiting (nullopt as soon as it answers true).
  std::optional<absl::Status> Await(uint64_t mark, absl::Time deadline,
                                    const std::function<bool()>& stop,
                                    absl::Duration poll = absl::Milliseconds(50));

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, absl::Status> posted_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace flce

#endif  // FLCE_SERVER_REGION_MARKS_H_
