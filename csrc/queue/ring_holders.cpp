// Who holds a ring, and reclaiming what dead holders held (Note [Ring holders]).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "platform/compat.h"
#include "platform/process.h"
#include "queue/ring_internal.h"

namespace torch_mp_ext {

// ---- holders (Note [Ring holders], Note [Holder tables]) ----------------------------------

void Ring::add_holders(uint32_t n) {
  lock(Deadline(-1), false);
  Held held{this};
  HolderTable table = holders_of(h_);
  int mine = table.find();
  if (mine >= 0) {
    h_->holders[mine].refs += n;
    return;
  }
  for (size_t i = 0; i < table.size(); ++i) {
    RingHolder& holder = h_->holders[i];
    if (!holder.key.free()) continue;
    holder.refs = n;  // counted before the claim publishes it
    store_fence();
    if (holder.key.claim(table.self())) return;
  }
  h_->untracked.fetch_add(n, std::memory_order_acq_rel);  // the table is full
}

namespace {

/// Note [Liveness outside the lock]
/// Judging a holder reads /proc, which takes microseconds to milliseconds per holder (and a
/// stopped or swapped-out peer makes it slower); the ring's mutex must not be held meanwhile,
/// or every put and get of every process waits for it. So liveness is judged first, without
/// the mutex, on a snapshot of the slots' words, and only the words found dead are reaped
/// under the mutex, each by a compare-and-swap on the exact word judged: a word that changed
/// meanwhile (freed, retaken) is left alone, and a dead word never lives again (it names the
/// process's start time).
std::vector<std::pair<size_t, uint64_t>> judge_dead(const HolderTable& table) {
  std::vector<std::pair<size_t, uint64_t>> dead;
  if (!table.can_judge()) return dead;
  const uint64_t me = table.self() & ~HOLDER_FLAGS;
  for (size_t i = 0; i < table.size(); ++i) {
    uint64_t word = table[i].word();
    if (word == 0 || (word & ~HOLDER_FLAGS) == me) continue;
    if (holder_word_dead(word, table.home_ns())) dead.emplace_back(i, word);
  }
  return dead;
}

}  // namespace

bool Ring::remove_holder(uint32_t* reaped) {
  *reaped = 0;
  HolderTable table = holders_of(h_);
  auto dead = judge_dead(table);  // Note [Liveness outside the lock]
  lock(Deadline(-1), false);
  Held held{this};
  int mine = table.find();
  if (mine >= 0) {
    RingHolder& holder = h_->holders[mine];
    if (holder.refs > 0) holder.refs -= 1;
    if (holder.refs == 0) holder.key.release(table.self());
  } else if (h_->untracked.load(std::memory_order_acquire) > 0) {
    h_->untracked.fetch_sub(1, std::memory_order_acq_rel);
  }
  // A process that died holding the ring: reclaim its share (the caller drops its block
  // references, which it could not drop itself).
  const uint64_t me = table.self();
  for (const auto& [i, word] : dead) {
    if (!table[i].begin_reap_judged(word, me)) continue;
    *reaped += h_->holders[i].refs;
    h_->holders[i].refs = 0;
    store_fence();
    table[i].end_reap(me);
  }
  bool others = false;
  for (const RingHolder& holder : h_->holders) others |= !holder.key.free() && holder.refs > 0;
  return !others && h_->inflight.load(std::memory_order_acquire) == 0 &&
         h_->untracked.load(std::memory_order_acquire) == 0;
}

void Ring::share_holder() { h_->inflight.fetch_add(1, std::memory_order_acq_rel); }

void Ring::adopt_shared_holder() {
  add_holders(1);
  h_->inflight.fetch_sub(1, std::memory_order_acq_rel);
}

std::optional<std::vector<Ring::HolderInfo>> Ring::holder_table(const Deadline& deadline) {
  std::vector<std::pair<uint64_t, uint32_t>> rows;  // (word, refs), read under the mutex
  {
    if (lock(deadline, false, true) != Lock::Ok) return std::nullopt;
    Held held{this};
    for (const RingHolder& holder : h_->holders) {
      uint64_t word = holder.key.word();
      if (word != 0) rows.emplace_back(word, holder.refs);
    }
  }
  std::vector<HolderInfo> out;  // judged without the mutex (Note [Liveness outside the lock])
  for (const auto& [word, refs] : rows) {
    out.push_back(HolderInfo{key_pid(word & ~HOLDER_FLAGS), refs,
                             !holder_word_dead(word, h_->pidns)});
  }
  return out;
}

std::optional<int64_t> Ring::holders(const Deadline& deadline) {
  if (lock(deadline, false, true) != Lock::Ok) return std::nullopt;
  Held held{this};
  int64_t n = h_->inflight.load(std::memory_order_acquire) +
              h_->untracked.load(std::memory_order_acquire);
  for (const RingHolder& holder : h_->holders) {
    if (!holder.key.free()) n += holder.refs;
  }
  return n;
}

// ---- judging the owner of the mutex (Note [A lock nobody holds]) ----------------------------

namespace {

/// The process (thread group) of thread `tid` in this pid namespace: -1 if no such thread
/// exists, 0 if it cannot be told.
pid_t thread_group_of(pid_t tid) {
  char path[48];
  std::snprintf(path, sizeof(path), "/proc/%d/status", static_cast<int>(tid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH ? -1 : 0;
  char buf[1024];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf) - 1);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n <= 0) return n < 0 && errno == ESRCH ? -1 : 0;
  buf[n] = '\0';
  const char* at = std::strstr(buf, "\nTgid:");
  return at == nullptr ? 0 : static_cast<pid_t>(std::strtol(at + 6, nullptr, 10));
}

}  // namespace

Ring::Owner Ring::judge_owner(pid_t tid) const {
  if (tid == current_tid()) return Owner::Garbage;  // we are waiting for it: we do not hold it
  if (h_->pidns != self_pidns()) return Owner::Doubtful;  // its thread ids mean nothing here
  HolderTable table = holders_of(h_);
  for (size_t i = 0; i < table.size(); ++i) {
    if ((table[i].word() & HOLDER_FOREIGN) != 0) return Owner::Doubtful;  // same
  }
  pid_t tgid = thread_group_of(tid);
  if (tgid < 0) return Owner::Garbage;  // gone, yet never marked owner-died
  if (tgid == 0 || tgid == self_pid()) return Owner::Doubtful;  // unknown; a thread of ours
  for (size_t i = 0; i < table.size(); ++i) {
    uint64_t word = table[i].word();
    if (word != 0 && (word & HOLDER_REAPING) == 0 && key_pid(word) == tgid) return Owner::Holder;
  }
  // Not a holder. A queue in flight is locked by its receiver before it registers
  // (adopt_shared_holder), and holders beyond the table never register.
  bool unregistered = h_->inflight.load(std::memory_order_acquire) != 0 ||
                      h_->untracked.load(std::memory_order_acquire) != 0;
  return unregistered ? Owner::Doubtful : Owner::Garbage;
}

}  // namespace torch_mp_ext
