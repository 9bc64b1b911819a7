// Unmapping large segments off the caller's path (Note [Unmapping off the caller's path]).
//
// Note [Unmapping off the caller's path]
// munmap() of the last mapping of a segment frees its pages, and that costs time in
// proportion to its size: 27 ms for 128 MB here, against 30 us for 4 KB. It runs when the
// last reference to a block goes, i.e. in the `del tensor` (or the storage deleter) of
// whoever lets go last, which made releasing a file_system block cost 2.6 ms at 16 MB and
// 25 ms at 128 MB. So mappings of at least DEFERRED_UNMAP_BYTES are handed to one
// background thread per process that unmaps them; the caller pays a madvise and a push.
// What stays true:
//   - names are unlinked by the caller as before (a name never outlives its last holder
//     longer than it did), only the page freeing moves;
//   - a deferred range is MADV_DONTFORK first: a child forked before the thread got to it
//     never inherits it (and must never unmap that address, which the child may reuse);
//   - an allocation that fails for room (ENOSPC/ENOMEM) waits for the pending unmaps and
//     retries once, whatever it found (an unmap may have ended during the failed attempt),
//     so a full /dev/shm is never a false alarm;
//   - the thread is created on first use, and again in a forked child on its first use;
//     at exit the kernel unmaps whatever is left.
#pragma once

#include <cstddef>

namespace torch_mp_ext {

/// Mappings at least this large are unmapped by the background thread.
constexpr size_t DEFERRED_UNMAP_BYTES = size_t{1} << 20;

/// Unmaps [base, base + size): now if small, else soon, on the background thread.
void unmap_later(void* base, size_t size);

/// Unmaps everything still pending, in this thread, and waits for an unmap in progress;
/// returns the bytes it found pending or in progress (0: there was nothing to wait for).
size_t finish_pending_unmaps();

}  // namespace torch_mp_ext
