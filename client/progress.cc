#include "client/progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace flce {

Progress::Progress() : tty_(isatty(STDERR_FILENO) == 1), ticker_([this] { Tick(); }) {}

Progress::~Progress() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    ClearLocked();
  }
  wake_.notify_all();
  ticker_.join();
}

void Progress::Phase(std::string name) {
  std::lock_guard<std::mutex> lock(mu_);
  ClearLocked();
  phase_ = std::move(name);
  fraction_ = -1;
  start_ = absl::Now();
  next_line_ = absl::Seconds(5);
}

void Progress::Fraction(double f) {
  std::lock_guard<std::mutex> lock(mu_);
  fraction_ = f;
}

void Progress::Tick() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    wake_.wait_for(lock, std::chrono::milliseconds(250));
    if (stop_ || phase_.empty()) continue;
    const absl::Duration elapsed = absl::Now() - start_;
    const std::string pct =
        fraction_ >= 0 ? absl::StrFormat(" %.0f%%", 100 * fraction_) : std::string();
    if (tty_ && elapsed > absl::Seconds(1)) {
      std::fprintf(stderr, "\r  %s… %.0f s%s\x1b[K", phase_.c_str(), absl::ToDoubleSeconds(elapsed),
                   pct.c_str());
      printed_ = true;
    } else if (!tty_ && elapsed >= next_line_) {
      std::fprintf(stderr, "  %s… %.0f s%s\n", phase_.c_str(), absl::ToDoubleSeconds(elapsed),
                   pct.c_str());
      next_line_ += absl::Seconds(5);
    }
    std::fflush(stderr);
  }
}

void Progress::ClearLocked() {
  if (tty_ && printed_) std::fprintf(stderr, "\r\x1b[K");
  printed_ = false;
}

}  // namespace flce
