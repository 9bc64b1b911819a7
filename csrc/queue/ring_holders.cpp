// Who holds a ring, and reclaiming what dead holders held (Note [Ring holders]).
#include <utility>
#include <vector>

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
    if (lock(deadline, false) != Lock::Ok) return std::nullopt;
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
  if (lock(deadline, false) != Lock::Ok) return std::nullopt;
  Held held{this};
  int64_t n = h_->inflight.load(std::memory_order_acquire) +
              h_->untracked.load(std::memory_order_acquire);
  for (const RingHolder& holder : h_->holders) {
    if (!holder.key.free()) n += holder.refs;
  }
  return n;
}

}  // namespace torch_mp_ext
