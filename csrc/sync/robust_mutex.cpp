#include "sync/robust_mutex.h"

#include <cerrno>

#include "common/check.h"
#include "platform/compat.h"

namespace torch_mp_ext {

namespace {

/// pthread calls return the error number instead of setting errno; this turns a failure into
/// the SyscallError every other failed call raises.
void pthread_check(int rc, const char* call) {
  if (rc != 0) throw SyscallError(rc, call, "process-shared mutex");
}

/// The type word init() writes (glibc's `__kind`), read from a mutex initialised the same way
/// once at load time (Note [Mutex bytes from a peer]).
int initialised_kind() {
  pthread_mutexattr_t attr;
  ::pthread_mutexattr_init(&attr);
  ::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  ::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_t m;
  ::pthread_mutex_init(&m, &attr);
  ::pthread_mutexattr_destroy(&attr);
  int kind = m.__data.__kind;
  ::pthread_mutex_destroy(&m);
  return kind;
}

const int g_kind = initialised_kind();

}  // namespace

bool RobustMutex::kind_ok() const noexcept {
  return __atomic_load_n(&mutex_.__data.__kind, __ATOMIC_RELAXED) == g_kind;
}

/// unlock() found the type word rewritten while it held the mutex: say so once unlocked.
[[noreturn]] static void check_kind_after_restore() {
  throw CorruptSegmentError(
      "a process-shared mutex in shared memory is corrupt: its type word was rewritten while "
      "this process held it; a process wrote garbage into it");
}

void RobustMutex::check_kind() const {
  if (!kind_ok()) {
    throw CorruptSegmentError(detail::str_cat(
        "a process-shared mutex in shared memory is corrupt: its type word is ",
        __atomic_load_n(&mutex_.__data.__kind, __ATOMIC_RELAXED), ", not the ", g_kind,
        " of a robust process-shared mutex; a process wrote garbage into it"));
  }
}

void RobustMutex::init() {
  pthread_mutexattr_t attr;
  pthread_check(::pthread_mutexattr_init(&attr), "pthread_mutexattr_init");
  pthread_check(::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED),
                "pthread_mutexattr_setpshared");
  pthread_check(::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST),
                "pthread_mutexattr_setrobust");
  int rc = ::pthread_mutex_init(&mutex_, &attr);
  ::pthread_mutexattr_destroy(&attr);
  pthread_check(rc, "pthread_mutex_init");
}

RobustMutex::Acquired RobustMutex::interpret(int rc, const char* call) {
  switch (rc) {
    case 0:
      return Acquired::Yes;
    case EOWNERDEAD:
      return Acquired::OwnerDied;
    case EBUSY:
      return Acquired::Busy;
    case ETIMEDOUT:
      return Acquired::TimedOut;
    case ENOTRECOVERABLE:
      // Only reachable if a locker unlocked after EOWNERDEAD without mark_consistent(),
      // which this project never does; a foreign writer must have touched the memory.
      throw PeerDiedError(
          "a process-shared mutex is unrecoverable: a process unlocked it after its previous "
          "owner died without repairing what it guards");
    default:
      throw SyscallError(rc, call, "process-shared mutex");
  }
}

RobustMutex::Acquired RobustMutex::lock(const Deadline& deadline, long grace_ms) {
  check_kind();
  if (deadline.infinite()) return interpret(::pthread_mutex_lock(&mutex_), "pthread_mutex_lock");
  timespec until = deadline.when();
  until.tv_sec += grace_ms / 1000;
  until.tv_nsec += (grace_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec += 1;
    until.tv_nsec -= 1000000000L;
  }
  return interpret(mutex_lock_until(&mutex_, until),  // Note [Platform floor]
                   has_clocklock() ? "pthread_mutex_clocklock" : "pthread_mutex_timedlock");
}

RobustMutex::Acquired RobustMutex::try_lock() {
  check_kind();
  return interpret(::pthread_mutex_trylock(&mutex_), "pthread_mutex_trylock");
}

void RobustMutex::mark_consistent() {
  check_kind();
  pthread_check(::pthread_mutex_consistent(&mutex_), "pthread_mutex_consistent");
}

bool RobustMutex::restore_kind() noexcept {
  if (kind_ok()) return false;
  __atomic_store_n(&mutex_.__data.__kind, g_kind, __ATOMIC_RELAXED);
  return true;
}

void RobustMutex::unlock() {
  bool restored = restore_kind();
  pthread_check(::pthread_mutex_unlock(&mutex_), "pthread_mutex_unlock");
  if (restored) check_kind_after_restore();
}

void RobustMutex::unlock_noexcept() noexcept {
  restore_kind();
  ::pthread_mutex_unlock(&mutex_);
}

}  // namespace torch_mp_ext
