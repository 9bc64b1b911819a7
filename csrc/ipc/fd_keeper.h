// Keeping anonymous segments reachable after their owner exits (Note [Exit keeper]).
//
// Note [Exit keeper]
// With the file_descriptor strategy a receiver gets a segment's fd from the segment's owner
// (Note [fd server]). A worker that puts a tensor and returns would make the receiver fail if
// the worker exits before the receiver unpickles (torch fails there too). So a process exiting
// normally while handles to its segments are still in flight (SegmentHeader::inflight > 0)
// forks a keeper: a process that inherits the listening socket and the segment fds, closes
// everything else (so it never holds a pipe someone waits on), and answers fd requests at the
// same address until no handle names its segments any more, no other process of its run is
// alive (Note [Session names]: a handle is redeemed by a member of the run that made it, so
// when the last one has gone, nobody is left to ask; a test suite or a launcher that ends is
// not outlived by keepers), or TORCH_MP_EXT_EXIT_LINGER_S seconds (default 30) pass. It runs
// no Python and allocates nothing after fork: only async-signal-safe system calls and atomic
// loads. A SIGKILLed process has no keeper.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <vector>

#include "shm/layout.h"

namespace torch_mp_ext {

struct KeptSegment {
  uint64_t segment_id;
  uint64_t secret;
  int fd;
  const SegmentHeader* header;
};

/// Forks the keeper if any of `segments` has handles in flight; returns its pid, or 0.
pid_t start_exit_keeper(const std::vector<KeptSegment>& segments, int listen_fd,
                        double seconds);

}  // namespace torch_mp_ext
