// When a waiter may spin before it sleeps, learned per process (Note [Adaptive spinning]).
//
// Note [Adaptive spinning]
// A waiter that spins catches an event a few microseconds after it happens instead of paying
// a futex sleep and wake-up (5-50 us here), but only if the process it waits for runs on
// another CPU meanwhile. If the two share a CPU (one CPU, a busy machine, or the scheduler
// placing the woken peer beside its waker) the spin burns exactly the time slice the peer
// needs, and every wait costs the whole spin: a small-message ping-pong took 57 us one way
// with a fixed 50 us spin against 4.4 us with none. A fixed spin is right for one regime
// only, so each process learns per queue which regime it is in:
//   - never spin when this process may run on one CPU only (its affinity mask when it
//     opened the queue);
//   - a spin that ends with the event keeps spinning on;
//   - two spins in a row that end without it switch spinning off for the next `off` waits,
//     then one wait spins again as a probe; `off` doubles on each failed probe (4 to 256),
//     so a machine whose CPUs are taken pays at most one spin per 256 waits, and a pair of
//     processes that gets its own CPUs back is spinning again within 256 waits.
// The state is process-local (in the Ring object, never in shared memory) and racy between
// threads by design: relaxed atomics, a lost update only delays the learning.
#pragma once

#include <atomic>
#include <cstdint>

namespace torch_mp_ext {

class SpinPolicy {
 public:
  /// `max_ns`: the longest spin (the queue's spin_ns); 0 never spins.
  explicit SpinPolicy(int64_t max_ns);
  SpinPolicy(const SpinPolicy& other);
  SpinPolicy& operator=(const SpinPolicy&) = delete;

  /// How long the next wait may spin (0: sleep at once).
  int64_t next();
  /// The spin of that wait saw the event (`caught`) or ran out.
  void record(bool caught);

  /// CPUs this thread may run on now (sched_getaffinity): read when a queue is opened.
  static int usable_cpus();

  struct State {
    int64_t max_ns;  ///< 0: never spins here
    uint32_t misses;
    uint32_t skip;
    uint32_t off;
  };
  /// For tests and diagnostics.
  State state() const;

 private:
  static constexpr uint32_t MIN_OFF = 4;
  static constexpr uint32_t MAX_OFF = 256;
  int64_t max_ns_;
  std::atomic<uint32_t> misses_{0};   ///< spins in a row that ran out
  std::atomic<uint32_t> skip_{0};     ///< waits left that sleep at once
  std::atomic<uint32_t> off_{MIN_OFF};  ///< waits to skip after the next failed probe
};

}  // namespace torch_mp_ext
