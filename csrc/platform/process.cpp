#include "platform/process.h"

#include <fcntl.h>
#include <signal.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/check.h"
#include "common/unique_fd.h"
#include "platform/compat.h"

namespace torch_mp_ext {

namespace {

enum class Stat { Ok, Gone, Unknown };

/// State letter (field 3) and start time (field 22) of /proc/<pid>/stat. Gone: no such
/// process; Unknown: /proc could not be read for another reason (not mounted, no permission).
Stat read_stat(pid_t pid, char* state, uint64_t* start_time) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return errno == ENOENT || errno == ESRCH ? Stat::Gone : Stat::Unknown;
  char buf[1024];
  ssize_t n;
  do {
    n = ::read(fd.get(), buf, sizeof(buf) - 1);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno == ESRCH)) return Stat::Gone;  // exited after the open
  if (n < 0) return Stat::Unknown;
  buf[n] = '\0';
  // The command name (field 2) may contain spaces and ')': fields restart after the last ')'.
  char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] == '\0') return Stat::Unknown;
  p += 2;  // field 3 (state)
  *state = *p;
  for (int field = 3; field < 22 && *p; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return Stat::Unknown;
    ++p;
  }
  *start_time = std::strtoull(p, nullptr, 10);
  return Stat::Ok;
}

}  // namespace

uint64_t process_start_time(pid_t pid) {
  char state = 0;
  uint64_t start = 0;
  return read_stat(pid, &state, &start) == Stat::Ok ? start : 0;
}

bool process_alive(pid_t pid, uint32_t start_time_low32) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t start = 0;
  switch (read_stat(pid, &state, &start)) {
    case Stat::Gone:
      return false;  // exited between kill() and the read
    case Stat::Unknown:
      return true;  // it exists (kill said so) and nothing more can be told: not dead
    case Stat::Ok:
      break;
  }
  if (state == 'Z' || state == 'X') return false;  // exited, not yet reaped: holds nothing
  return start_time_low32 == 0 || static_cast<uint32_t>(start) == start_time_low32;
}

bool key_alive(uint64_t key) {
  return process_alive(key_pid(key), static_cast<uint32_t>(key & 0xffffffffu));
}

uint64_t process_key(pid_t pid, uint64_t start_time) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(pid)) << 32) |
         static_cast<uint32_t>(start_time);
}

uint64_t pid_namespace_id() {
  struct stat st;
  if (file_stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

namespace {
// Cached: a getpid() per call cost a syscall on every doorbell and holder check. A fork
// refreshes them in the child (pthread_atfork, registered before the first read).
std::atomic<pid_t> g_pid{0};
std::atomic<uint64_t> g_key{0};

void ensure_self() {
  static const bool registered = [] {
    ::pthread_atfork(nullptr, nullptr, [] { refresh_self_after_fork(); });
    return true;
  }();
  (void)registered;
  if (g_pid.load(std::memory_order_acquire) == 0) refresh_self_after_fork();
}
}  // namespace

void refresh_self_after_fork() {
  pid_t pid = ::getpid();
  g_key.store(process_key(pid, process_start_time(pid)), std::memory_order_relaxed);
  g_pid.store(pid, std::memory_order_release);
}

pid_t self_pid() {
  ensure_self();
  return g_pid.load(std::memory_order_relaxed);
}

uint64_t self_key() {
  ensure_self();
  return g_key.load(std::memory_order_relaxed);
}

uint64_t random_u64() {
  for (;;) {
    uint64_t value = 0;
    ssize_t n = ::getrandom(&value, sizeof(value), 0);
    if (n == static_cast<ssize_t>(sizeof(value))) {
      if (value != 0) return value;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    throw SyscallError(n < 0 ? errno : EIO, "getrandom", "64 random bits");
  }
}

void set_pdeathsig(int sig) {
  TMX_CHECK_VALUE(sig >= 0 && sig < 65, "set_pdeathsig: invalid signal number ", sig);
  TMX_SYSCHECK(::prctl(PR_SET_PDEATHSIG, static_cast<unsigned long>(sig)), "prctl",
               "PR_SET_PDEATHSIG");
}

uint64_t self_pidns() {
  static const uint64_t ns = pid_namespace_id();  // fork keeps the namespace
  return ns;
}

void kill_self_when_process_exits(pid_t pid) {
  // Note [Platform floor]: pidfd_open needs Linux 5.3; without it (ENOSYS), getppid() polls.
  int fd = pidfd_usable() ? static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)) : -1;
  if (fd < 0 && errno == ESRCH) ::kill(::getpid(), SIGKILL);
  std::thread([fd, pid] {
    name_this_thread("tmx-parentwatch");
    if (fd >= 0) {
      struct pollfd p{fd, POLLIN, 0};
      while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
      }
    } else {
      while (::getppid() == pid) ::usleep(100000);
    }
    ::kill(::getpid(), SIGKILL);
  }).detach();
}

void name_this_thread(const char* name) {
  ::prctl(PR_SET_NAME, name, 0, 0, 0);  // best effort: a name is only a label
}

size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

uint64_t fd_limit() {
  struct rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  return static_cast<uint64_t>(rl.rlim_cur);
}

}  // namespace torch_mp_ext
