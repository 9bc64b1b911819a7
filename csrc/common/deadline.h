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

/// Nanoseconds on CLOCK_MONOTONIC: the one clock the core reads.
inline int64_t monotonic_ns() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

class Deadline {
 public:
  /// `seconds` < 0 means no deadline (wait forever).
  explicit Deadline(double seconds) : infinite_(seconds < 0) {
    if (!infinite_) {
      if (seconds > 1e9) seconds = 1e9;  // 31 years: far enough, and no int64 overflow
      at_ns_ = monotonic_ns() + static_cast<int64_t>(seconds * 1e9);
      at_.tv_sec = static_cast<time_t>(at_ns_ / 1000000000);
      at_.tv_nsec = static_cast<long>(at_ns_ % 1000000000);
    }
  }
  bool infinite() const noexcept { return infinite_; }
  /// The first `max_s` seconds of this deadline (all of it when less is left): one slice of a
  /// wait that returns to its caller now and then (Note [Waiting without the GIL]).
  Deadline slice(double max_s) const noexcept {
    if (infinite_) return Deadline(max_s);
    double left = remaining_s();
    return Deadline(left < max_s ? left : max_s);
  }
  /// Absolute CLOCK_MONOTONIC time of the deadline (for pthread_cond_timedwait).
  const timespec& when() const noexcept { return at_; }
  bool expired() const noexcept { return !infinite_ && remaining_ms() <= 0; }
  /// Milliseconds left (clamped at 0); -1 when infinite (the poll() convention).
  int64_t remaining_ms() const noexcept {
    if (infinite_) return -1;
    int64_t ms = (at_ns_ - monotonic_ns()) / 1000000;
    return ms < 0 ? 0 : ms;
  }
  /// Seconds left (clamped at 0); -1 when infinite.
  double remaining_s() const noexcept {
    if (infinite_) return -1.0;
    int64_t ns = at_ns_ - monotonic_ns();
    return ns < 0 ? 0.0 : static_cast<double>(ns) * 1e-9;
  }

 private:
  bool infinite_;
  int64_t at_ns_ = 0;
  timespec at_{};
};

}  // namespace torch_mp_ext
