// A process-shared mutex that survives the death of its owner (Note [Robust mutex]).
//
// Note [Robust mutex]
// The mutex lives in shared memory and is placement-initialised by the creator of that memory
// (PTHREAD_PROCESS_SHARED | PTHREAD_MUTEX_ROBUST). When a process dies holding it, the kernel
// walks the dead thread's robust list and marks the mutex owner-died; the next locker, in any
// process, gets EOWNERDEAD: it owns the mutex, repairs the data the mutex guards (the caller
// decides how), then calls mark_consistent(). A locker that dies during the repair leaves
// the mutex owner-died again, so the repair must be idempotent. The mutex itself is never
// left wedged by a death at any instruction, including inside lock() and unlock(): glibc
// records the mutex in the thread's list_op_pending slot before touching it.
//
// Acquisition waits only as long as the deadline allows; critical sections of this project
// are bounded (a memcpy of at most one ring's capacity), so a timeout here means the owner is
// stopped (SIGSTOP, a debugger), not dead.
#pragma once

#include <pthread.h>
#include <time.h>

#include "common/deadline.h"

namespace torch_mp_ext {

class RobustMutex {
 public:
  enum class Acquired {
    Yes,        ///< locked; the protected data is consistent
    OwnerDied,  ///< locked; the previous owner died: repair, then mark_consistent()
    Busy,       ///< try_lock only: another thread holds it
    TimedOut,   ///< not locked: the deadline passed
  };

  /// Initialises the mutex in place. Creator only, before any other process can see it.
  void init();

  /// Locks, waiting until `deadline` (plus `grace_ms`). Thread- and process-safe.
  Acquired lock(const Deadline& deadline, long grace_ms = 0);
  /// Locks if free, without waiting.
  Acquired try_lock();
  /// After OwnerDied and a successful repair: the data is consistent again.
  void mark_consistent();
  void unlock();
  /// For destructors on error paths: never throws.
  void unlock_noexcept() noexcept { ::pthread_mutex_unlock(&mutex_); }

 private:
  Acquired interpret(int rc, const char* call);

  pthread_mutex_t mutex_;
};

}  // namespace torch_mp_ext
