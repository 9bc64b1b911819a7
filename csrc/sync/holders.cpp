// The holder-table protocol (Note [Holder tables] in holders.h).
#include "sync/holders.h"

#include "platform/process.h"

namespace torch_mp_ext {

bool holder_word_dead(uint64_t word, uint64_t home_ns) {
  if (word == 0 || (word & HOLDER_FOREIGN) != 0) return false;
  if (self_pidns() != home_ns) return false;  // its pids are not ours to read
  return !key_alive(word & ~HOLDER_FLAGS);
}

uint64_t holder_word_of_self(uint64_t home_ns) {
  return self_key() | (self_pidns() == home_ns ? 0 : HOLDER_FOREIGN);
}

bool HolderSlot::claim(uint64_t me) noexcept {
  uint64_t expected = 0;
  return word_.load(std::memory_order_relaxed) == 0 &&
         word_.compare_exchange_strong(expected, me, std::memory_order_seq_cst);
}

bool HolderSlot::release(uint64_t me) noexcept {
  uint64_t expected = me;
  return word_.compare_exchange_strong(expected, 0, std::memory_order_seq_cst);
}

bool HolderSlot::held_alive(uint64_t home_ns) const {
  uint64_t w = word();
  return w != 0 && (w & HOLDER_REAPING) == 0 && !holder_word_dead(w, home_ns);
}

bool HolderSlot::begin_reap(uint64_t home_ns, uint64_t reaper) {
  uint64_t w = word();
  // Never this process's own slot, nor one this process is reaping (another thread of it).
  if (w == 0 || (w & ~HOLDER_FLAGS) == (reaper & ~HOLDER_FLAGS)) return false;
  if (!holder_word_dead(w, home_ns)) return false;
  return word_.compare_exchange_strong(w, HOLDER_REAPING | reaper, std::memory_order_seq_cst);
}

void HolderSlot::end_reap(uint64_t reaper) noexcept {
  uint64_t expected = HOLDER_REAPING | reaper;
  word_.compare_exchange_strong(expected, 0, std::memory_order_seq_cst);
}

bool HolderTable::can_judge() const { return self_pidns() == home_ns_; }

int HolderTable::claim() const {
  const uint64_t me = self();
  for (size_t i = 0; i < count_; ++i) {
    if ((*this)[i].claim(me)) return static_cast<int>(i);
  }
  return -1;
}

int HolderTable::find() const {
  const uint64_t me = self();
  for (size_t i = 0; i < count_; ++i) {
    if ((*this)[i].word() == me) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace torch_mp_ext
