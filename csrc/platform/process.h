// Process facts the core needs: identity that survives pid reuse, liveness, randomness.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace torch_mp_ext {

/// Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); 0 if unknown.
uint64_t process_start_time(pid_t pid);

/// True if `pid` is running (a zombie is not: it holds nothing any more) and, when
/// `start_time_low32` != 0, started at that time (low 32 bits), so a recycled pid does not
/// count as the same process.
bool process_alive(pid_t pid, uint32_t start_time_low32 = 0);

/// Identity of this process's pid namespace (inode of /proc/self/ns/pid); 0 if unknown.
uint64_t pid_namespace_id();

/// This process: pid and (pid << 32 | low 32 bits of start time). Recomputed after fork.
pid_t self_pid();
uint64_t self_key();
void refresh_self_after_fork();

/// 64 random bits from getrandom(2) (never 0).
uint64_t random_u64();

/// prctl(PR_SET_PDEATHSIG, sig): this process gets `sig` when its parent thread exits.
void set_pdeathsig(int sig);

/// Starts a native thread (no GIL needed) that SIGKILLs this process when process `pid` ends
/// (the whole process, not the thread that started us: Note [Children die with their parent]
/// in _worker.py). Waits on a pidfd; where pidfd_open is missing, polls getppid() != pid every
/// 100 ms. If `pid` is already gone, kills at once.
void kill_self_when_process_exits(pid_t pid);

/// Size in bytes of a memory page.
size_t page_size();

/// RLIMIT_NOFILE soft limit (for error messages).
uint64_t fd_limit();

}  // namespace torch_mp_ext
