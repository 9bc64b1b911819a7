#include "sync/condition.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>

#include "common/check.h"

namespace torch_mp_ext {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Not FUTEX_PRIVATE_FLAG: the word is shared between processes. FUTEX_WAIT_BITSET without
// FUTEX_CLOCK_REALTIME takes an absolute CLOCK_MONOTONIC deadline (Note [Monotonic time]).
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* deadline) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, deadline, nullptr,
                   FUTEX_BITSET_MATCH_ANY);
}

}  // namespace

void SharedCondition::init() {
  seq_.store(0, std::memory_order_relaxed);
  waiters_.store(0, std::memory_order_relaxed);
}

SharedCondition::Woke SharedCondition::wait(uint32_t seen, const Deadline& deadline,
                                            SpinPolicy* spin) {
  int64_t spin_ns = spin != nullptr ? spin->next() : 0;
  if (spin_ns > 0) {
    // Spin without sched_yield(): on an idle core this catches the next event without a
    // futex round trip. Yielding looked kind but was not: a woken peer queued behind a
    // yielding spinner on the same CPU waited for the scheduler tick (4 ms at HZ=250), which
    // made a tensor hand-off take 4 ms instead of 50 us until the balancer moved it. The spin
    // is bounded (spin_ns), and a spin that keeps missing is switched off (Note [Adaptive
    // spinning]), so a peer sharing the core loses little.
    int64_t until = monotonic_ns() + spin_ns;
    for (int i = 1;; ++i) {
      if (seq_.load(std::memory_order_acquire) != seen) {
        spin->record(true);
        return Woke::Event;
      }
      cpu_relax();
      if ((i & 31) == 0 && monotonic_ns() >= until) break;
    }
    spin->record(false);
  }
  if (deadline.expired()) return Woke::TimedOut;
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  const timespec* until = deadline.infinite() ? nullptr : &deadline.when();
  long rc = futex(&seq_, FUTEX_WAIT_BITSET, seen, until);
  int err = rc == -1 ? errno : 0;
  waiters_.fetch_sub(1, std::memory_order_seq_cst);
  // The futex's failures are its answers (not TMX_SYSCHECK): EAGAIN means `seq` had already
  // moved, ETIMEDOUT the deadline, EINTR a signal. Anything else is a real error.
  switch (err) {
    case 0:
    case EAGAIN:
      return Woke::Event;
    case ETIMEDOUT:
      return Woke::TimedOut;
    case EINTR:
      return Woke::Interrupted;
    default:
      throw SyscallError(err, "futex(FUTEX_WAIT_BITSET)", "process-shared condition");
  }
}

void SharedCondition::notify(int count) {
  seq_.fetch_add(1, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) == 0) return;
  if (futex(&seq_, FUTEX_WAKE, static_cast<uint32_t>(count), nullptr) == -1) {
    throw SyscallError(errno, "futex(FUTEX_WAKE)", "process-shared condition");
  }
}

}  // namespace torch_mp_ext
