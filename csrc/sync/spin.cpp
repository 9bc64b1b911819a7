#include "sync/spin.h"

#include <sched.h>

#include <algorithm>

namespace torch_mp_ext {

namespace {
constexpr auto relaxed = std::memory_order_relaxed;
}  // namespace

int SpinPolicy::usable_cpus() {
  // The mask can change later (taskset -p), rarely; a stale answer only mis-tunes the spin.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

SpinPolicy::State SpinPolicy::state() const {
  return State{max_ns_, misses_.load(relaxed), skip_.load(relaxed), off_.load(relaxed)};
}

SpinPolicy::SpinPolicy(int64_t max_ns) : max_ns_(usable_cpus() > 1 ? max_ns : 0) {}

SpinPolicy::SpinPolicy(const SpinPolicy& other)
    : max_ns_(other.max_ns_),
      misses_(other.misses_.load(relaxed)),
      skip_(other.skip_.load(relaxed)),
      off_(other.off_.load(relaxed)) {}

int64_t SpinPolicy::next() {
  if (max_ns_ <= 0) return 0;
  uint32_t skip = skip_.load(relaxed);
  if (skip > 0) {
    skip_.store(skip - 1, relaxed);
    return 0;
  }
  return max_ns_;
}

void SpinPolicy::record(bool caught) {
  if (caught) {
    misses_.store(0, relaxed);
    off_.store(MIN_OFF, relaxed);
    return;
  }
  if (misses_.load(relaxed) + 1 < 2) {
    misses_.store(1, relaxed);
    return;
  }
  misses_.store(1, relaxed);  // from here one failed probe switches spinning off again
  uint32_t off = off_.load(relaxed);
  skip_.store(off, relaxed);
  off_.store(std::min(off * 2, MAX_OFF), relaxed);
}

}  // namespace torch_mp_ext
