// Monotonic deadlines for blocking waits (Note [Monotonic time]).
//
// Note [Monotonic time]
// Every timeout of the core is measured on CLOCK_MONOTONIC, never the wall clock: a wall-clock
// jump (NTP, a user changing the date) must not shorten or stretch a wait. A negative timeout
// means "wait forever", the C++ spelling of Python's timeout=None.
#pragma once

#include <time.h>

#include <cstdint>

namespace torch_mp_ext {

class Deadline {
 public:
  /// `seconds` < 0 means no deadline (wait forever).
  explicit Deadline(double seconds) : infinite_(seconds < 0) {
    if (!infinite_) {
      ::clock_gettime(CLOCK_MONOTONIC, &at_);
      auto ns = static_cast<int64_t>(seconds * 1e9);
      at_.tv_sec += static_cast<time_t>(ns / 1000000000);
      at_.tv_nsec += static_cast<long>(ns % 1000000000);
      if (at_.tv_nsec >= 1000000000) {
        at_.tv_sec += 1;
        at_.tv_nsec -= 1000000000;
      }
    }
  }
  bool infinite() const noexcept { return infinite_; }
  /// Absolute CLOCK_MONOTONIC time of the deadline (for pthread_cond_timedwait).
  const timespec& when() const noexcept { return at_; }
  bool expired() const noexcept { return !infinite_ && remaining_ms() <= 0; }
  /// Milliseconds left (clamped at 0); -1 when infinite (the poll() convention).
  int64_t remaining_ms() const noexcept {
    if (infinite_) return -1;
    timespec now;
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t ms = (at_.tv_sec - now.tv_sec) * 1000 + (at_.tv_nsec - now.tv_nsec) / 1000000;
    return ms < 0 ? 0 : ms;
  }

 private:
  bool infinite_;
  timespec at_{};
};

}  // namespace torch_mp_ext
