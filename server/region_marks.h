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
//
// Before its post, the writing call may tell how far its bytes are in
// (Progress: a prefix of what it writes, as it lands): a read that lies
// within it goes at once, while the rest is still being written.

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

  // `mark`'s call has written the region's bytes [begin, end) (the start
  // of what it writes; a later call only moves `end` on). Nothing once the
  // mark is posted. REQUIRES: mark != 0, begin <= end.
  void Progress(uint64_t mark, int64_t begin, int64_t end);

  // The outcome posted for `mark`, waiting until it is posted or
  // `deadline` passes (nullopt), checking `stop` every `poll` while
  // waiting (nullopt as soon as it answers true). OK before the post once
  // the region's bytes [offset, offset + length) are in (Progress), where
  // length >= 0.
  std::optional<absl::Status> Await(uint64_t mark, absl::Time deadline,
                                    const std::function<bool()>& stop,
                                    absl::Duration poll = absl::Milliseconds(50),
                                    int64_t offset = 0, int64_t length = -1);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, absl::Status> posted_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> order_ ABSL_GUARDED_BY(mu_);  // oldest first
  // Marks not yet posted whose call told its progress: [begin, end). One
  // per writing call in flight; its post removes it.
  absl::flat_hash_map<uint64_t, std::pair<int64_t, int64_t>> written_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flce

#endif  // FLCE_SERVER_REGION_MARKS_H_
