// What the core needs from libc and the kernel above the platform floor, chosen at run time
// (Note [Platform floor]).
//
// Note [Platform floor]
// torch's own wheels need glibc 2.28 (manylinux_2_28) and run on the kernels of RHEL 8
// (4.18), Debian 11 (5.10) and Ubuntu 20.04 (5.4); the extension must load and work wherever
// they do. So it links against no glibc symbol version newer than 2.28 (x86_64:
// glibc_floor.h rebinds the few that a newer build machine's headers pick; a test reads
// `objdump -T`), and every call newer than the floor has a fallback chosen at run time:
// - pthread_mutex_clocklock (glibc 2.30) is looked up with dlsym; without it a timed lock of a
//   robust mutex waits with pthread_mutex_timedlock (CLOCK_REALTIME) in slices of at most
//   100 ms, each recomputed from the CLOCK_MONOTONIC deadline, so a wall-clock jump moves a
//   wait by at most one slice;
// - MADV_POPULATE_WRITE (Linux 5.14) reserves a growing ring's new pages; without it (EINVAL)
//   the pages are written with read(2) from /dev/zero: a page tmpfs cannot back makes the
//   read fail with EFAULT in the kernel, never a SIGBUS in the process. Only pages past the
//   ring's old capacity are written, which hold nothing yet;
// - memfd sealing (F_ADD_SEALS): without it (EINVAL) a memfd segment is used unsealed (a
//   receiver could truncate it: the SIGBUS guard of Note [Truncated under us] still applies);
// - pidfd_open (Linux 5.3): without it a forkserver worker watches its parent by polling
//   getppid() every 100 ms (process.cpp);
// - gettid (glibc 2.30) and stat/fstat (2.33) go through syscall(2).
// TORCH_MP_EXT_FALLBACKS=1 in the environment (read once) forces every fallback on, so the
// test suite runs them on a machine that does not need them.
#pragma once

#include <pthread.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#include <cstddef>

namespace torch_mp_ext {

/// True when TORCH_MP_EXT_FALLBACKS=1 was set when the extension was loaded.
bool fallbacks_forced();

/// pthread_mutex_clocklock(CLOCK_MONOTONIC), or its fallback: 0 or an errno value, as the
/// pthread functions return (EOWNERDEAD and ENOTRECOVERABLE included).
int mutex_lock_until(pthread_mutex_t* mutex, const timespec& monotonic_deadline);

/// Whether pthread_mutex_clocklock is used (false: its fallback).
bool has_clocklock();

/// Backs [addr, addr + len) of a shared mapping with pages now (MADV_POPULATE_WRITE, or
/// zeros read from /dev/zero): 0, or ENOSPC when the file system has no room for them, or the
/// errno of the failure. The range must hold nothing (the fallback overwrites it with zeros).
int populate_shared(void* addr, size_t len);

/// Whether memfd segments may be sealed (F_ADD_SEALS): false when fallbacks are forced or the
/// kernel refused a seal once.
bool seals_usable();
/// Records that the kernel refused F_ADD_SEALS (EINVAL): later segments are not sealed.
void seals_refused();

/// Whether pidfd_open may be tried (false when fallbacks are forced).
bool pidfd_usable();

/// The calling thread's id (gettid(2)).
pid_t current_tid();

/// stat(2) and fstat(2) through syscall(2): 0, or -1 with errno set.
int file_stat(const char* path, struct stat* st);
int fd_stat(int fd, struct stat* st);

}  // namespace torch_mp_ext
