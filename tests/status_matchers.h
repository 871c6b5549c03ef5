#ifndef FLCE_TESTS_STATUS_MATCHERS_H_
#define FLCE_TESTS_STATUS_MATCHERS_H_

// `EXPECT_THAT(status, StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("target")))`
// for absl::Status and absl::StatusOr<T>.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace flce {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// `code` is a StatusCode or a matcher of one (e.g. AnyOf(...)).
MATCHER_P2(StatusIs, code, message_matcher, "has the expected code and message") {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status.ToString();
  if (!::testing::Matches(code)(status.code())) return false;
  return ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

}  // namespace flce

#endif  // FLCE_TESTS_STATUS_MATCHERS_H_
