// Process facts the core needs: identity that survives pid reuse, liveness, randomness.
//
// Note [Process identity]
// A process is named by its key: pid << 32 | the low 32 bits of its start time (clock ticks
// since boot, /proc/<pid>/stat field 22). A pid alone is not an identity: once a process is
// reaped the kernel may hand its pid to a new one, and a check by pid would take the newcomer
// for the dead process (and a table keyed by pid would never free its slot). The start time
// tells them apart: process_alive(pid, start) is true only for the process that started then.
// A zombie counts as dead (it runs no code and holds nothing any more). When /proc cannot be
// read for another reason than the process being gone, liveness is undecidable and the answer
// is "alive": every caller reclaims what the dead held, so a wrong "dead" would free memory a
// live process uses, while a wrong "alive" only leaks. This file is the one liveness check of
// the core; holder tables build on it (Note [Holder tables] in sync/holders.h).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace torch_mp_ext {

/// Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); 0 if unknown.
uint64_t process_start_time(pid_t pid);

/// True if `pid` is running (a zombie is not: it holds nothing any more) and, when
/// `start_time_low32` != 0, started at that time (low 32 bits), so a recycled pid does not
/// count as the same process (Note [Process identity]).
bool process_alive(pid_t pid, uint32_t start_time_low32 = 0);

/// The key of the process `pid` that started at `start_time` (Note [Process identity]).
uint64_t process_key(pid_t pid, uint64_t start_time);
/// The pid a key names (flag bits above the pid, Note [Holder tables], are ignored).
inline pid_t key_pid(uint64_t key) { return static_cast<pid_t>((key >> 32) & 0x3fffffffu); }
/// process_alive() of the process a key names.
bool key_alive(uint64_t key);

/// Identity of this process's pid namespace (inode of /proc/self/ns/pid); 0 if unknown.
uint64_t pid_namespace_id();
/// pid_namespace_id() of this process, read once.
uint64_t self_pidns();

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

/// Names the calling thread (`/proc/self/task/<tid>/comm`, at most 15 characters). Our
/// helper threads are named "tmx-*": fork-safe by design (at-fork handlers), so the Python
/// side's fork-after-threads check (processes/forkcheck.py) leaves them out.
void name_this_thread(const char* name);

/// Size in bytes of a memory page.
size_t page_size();

/// RLIMIT_NOFILE soft limit (for error messages).
uint64_t fd_limit();

}  // namespace torch_mp_ext
