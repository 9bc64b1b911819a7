// A process-shared condition variable on CLOCK_MONOTONIC that no death can wedge
// (Note [Why not pthread_cond_t]).
//
// Note [Why not pthread_cond_t]
// A process-shared pthread_cond_t (even with pthread_condattr_setclock(CLOCK_MONOTONIC)) is
// not safe against SIGKILL: glibc's condition variable (since 2.25) guards its waiter groups
// with an internal lock taken inside pthread_cond_signal/broadcast and on a waiter's timeout
// path, and waits on it without a timeout. A process killed while holding that internal lock
// blocks every later signaller forever; a waiter killed in the wrong group can also swallow a
// wake-up meant for a live one. So the conditions of the core (the queue ring's, the
// latest-value channel's) are built directly on a futex, which keeps no state a dead process
// could leave half-written:
//
//   seq      32-bit counter; every notify increments it (the "event" waiters watch)
//   waiters  processes/threads about to sleep or sleeping (a hint to skip the wake syscall)
//
// A waiter reads `seq` while holding the mutex that guards the predicate (or, for a lock-free
// predicate such as the channel's stamps, before reading the predicate), unlocks, spins
// briefly watching `seq`, then announces itself in `waiters` and sleeps in
// FUTEX_WAIT_BITSET(seq == seen) with an absolute CLOCK_MONOTONIC deadline. A notifier
// changes the predicate under the mutex, then increments `seq` and, if `waiters` is non-zero,
// calls FUTEX_WAKE. Both sides use sequentially consistent operations on the two words, so
// either the notifier sees the waiter and wakes it, or the waiter's futex call sees the new
// `seq` and returns at once: no lost wake-up. A waiter killed while sleeping is simply gone
// from the kernel's futex queue; the only trace it leaves is `waiters` staying one too high,
// which costs later notifiers a wake syscall that wakes nobody, never correctness.
#pragma once

#include <atomic>
#include <cstdint>

#include "common/deadline.h"
#include "sync/spin.h"

namespace torch_mp_ext {

class SharedCondition {
 public:
  enum class Woke {
    Event,        ///< `seq` moved (a notify, or a spurious wake): re-check the predicate
    TimedOut,     ///< the deadline passed
    Interrupted,  ///< a signal arrived (EINTR): let the caller run signal handlers
  };

  /// Initialises in place (creator only).
  void init();

  /// The event counter to wait on; read it while holding the predicate's mutex.
  uint32_t snapshot() const { return seq_.load(std::memory_order_seq_cst); }

  /// Waits, without the mutex, until `seq` differs from `seen` or `deadline` passes. Spins
  /// first for as long as `spin` allows, and tells it how that went (Note [Adaptive
  /// spinning]); nullptr: sleep at once.
  Woke wait(uint32_t seen, const Deadline& deadline, SpinPolicy* spin);

  /// Wakes one sleeper / every sleeper. Safe with or without the mutex held.
  void notify_one() { notify(1); }
  void notify_all() { notify(0x7fffffff); }

  /// Processes/threads announced as sleeping (diagnostics; a dead sleeper stays counted).
  uint32_t waiters() const { return waiters_.load(std::memory_order_relaxed); }

 private:
  void notify(int count);

  std::atomic<uint32_t> seq_;
  std::atomic<uint32_t> waiters_;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(sizeof(SharedCondition) == 8, "SharedCondition is part of the shared layout");

}  // namespace torch_mp_ext
