#include "sync/robust_mutex.h"

#include <cerrno>

#include "common/check.h"

namespace torch_mp_ext {

namespace {

/// pthread calls return the error number instead of setting errno; this turns a failure into
/// the SyscallError every other failed call raises.
void pthread_check(int rc, const char* call) {
  if (rc != 0) throw SyscallError(rc, call, "process-shared mutex");
}

}  // namespace

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
  if (deadline.infinite()) return interpret(::pthread_mutex_lock(&mutex_), "pthread_mutex_lock");
  timespec until = deadline.when();
  until.tv_sec += grace_ms / 1000;
  until.tv_nsec += (grace_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec += 1;
    until.tv_nsec -= 1000000000L;
  }
  return interpret(::pthread_mutex_clocklock(&mutex_, CLOCK_MONOTONIC, &until),
                   "pthread_mutex_clocklock");
}

RobustMutex::Acquired RobustMutex::try_lock() {
  return interpret(::pthread_mutex_trylock(&mutex_), "pthread_mutex_trylock");
}

void RobustMutex::mark_consistent() {
  pthread_check(::pthread_mutex_consistent(&mutex_), "pthread_mutex_consistent");
}

void RobustMutex::unlock() {
  pthread_check(::pthread_mutex_unlock(&mutex_), "pthread_mutex_unlock");
}

}  // namespace torch_mp_ext
