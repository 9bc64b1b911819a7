// Who holds a ring, and reclaiming what dead holders held (Note [Ring holders]).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "platform/process.h"
#include "queue/ring_internal.h"

namespace torch_mp_ext {

bool holder_alive(uint64_t key) {
  auto pid = static_cast<pid_t>(key >> 32);
  if (!process_alive(pid, static_cast<uint32_t>(key))) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno != ENOENT;  // cannot tell (no /proc?): assume alive
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return true;
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the command name may contain anything
  return paren == nullptr || paren[1] != ' ' || paren[2] != 'Z';
}

// ---- holders (Note [Ring holders]) --------------------------------------------------------

void Ring::add_holders(uint32_t n) {
  lock(Deadline(-1), false);
  Held held{this};
  uint64_t key = self_key();
  RingHolder* free_slot = nullptr;
  for (RingHolder& holder : h_->holders) {
    if (holder.key == key) {
      holder.refs += n;
      return;
    }
    if (holder.key == 0 && free_slot == nullptr) free_slot = &holder;
  }
  if (free_slot == nullptr) {
    h_->untracked.fetch_add(n, std::memory_order_acq_rel);
    return;
  }
  free_slot->refs = n;
  free_slot->foreign = pid_namespace_id() != h_->pidns ? 1 : 0;
  store_fence();
  free_slot->key = key;  // published last: a death before this leaves a free slot
}

bool Ring::remove_holder(uint32_t* reaped) {
  *reaped = 0;
  lock(Deadline(-1), false);
  Held held{this};
  uint64_t key = self_key();
  bool counted = false;
  bool others = false;
  for (RingHolder& holder : h_->holders) {
    if (holder.key == 0) continue;
    if (holder.key == key && !counted) {
      counted = true;
      if (holder.refs > 0) holder.refs -= 1;
      if (holder.refs == 0) holder.key = 0;
      else others = true;
      continue;
    }
    bool alive = holder.foreign != 0 || holder_alive(holder.key);
    if (alive) {
      others |= holder.refs > 0;
      continue;
    }
    *reaped += holder.refs;  // a process that died holding the ring: reclaim its share
    holder.refs = 0;
    store_fence();
    holder.key = 0;
  }
  if (!counted && h_->untracked.load(std::memory_order_acquire) > 0) {
    h_->untracked.fetch_sub(1, std::memory_order_acq_rel);
  }
  return !others && h_->inflight.load(std::memory_order_acquire) == 0 &&
         h_->untracked.load(std::memory_order_acquire) == 0;
}

void Ring::share_holder() { h_->inflight.fetch_add(1, std::memory_order_acq_rel); }

void Ring::adopt_shared_holder() {
  add_holders(1);
  h_->inflight.fetch_sub(1, std::memory_order_acq_rel);
}

std::vector<Ring::HolderInfo> Ring::holder_table() {
  lock(Deadline(-1), false);
  Held held{this};
  std::vector<HolderInfo> out;
  for (const RingHolder& holder : h_->holders) {
    if (holder.key == 0) continue;
    out.push_back(HolderInfo{static_cast<int64_t>(holder.key >> 32), holder.refs,
                             holder.foreign != 0 || holder_alive(holder.key)});
  }
  return out;
}

int64_t Ring::holders() {
  lock(Deadline(-1), false);
  Held held{this};
  int64_t n = h_->inflight.load(std::memory_order_acquire) +
              h_->untracked.load(std::memory_order_acquire);
  for (const RingHolder& holder : h_->holders) {
    if (holder.key != 0) n += holder.refs;
  }
  return n;
}

}  // namespace torch_mp_ext
