// Who holds a ring, and reclaiming what dead holders held (Note [Ring holders]).
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

bool Ring::remove_holder(uint32_t* reaped) {
  *reaped = 0;
  lock(Deadline(-1), false);
  Held held{this};
  HolderTable table = holders_of(h_);
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
  table.reap([&](size_t i) {
    *reaped += h_->holders[i].refs;
    h_->holders[i].refs = 0;
    store_fence();
  });
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

std::vector<Ring::HolderInfo> Ring::holder_table() {
  lock(Deadline(-1), false);
  Held held{this};
  std::vector<HolderInfo> out;
  for (const RingHolder& holder : h_->holders) {
    if (holder.key.free()) continue;
    out.push_back(HolderInfo{key_pid(holder.key.key()), holder.refs,
                             !holder.key.dead(h_->pidns)});
  }
  return out;
}

int64_t Ring::holders() {
  lock(Deadline(-1), false);
  Held held{this};
  int64_t n = h_->inflight.load(std::memory_order_acquire) +
              h_->untracked.load(std::memory_order_acquire);
  for (const RingHolder& holder : h_->holders) {
    if (!holder.key.free()) n += holder.refs;
  }
  return n;
}

}  // namespace torch_mp_ext
