// Session member table and the sweep of a finished session's names (Note [Session names]).
#include "shm/session.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>

#include "common/unique_fd.h"
#include "platform/compat.h"
#include "platform/process.h"
#include "shm/file_limit.h"
#include "shm/layout.h"
#include "shm/reaper.h"
#include "shm/segment.h"
#include "shm/sigbus.h"
#include "sync/holders.h"

namespace torch_mp_ext {

namespace {

constexpr uint64_t SESSION_MAGIC = 0x314e4f4953534d54ULL;  // "TMSSION1" little-endian
constexpr size_t MAX_MEMBERS = 128;
/// A half-made table (magic 0) this old is garbage (Note [A session on a full /dev/shm]).
constexpr time_t HALF_MADE_TABLE_AGE_S = 10;

struct SessionTable {
  std::atomic<uint64_t> magic;  ///< written last by the root
  uint64_t tag;
  uint64_t pidns;                 ///< the root's pid namespace: members are judged there
  std::atomic<int64_t> untracked;  ///< members that found no free slot (never swept then)
  HolderSlot members[MAX_MEMBERS];
};

SessionTable* g_table = nullptr;
uint64_t g_tag = 0;
std::string g_name;
int g_slot = -1;

HolderTable members_of(SessionTable* t) {
  return HolderTable(t->members, MAX_MEMBERS, sizeof(HolderSlot), t->pidns);
}

void claim_member() {
  HolderTable table = members_of(g_table);
  g_slot = table.claim();
  if (g_slot < 0) {
    table.reap([](size_t) {});  // slots of dead members hold nothing: free them
    g_slot = table.claim();
  }
  if (g_slot < 0) g_table->untracked.fetch_add(1, std::memory_order_acq_rel);
}

/// The file this extension was loaded from, as /proc/<pid>/maps names it ("" if unknown).
const std::string& extension_path() {
  static const std::string path = [] {
    Dl_info info{};
    return ::dladdr(reinterpret_cast<void*>(&session_end), &info) != 0 && info.dli_fname
               ? std::string(info.dli_fname)
               : std::string();
  }();
  return path;
}

/// Whether `pid` has this extension mapped: a member's fork that exec'd another program
/// (torch's torch_shm_manager, a subprocess) keeps the member's slot, but holds no handle
/// and can redeem none (Note [Session names]). When that cannot be told, it may.
bool runs_extension(pid_t pid) {
  const std::string& path = extension_path();
  if (path.empty()) return true;
  char maps[64];
  std::snprintf(maps, sizeof(maps), "/proc/%d/maps", static_cast<int>(pid));
  FILE* f = std::fopen(maps, "re");
  if (f == nullptr) return errno != ENOENT;  // gone meanwhile; EACCES: cannot tell
  char line[4096];
  bool found = false;
  while (!found && std::fgets(line, sizeof(line), f) != nullptr) {
    found = std::strstr(line, path.c_str()) != nullptr;
  }
  std::fclose(f);
  return found;
}

/// Whether a member that could still redeem a handle of the session lives.
bool members_alive(SessionTable* t) {
  return t->untracked.load(std::memory_order_acquire) != 0 ||
         members_of(t).any_alive_where(
             [](const HolderSlot& slot) { return runs_extension(key_pid(slot.key())); });
}

/// A name of the session (its tag in the first 8 hex digits) made by `creator`, or 0.
pid_t session_name_creator(const std::string& entry, const std::string& tag_hex) {
  if (entry.compare(0, 6, "torch_") != 0) return 0;
  char* end = nullptr;
  long pid = std::strtol(entry.c_str() + 6, &end, 10);
  if (end == entry.c_str() + 6 || *end != '_' || pid <= 0) return 0;
  std::string hex(end + 1);
  if (hex.size() != 16 || hex.compare(0, 8, tag_hex) != 0) return 0;
  return static_cast<pid_t>(pid);
}

/// Nobody alive holds the segment at `path` and its creator is dead or this process.
bool unheld(const std::string& path) {
  if (half_made_segment(path)) return true;  // Note [Half-made segments]
  return judge_segment_header(path, [](SegmentHeader& h) {
    return h.magic == SEGMENT_MAGIC && h.layout_version == LAYOUT_VERSION &&
           holders_of(&h).can_judge() &&
           (h.owner_key == self_key() || holder_word_dead(h.owner_key, h.pidns)) &&
           !holders_of(&h).any_alive();
  });
}

/// Gives the new member table at `fd` its pages before anything writes them (Note [A session
/// on a full /dev/shm]); false when /dev/shm (or RLIMIT_FSIZE) has no room for it.
bool reserve_table(int fd) {
  if (!file_size_allowed(sizeof(SessionTable))) return false;
  int rc;
  do {
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(sizeof(SessionTable)));
  } while (rc == EINTR);
  if (rc == EINVAL || rc == EOPNOTSUPP) {  // no fallocate here: sized only, the guard watches
    int r;
    do {
      r = ::ftruncate(fd, static_cast<off_t>(sizeof(SessionTable)));
    } while (r != 0 && errno == EINTR);
    return r == 0;
  }
  return rc == 0;
}

}  // namespace

