// Removing names of file_system segments whose holders are all dead (Note [Holder table]).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "shm/layout.h"

namespace torch_mp_ext {

struct ReapOptions {
  std::string directory = "/dev/shm";
  std::string prefix = "torch_";
  bool dry_run = false;
  /// Also remove segments that handles in flight still name (their receivers will fail).
  bool include_inflight = false;
};

/// Unlinks every torch_mp_ext segment under `directory` whose creator and registered holders
/// are all dead and that nothing in flight names. Segments of other programs (torch's own
/// torch_* files, anything without our magic) and of other pid namespaces are never touched.
/// Returns the names removed (or that would be, with dry_run).
std::vector<std::string> reap_dead_segments(const ReapOptions& options);

/// Note [Half-made segments]: `path` is one of our names (exact format) whose header's magic
/// (written last) was never written: its creator was killed while creating it. Only
/// meaningful once the creator is known dead.
bool half_made_segment(const std::string& path);

/// Maps the header of the segment file at `path` read-only and returns what `judge` says of
/// it; false if it is not a regular file large enough, cannot be mapped, or is truncated
/// while `judge` reads it (Note [Truncated under us]). For the reaper and the session sweep.
bool judge_segment_header(const std::string& path,
                          const std::function<bool(SegmentHeader&)>& judge);

}  // namespace torch_mp_ext
