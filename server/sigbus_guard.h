#ifndef FLCE_SERVER_SIGBUS_GUARD_H_
#define FLCE_SERVER_SIGBUS_GUARD_H_

// Memory mapped from a file another process controls (a client's POSIX
// shared-memory object) loses its pages when the owner shrinks the file:
// the next access raises SIGBUS, which would kill the server. Inside a
// guarded range it does not: the process-wide handler maps zero pages over
// the rest of the range and marks it broken, and the access goes on
// (reading zeros, or writing where nobody looks). Whoever used the range
// checks Broken() afterwards and voids the result. Faults outside every
// guarded range go to the handler that was there before (or the default:
// the process dies as it would have).
//
// The handler calls mmap, which POSIX does not list as async-signal-safe
// but Linux implements as a plain system call; Wayland compositors guard
// their clients' shared-memory pools the same way.

#include <cstddef>

namespace flce {

class SigbusGuard {
 public:
  // Ranges guarded at once, at most.
  static constexpr int kCapacity = 4096;

  // Guards [base, base + bytes) (base page-aligned, as mmap returns it).
  // Returns its slot, or -1 when kCapacity ranges are guarded already.
  static int Guard(void* base, size_t bytes);
  // Stops guarding a slot; call before unmapping its range.
  static void Unguard(int slot);
  // True once a fault hit the slot's range.
  static bool Broken(int slot);
};

}  // namespace flce

#endif  // FLCE_SERVER_SIGBUS_GUARD_H_