bool session_join(uint64_t tag, int root, bool create) {
  if (g_table != nullptr) return g_tag == tag;
  char name[NAME_CAPACITY];
  std::snprintf(name, sizeof(name), "/tmx_%d_session_%016" PRIx64, root, tag);
  int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT | O_EXCL : 0);
  UniqueFd fd(::shm_open(name, flags, 0600));
  if (!fd.valid()) return false;
  struct stat st;
  bool sized = create ? reserve_table(fd.get())
                      : fd_stat(fd.get(), &st) == 0 &&
                            static_cast<size_t>(st.st_size) >= sizeof(SessionTable);
  void* p = sized ? ::mmap(nullptr, sizeof(SessionTable), PROT_READ | PROT_WRITE, MAP_SHARED,
                           fd.get(), 0)
                  : MAP_FAILED;
  if (p == MAP_FAILED) {
    if (create) ::shm_unlink(name);
    return false;
  }
  auto* t = static_cast<SessionTable*>(p);
  install_sigbus_handler();  // Note [A session on a full /dev/shm]
  bool ok;
  {
    SigbusGuard guard;
    if (create) {
      new (t) SessionTable();  // zero-filled pages: every slot free
      t->tag = tag;
      t->pidns = pid_namespace_id();
      t->magic.store(SESSION_MAGIC, std::memory_order_release);
      ok = !guard.lost();
    } else {
      ok = t->magic.load(std::memory_order_acquire) == SESSION_MAGIC && t->tag == tag &&
           !guard.lost();
    }
  }
  if (!ok) {
    ::munmap(p, sizeof(SessionTable));
    if (create) ::shm_unlink(name);
    return false;
  }
  g_table = t;
  g_tag = tag;
  g_name = name;
  claim_member();
  return true;
}

void session_leave() {
  if (g_table == nullptr) return;
  if (g_slot >= 0) members_of(g_table)[static_cast<size_t>(g_slot)].release(self_key());
  g_slot = -1;
}

void session_atfork_child() {
  if (g_table == nullptr) return;
  g_slot = -1;  // the parent's slot
  claim_member();
}

bool session_may_have_members() {
  if (g_table == nullptr) return true;
  return g_table->untracked.load(std::memory_order_acquire) != 0 ||
         members_of(g_table).any_alive();
}

uint32_t session_name_tag() { return g_table == nullptr ? 0 : static_cast<uint32_t>(g_tag); }

namespace {

/// Unlinks (or lists, with `dry_run`) the names of session `tag32` that no live process holds.
std::vector<std::string> sweep_names(uint32_t tag32, bool dry_run) {
  char tag_hex[9];
  std::snprintf(tag_hex, sizeof(tag_hex), "%08" PRIx32, tag32);
  std::vector<std::string> names;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* entry = ::readdir(dir)) {
      std::string name = entry->d_name;
      pid_t creator = session_name_creator(name, tag_hex);
      if (creator == 0 || (creator != self_pid() && process_alive(creator))) continue;
      names.push_back(name);
    }
    ::closedir(dir);
  }
  std::vector<std::string> removed;
  for (const std::string& name : names) {
    if (unheld("/dev/shm/" + name) && (dry_run || unlink_name("/" + name))) {
      removed.push_back(name);
    }
  }
  return removed;
}

/// A table never finished (magic 0, or short): its root died making it, so no member joined
/// and no name carries its tag. Unless it is recent: a root in another pid namespace (a
/// container sharing /dev/shm, whose pids look dead here) may be writing it now.
bool half_made_long_ago(int fd) {
  struct stat st;
  return fd_stat(fd, &st) == 0 && ::time(nullptr) - st.st_mtime >= HALF_MADE_TABLE_AGE_S;
}

}  // namespace

std::vector<std::string> session_end() {
  if (g_table == nullptr) return {};
  session_leave();
  if (members_alive(g_table)) return {};
  std::vector<std::string> removed = sweep_names(session_name_tag(), false);
  ::shm_unlink(g_name.c_str());
  return removed;
}

std::vector<std::string> reap_dead_sessions(bool dry_run) {
  std::vector<std::string> tables;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* entry = ::readdir(dir)) {
      std::string name = entry->d_name;
      char* end = nullptr;
      if (name.compare(0, 4, "tmx_") != 0) continue;
      long pid = std::strtol(name.c_str() + 4, &end, 10);
      if (end == name.c_str() + 4 || pid <= 0 || std::string(end).rfind("_session_", 0) != 0) {
        continue;
      }
      if ("/" + name == g_name || process_alive(static_cast<pid_t>(pid))) continue;
      tables.push_back(name);
    }
    ::closedir(dir);
  }
  std::vector<std::string> removed;
  for (const std::string& name : tables) {
    // Read with pread, never mapped: a table whose root died before writing it (magic 0)
    // may have no pages, and touching one on a full /dev/shm is a SIGBUS (Note [A session on
    // a full /dev/shm]); reading a hole returns zeros and allocates nothing.
    UniqueFd fd(::shm_open(("/" + name).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0));
    if (!fd.valid()) continue;
    alignas(SessionTable) unsigned char buf[sizeof(SessionTable)] = {};
    ssize_t n;
    do {
      n = ::pread(fd.get(), buf, sizeof(buf), 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0) continue;
    auto* t = reinterpret_cast<SessionTable*>(buf);
    uint64_t magic = static_cast<size_t>(n) >= sizeof(uint64_t) ? t->magic.load() : 0;
    bool complete = static_cast<size_t>(n) == sizeof(SessionTable);
    if (magic == SESSION_MAGIC && complete) {
      if (members_alive(t)) continue;
      for (std::string& s : sweep_names(static_cast<uint32_t>(t->tag), dry_run)) {
        removed.push_back(std::move(s));
      }
    } else if (magic != 0 && complete) {
      continue;  // not a table of ours (another layout): left alone
    } else if (!half_made_long_ago(fd.get())) {
      continue;
    }
    if (dry_run || unlink_name("/" + name)) removed.push_back(name);
  }
  return removed;
}

}  // namespace torch_mp_ext
