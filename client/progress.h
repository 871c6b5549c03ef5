#ifndef FLCE_CLIENT_PROGRESS_H_
#define FLCE_CLIENT_PROGRESS_H_

// What a command is doing, for a person waiting, on stderr: on a terminal,
// one line rewritten in place once a phase has taken over a second;
// elsewhere (a log, a pipe), a line every 5 s of a phase that lasts. Fast
// phases print nothing.

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"

namespace flce {

class Progress {
 public:
  Progress();
  // Clears the line (on a terminal) and stops.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts a phase named `name` (ending the one before).
  void Phase(std::string name);
  // The fraction of the phase done, in [0, 1], shown as a percentage.
  void Fraction(double f);
  // Ends the phase.
  void Done() { Phase(""); }

 private:
  void Tick();
  void ClearLocked();

  const bool tty_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::string phase_;
  double fraction_ = -1;
  absl::Time start_;
  absl::Duration next_line_;
  bool printed_ = false, stop_ = false;
  std::thread ticker_;  // last: starts once the rest is set up
};

}  // namespace flce

#endif  // FLCE_CLIENT_PROGRESS_H_
