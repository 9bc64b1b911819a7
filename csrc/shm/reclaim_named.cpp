// Reclaiming file_system segments held only by dead processes, while the program runs.
//
// Note [Reclaiming names at run time]
// A named segment's references held by a process that was SIGKILLed are marked by its holder
// bits (Note [Dead holders]); nobody drops them unless someone looks. A receiver that unmaps a
// name judges it then (maybe_reap_on_unmap), but a holder that dies *after* every other
// process let go (a killed child's never-sent tensors; a forked worker that inherited its
// parent's tensors and was killed after the parent dropped them) leaves a name nobody looks at
// again until `python -m torch_mp_ext cleanup`; so does a name whose last two live holders
// exit together, each seeing the other alive. So whenever a process joins a child
// (Process.join() of torch_mp_ext's Process classes, with file_system in use) it walks
// /dev/shm for segments created by itself or by a dead process, maps each, drops the dead
// holders' references exactly once (the same claim-and-clear as Registry's reclaim: a
// concurrent reclaimer never drops a bit twice), and unlinks the name when the count reaches
// zero (FLAG_UNLINK_ON_ZERO) or when no live process holds it and no handle in flight names it
// (the reaper's rule). Segments of live creators other than this process are theirs to judge;
// other pid namespaces are never judged.
#include <dirent.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "platform/process.h"
#include "shm/reaper.h"
#include "shm/registry.h"

namespace torch_mp_ext {

std::vector<std::string> Registry::reclaim_named(const std::string& prefix) {
  std::vector<std::string> removed;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return removed;
  std::vector<std::pair<std::string, pid_t>> names;
  while (dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const char* p = name.c_str() + prefix.size();
    char* end = nullptr;
    long pid = std::strtol(p, &end, 10);
    if (end == p || *end != '_' || pid <= 0) continue;
    if (pid != self_pid() && process_alive(static_cast<pid_t>(pid))) continue;
    names.emplace_back(name, static_cast<pid_t>(pid));
  }
  ::closedir(dir);
  for (const auto& [name, creator] : names) {
    std::shared_ptr<Mapping> m;
    try {
      m = open_named_segment("/" + name, 0);
    } catch (const std::exception&) {
      // Gone meanwhile, not ours (torch's own torch_* files), another version, or a dead
      // creator's half-made segment (Note [Half-made segments]: the reaper's rules decide).
      if (creator != self_pid() && half_made_segment("/dev/shm/" + name) &&
          unlink_name("/" + name)) {
        removed.push_back(name);
      }
      continue;
    }
    SegmentHeader* h = m->header();
    if (h->kind != static_cast<uint32_t>(SegmentKind::Arena) || !holders_of(h).can_judge()) {
      m->deregister_holder();
      continue;
    }
    size_t dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dropped = reclaim_locked(*m);  // may unlink: FLAG_UNLINK_ON_ZERO
    }
    m->deregister_holder();
    bool garbage =
        h->inflight.load(std::memory_order_acquire) == 0 && !holders_of(h).any_alive();
    bool unlinked = garbage ? unlink_name(m->name()) : false;
    if (dropped > 0 || unlinked) removed.push_back(name);
  }
  return removed;
}

}  // namespace torch_mp_ext
