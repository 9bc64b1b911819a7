#include "platform/compat.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

// libstdc++'s headers read glibc's __libc_single_threaded (glibc 2.32) to skip atomic
// refcounts in single-threaded programs. Defined here, hidden, the extension needs no such
// symbol from libc (Note [Platform floor]); 0 means "threads may run": always atomic, which
// is what a multiprocessing extension with its own threads needs anyway.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}

namespace torch_mp_ext {

namespace {

using ClockLock = int (*)(pthread_mutex_t*, clockid_t, const timespec*);

const bool g_forced = [] {
  const char* value = std::getenv("TORCH_MP_EXT_FALLBACKS");
  return value != nullptr && std::strcmp(value, "1") == 0;
}();

ClockLock clocklock() {
  static const ClockLock fn =
      g_forced ? nullptr
               : reinterpret_cast<ClockLock>(::dlsym(RTLD_DEFAULT, "pthread_mutex_clocklock"));
  return fn;
}

std::atomic<bool> g_seals_refused{false};

constexpr long SLICE_NS = 100 * 1000000L;  // Note [Platform floor]: a clock jump costs a slice

timespec now(clockid_t clock) {
  timespec t{};
  ::clock_gettime(clock, &t);
  return t;
}

long long ns_until(const timespec& deadline, const timespec& now) {
  return (static_cast<long long>(deadline.tv_sec) - now.tv_sec) * 1000000000LL +
         (deadline.tv_nsec - now.tv_nsec);
}

int timedlock_fallback(pthread_mutex_t* mutex, const timespec& deadline) {
  for (;;) {
    long long left = ns_until(deadline, now(CLOCK_MONOTONIC));
    long long slice = left < SLICE_NS ? (left > 0 ? left : 0) : SLICE_NS;
    timespec until = now(CLOCK_REALTIME);
    until.tv_nsec += static_cast<long>(slice);
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    int rc = ::pthread_mutex_timedlock(mutex, &until);
    if (rc != ETIMEDOUT || left <= SLICE_NS) return rc;
  }
}

int populate_with_zeros(char* addr, size_t len) {
  int zero = ::open("/dev/zero", O_RDONLY | O_CLOEXEC);
  if (zero < 0) return errno;
  int err = 0;
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::read(zero, addr + done, len - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      err = n < 0 && errno != EFAULT ? errno : ENOSPC;  // EFAULT: a page with no room behind it
      break;
    }
  }
  ::close(zero);
  return err;
}

}  // namespace

bool fallbacks_forced() { return g_forced; }

bool has_clocklock() { return clocklock() != nullptr; }

int mutex_lock_until(pthread_mutex_t* mutex, const timespec& monotonic_deadline) {
  if (ClockLock fn = clocklock()) return fn(mutex, CLOCK_MONOTONIC, &monotonic_deadline);
  return timedlock_fallback(mutex, monotonic_deadline);
}

int populate_shared(void* addr, size_t len) {
  if (len == 0) return 0;
  if (!g_forced) {
#ifdef MADV_POPULATE_WRITE
    int rc;
    do {
      rc = ::madvise(addr, len, MADV_POPULATE_WRITE);
    } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
    if (rc == 0) return 0;
    int err = errno;
    if (err != EINVAL) return err == EFAULT || err == ENOMEM ? ENOSPC : err;
    // EINVAL: a kernel older than 5.14; the fallback below
#endif
  }
  return populate_with_zeros(static_cast<char*>(addr), len);
}

bool seals_usable() { return !g_forced && !g_seals_refused.load(std::memory_order_relaxed); }

void seals_refused() { g_seals_refused.store(true, std::memory_order_relaxed); }

bool pidfd_usable() { return !g_forced; }

pid_t current_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

int file_stat(const char* path, struct stat* st) {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, st, 0));
}

int fd_stat(int fd, struct stat* st) { return static_cast<int>(::syscall(SYS_fstat, fd, st)); }

}  // namespace torch_mp_ext
