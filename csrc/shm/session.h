// The processes of one run, and the file_system names they leave (Note [Session names]).
//
// Note [Session names]
// A handle inside a message holds a counted reference (Note [Block lifetime]) and is counted
// in its segment's `inflight`. If the process carrying the message dies (a consumer killed
// after its get committed, a producer killed between pickling and committing its put, a
// pipeline stage killed with items in hand), the handle is gone but still counted, and a
// file_system name it named stays in /dev/shm: the run-time reaper (Note [Reclaiming names at
// run time]) rightly leaves names that something in flight may still redeem. Only once no
// process that could redeem it lives is such a name garbage.
// So the processes of a run form a *session*: the first process that imports torch_mp_ext
// (no TORCH_MP_EXT_SESSION in its environment) is its root; it creates a member table
// (/dev/shm/tmx_<root pid>_session_<tag>, a holder table: Note [Holder tables]) and exports
// the tag; spawned and forkserver children and subprocesses inherit the variable and join
// at import, fork children join in the registry's atfork child handler (whatever forks:
// multiprocessing, os.fork, the forkserver). Every name created by a member carries the
// session's 32-bit tag as the first 8 of its 16 hex digits. A member that exits normally
// leaves the table; the one that then finds no live member (usually the root, after joining
// its children) unlinks every name of the session whose creator and holders are all dead,
// whatever is in flight, and then the member table. Since every process that could hold a
// handle to such a name is a member and dead, nothing can redeem it any more. The one way
// around that is a handle handed outside the run (a ForkingPickler pickle written to a file
// or a socket that an unrelated program, with its own session, reads later): such a handle
// must be redeemed before its run has ended, as with torch's file_system strategy before
// its creator unlinks the name.
// A member counts as alive only while it has this extension mapped (/proc/<pid>/maps): a
// member's fork that exec'd another program keeps the member's slot and key but can hold no
// handle (torch's torch_shm_manager, forked by a member under torch's file_system strategy,
// outlived the test suite's root and kept its table in /dev/shm until `cleanup`).
// Limits: a member that finds the table full (128 processes alive at once) is counted in
// `untracked`, and a session with an untracked member is never swept (a leak, never an early
// unlink); two last members exiting at the same instant may each see the other alive and
// both leave the sweep undone, and a run whose last member is SIGKILLed sweeps nothing:
// `python -m torch_mp_ext cleanup` then finds the session's table with no live member and
// sweeps it (reap_dead_sessions). The forkserver's
// server leaves the table at start (it never holds handles); its children join at fork.
//
// Note [A session on a full /dev/shm]
// The session is optional: a process without one works, its names are only left for
// `cleanup` instead of swept by the run. So making the member table must never kill the
// process (issue 35: on a full /dev/shm `import torch_mp_ext` died of SIGBUS, since tmpfs
// allocates a page at first touch). The root reserves the table's pages (posix_fallocate,
// after checking RLIMIT_FSIZE: Note [File size limit]) before writing it, and both creating
// and joining touch it under a SigbusGuard (Note [Truncated under us]); any failure unlinks
// what was made and leaves the process outside any session. reap_dead_sessions reads tables
// with pread, never a mapping (a hole reads as zeros without a page), and removes the tables
// that such deaths left half-made (magic 0) once their root is gone and the table is 10 s old
// (a root in another pid namespace sharing /dev/shm, whose pid looks dead here, may be
// writing a new one). A new root runs it at
// start-up (Python: sharing/memory.py), so the tables of runs whose last process was killed
// do not pile up in /dev/shm.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch_mp_ext {

/// Joins session `tag` whose root is `root` (as its root when `create`: makes the member
/// table). False if the table cannot be opened or made (the session is over, or /dev/shm is
/// unusable): this process then belongs to no session and its names carry no tag.
bool session_join(uint64_t tag, int root, bool create);

/// This process stops being a member but keeps the table, so that its fork children join.
void session_leave();

/// Fork child: joins as a member of its own (from the atfork child handler).
void session_atfork_child();

/// Whether a process of this process's session may still live (true outside a session: it
/// cannot be told). Judges by pid and start time only, with no allocation: the exit keeper
/// calls it after fork (Note [Exit keeper] in ipc/fd_keeper.h).
bool session_may_have_members();

/// The 32-bit tag new names carry; 0 outside any session.
uint32_t session_name_tag();

/// At normal exit: leaves; if no member lives any more, unlinks the session's names that no
/// live process holds, whatever is in flight, then the member table. Returns the names
/// removed (the member table not included).
std::vector<std::string> session_end();

/// Sessions whose members are all dead but whose table is still there (the last member was
/// SIGKILLed, or exited with os._exit): unlinks (or lists, with `dry_run`) their names that no
/// live process holds, whatever is in flight, and their tables. Returns the names.
std::vector<std::string> reap_dead_sessions(bool dry_run);

}  // namespace torch_mp_ext
