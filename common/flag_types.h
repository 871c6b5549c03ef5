#ifndef FLCE_COMMON_FLAG_TYPES_H_
#define FLCE_COMMON_FLAG_TYPES_H_

// Flag value types that take the forms people write, and that say which
// forms they take when a value does not parse (absl prints the message after
// "Illegal value '...' specified for flag '...'; ").

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flce {

// A count of bytes: an integer (17179869184), or a number with a unit:
// binary B, KiB, MiB, GiB, TiB (16GiB, 1.5TiB; Kubernetes' Ki, Mi, Gi, Ti
// too) or decimal KB, MB, GB, TB (10^3 ...). At least 0 and below 2^63.
struct ByteCount {
  int64_t bytes = 0;
};

bool AbslParseFlag(absl::string_view text, ByteCount* out, std::string* error);
// The shortest exact form: "16GiB", "64KiB", or the integer.
std::string AbslUnparseFlag(ByteCount value);

// A length of time with its unit: 600s, 10m, 1h30m, 250ms, 1.5h (absl's
// duration syntax: ns, us, ms, s, m, h); "0" alone means none. A bare
// number other than 0 is refused, naming those forms: 600 could be seconds
// or milliseconds.
struct DurationFlag {
  absl::Duration value;
};

bool AbslParseFlag(absl::string_view text, DurationFlag* out, std::string* error);
std::string AbslUnparseFlag(DurationFlag value);

}  // namespace flce

#endif  // FLCE_COMMON_FLAG_TYPES_H_
