// Surviving a shared-memory file truncated under this process (Note [Truncated under us]).
//
// Note [Truncated under us]
// A named segment (file_system strategy) is a file in /dev/shm that any process of the same
// user can ftruncate while others map it; the next access to a page past the new end is a
// SIGBUS, which would kill the interpreter. (memfd segments, the file_descriptor strategy, are
// sealed against shrinking: F_SEAL_SHRINK.) Two defences:
// - At attach, the file is fstat()ed and must be as large as the handle and the header say
//   (checked_fd_size, validate): a file truncated before it is mapped is refused with
//   CorruptSegmentError.
// - While this thread runs the core's own accesses to shared headers (segment headers, slot
//   tables, holder tables, refcounts), a SigbusGuard is armed: a thread-local counter, no
//   syscall. A SIGBUS (BUS_ADRERR, a page with no file behind it) in an armed thread maps a
//   private zero page over the faulting page (mmap MAP_FIXED, async-signal-safe) and returns,
//   so the access completes on zeros, and records the address; the guard's check() then
//   raises CorruptSegmentError naming it. Zeros fail every later validation (magic, kind,
//   capacity), and writes to the private page reach no one, so the segment is dead for this
//   process but the interpreter lives. A SIGBUS in a thread that is not armed (tensor data
//   read by a torch kernel, numpy, user code) goes to the handler that was installed before
//   ours (default: the process dies with SIGBUS); that limit is documented in
//   docs/troubleshooting.md, with the fix: the file_descriptor strategy.
// The handler is installed when a named segment is first mapped, and re-installed (chaining to
// whatever replaced it) whenever another one is mapped.
#pragma once

namespace torch_mp_ext {

/// Installs the SIGBUS handler if it is not ours (idempotent; one sigaction() to look).
void install_sigbus_handler();

/// Arms the calling thread (Note [Truncated under us]) for its lifetime; nests.
class SigbusGuard {
 public:
  SigbusGuard() noexcept;
  ~SigbusGuard();
  SigbusGuard(const SigbusGuard&) = delete;
  SigbusGuard& operator=(const SigbusGuard&) = delete;
  /// CorruptSegmentError naming `what` if a page was lost since this guard was armed (the
  /// outermost guard of the thread reports it; inner ones leave it to their caller).
  void check(const char* what);
  /// True if a page was lost since this guard was armed (for callers that do not raise).
  bool lost() const noexcept;

 private:
  bool outer_;
};

/// Pages this process lost to truncated files since it started (tests).
unsigned long sigbus_pages_lost();

}  // namespace torch_mp_ext
