#include "common/flag_types.h"

#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace flce {

namespace {

constexpr const char kByteForms[] =
    "expected a byte count: an integer, or a number with a unit (B, KiB, MiB, GiB, TiB, also "
    "written Ki, Mi, Gi, Ti; or decimal KB, MB, GB, TB), e.g. 17179869184, 16GiB, 512MiB";

constexpr const char kDurationForms[] =
    "expected a duration with its unit (ns, us, ms, s, m, h), e.g. 600s, 10m, 1h30m, 250ms; or 0";

struct Unit {
  const char* name;
  double scale;
};

// Longest names first, so that "MiB" is not read as "B".
constexpr Unit kUnits[] = {
    {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40}, {"Ki", 0x1p10},
    {"Mi", 0x1p20},  {"Gi", 0x1p30},  {"Ti", 0x1p40},  {"KB", 1e3},     {"MB", 1e6},
    {"GB", 1e9},     {"TB", 1e12},    {"B", 1.0},
};

}  // namespace

bool AbslParseFlag(absl::string_view text, ByteCount* out, std::string* error) {
  text = absl::StripAsciiWhitespace(text);
  int64_t integer = 0;
  if (absl::SimpleAtoi(text, &integer)) {
    if (integer < 0) {
      *error = absl::StrCat("a byte count cannot be negative; ", kByteForms);
      return false;
    }
    out->bytes = integer;
    return true;
  }
  for (const Unit& unit : kUnits) {
    absl::string_view number = text;
    if (!absl::ConsumeSuffix(&number, unit.name)) continue;
    number = absl::StripTrailingAsciiWhitespace(number);
    double value = 0;
    if (number.empty() || !absl::SimpleAtod(number, &value) || !std::isfinite(value) || value < 0) {
      break;
    }
    const double bytes = std::round(value * unit.scale);
    if (bytes >= 9.2e18) {
      *error = absl::StrCat("'", text, "' is 2^63 bytes or more");
      return false;
    }
    out->bytes = static_cast<int64_t>(bytes);
    return true;
  }
  *error = kByteForms;
  return false;
}

std::string AbslUnparseFlag(ByteCount value) {
  static constexpr std::pair<int, const char*> kBinary[] = {
      {40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}};
  if (value.bytes > 0) {
    for (const auto& [shift, name] : kBinary) {
      const int64_t unit = int64_t{1} << shift;
      if (value.bytes % unit == 0) return absl::StrCat(value.bytes / unit, name);
    }
  }
  return absl::StrCat(value.bytes);
}

bool AbslParseFlag(absl::string_view text, DurationFlag* out, std::string* error) {
  text = absl::StripAsciiWhitespace(text);
  if (text == "0") {
    out->value = absl::ZeroDuration();
    return true;
  }
  absl::Duration d;
  if (!absl::ParseDuration(text, &d) || d == absl::InfiniteDuration() ||
      d == -absl::InfiniteDuration()) {
    double bare = 0;
    *error = absl::SimpleAtod(text, &bare)
                 ? absl::StrCat("'", text, "' has no unit; ", kDurationForms)
                 : std::string(kDurationForms);
    return false;
  }
  if (d < absl::ZeroDuration()) {
    *error = absl::StrCat("a duration cannot be negative; ", kDurationForms);
    return false;
  }
  out->value = d;
  return true;
}

std::string AbslUnparseFlag(DurationFlag value) {
  return value.value == absl::ZeroDuration() ? "0" : absl::FormatDuration(value.value);
}

}  // namespace flce
