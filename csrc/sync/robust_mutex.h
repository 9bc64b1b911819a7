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
//
// Note [Mutex bytes from a peer]
// glibc trusts the bytes of a pthread_mutex_t, and ours live in memory every holder can write.
// Two garbage states matter (tests/test_fuzz.py writes every byte of the mutex):
// - The type word (`__kind`) picks glibc's code path: a non-robust, priority-inheritance or
//   priority-protect type reaches assert()s (abort) and paths that never enqueue the mutex in
//   the robust list. So every lock, try_lock, unlock and mark_consistent first checks that the
//   word is exactly what init() wrote (CorruptSegmentError otherwise): one compare of a word
//   glibc loads anyway, no syscall.
// - An owner (the lock word's thread id) that never existed, or one that exited without the
//   kernel marking the mutex owner-died (only garbage does that: the kernel marks every
//   robust mutex a thread holds when it exits), makes every locker wait for ever. A timed
//   lock just times out; the caller of an untimed one judges the owner between slices
//   (lock_word() and Ring::lock: Note [A lock nobody holds]).
// What stays out of reach: a peer that rewrites the mutex *while* this process holds it (the
// robust-list links or the lock word between lock and unlock) can still make glibc fail the
// unlock or follow a bad link; only a concurrently writing, hostile peer can do that.
#pragma once

#include <pthread.h>
#include <sys/types.h>
#include <time.h>

#include <cstdint>

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
  void unlock_noexcept() noexcept;
  /// The raw lock word: owner tid | FUTEX_OWNER_DIED | FUTEX_WAITERS, 0 when unlocked
  /// (Note [Mutex bytes from a peer]).
  uint32_t lock_word() const noexcept {
    return static_cast<uint32_t>(__atomic_load_n(&mutex_.__data.__lock, __ATOMIC_SEQ_CST));
  }

 private:
  Acquired interpret(int rc, const char* call);
  bool kind_ok() const noexcept;
  /// CorruptSegmentError unless kind_ok() (Note [Mutex bytes from a peer]).
  void check_kind() const;
  /// The holder's unlock: a type word rewritten while this thread held the mutex is put back
  /// first (it decides whether glibc takes the mutex off this thread's robust list); true if
  /// it had to be.
  bool restore_kind() noexcept;

  pthread_mutex_t mutex_;
};

}  // namespace torch_mp_ext
