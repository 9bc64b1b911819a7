// Which processes hold a piece of shared memory, and taking back what dead ones held
// (Note [Holder tables]).
//
// Note [Holder tables]
// Every shared structure that must outlive a SIGKILL records who holds it in a holder table:
// fixed slots, each one 64-bit atomic word, in the shared memory itself. The tables of the
// core are all this one type: a segment's holders (Note [Holder table] in shm/layout.h; their
// blocks, Note [Dead holders]), a queue ring's holders (Note [Ring holders]), a latest-value
// channel's readers and its writer word (Note [Latest-value channel]) and a counter slot's
// holder (Note [Counter files]). What a slot stands for (block bits, a ring's refs, a pinned
// buffer) lives beside it in the owner's layout; the protocol below is the same everywhere.
//
//   word == 0                       free
//   word == key [| FOREIGN]         held by the process `key` (Note [Process identity]:
//                                   pid << 32 | start time); FOREIGN: it lives in another pid
//                                   namespace than the table's home (the creator's)
//   word == REAPING | reaper key    the holder died; `reaper` is taking back what it held
//
// claim:    CAS 0 -> key. The only way into a slot, so two claimants never share one.
// release:  CAS key -> 0, by the holder itself.
// reap:     a survivor that judges the word's process dead (the holder, or a reaper of it)
//           CASes word -> REAPING | itself, takes back what the slot stands for, then CASes
//           REAPING | itself -> 0. Only the CAS winner works on the slot, and a second reaper
//           only ever takes over from a dead one.
//
// Invariants, with a process killed at any instruction:
// - Judging. A process is dead when process_alive() says so for its key: gone, a zombie, or
//   its pid reused by a process with another start time. A word is only judged by a process
//   of the table's home namespace, and never when it is FOREIGN (a pid from another namespace
//   means nothing here): those count as alive, forever. Undecidable means alive (it leaks,
//   never frees what a live process uses).
// - Claiming and releasing. What a slot stands for is counted before the claim is published
//   and dropped after its release (the slot's word is the commit point). So a death between
//   the two leaks what the slot would have stood for; it never frees something still used.
//   A death right after the claim leaves a slot held by a dead key: reaped like any other.
// - Reaping. Taking back is idempotent per slot (an atomic AND on block bits, a refs field
//   zeroed under the ring's robust mutex, a pin cleared): a reaper killed mid-way leaves
//   REAPING | its own key, whose process is now dead, so the next reaper takes over and
//   finishes. A REAPING word holds nothing alive: "is anyone still holding this?" skips it.
// - Full. A table has a fixed number of slots; a process that finds none free is not
//   tracked (each owner says what that costs it: counted apart, or leaked at worst).
// The crash-consistency work builds on these words; keep them the only state of a slot that
// another process may act on.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace torch_mp_ext {

/// The slot is being reaped; the rest of the word is the reaper's key.
constexpr uint64_t HOLDER_REAPING = uint64_t{1} << 63;
/// The holder lives in another pid namespace than the table's home: never judged.
constexpr uint64_t HOLDER_FOREIGN = uint64_t{1} << 62;
constexpr uint64_t HOLDER_FLAGS = HOLDER_REAPING | HOLDER_FOREIGN;

/// True when the process a slot word names can be told dead from here (Note [Holder tables]):
/// `word` is not free, not FOREIGN, this process is in `home_ns`, and process_alive() is false.
bool holder_word_dead(uint64_t word, uint64_t home_ns);

/// This process's word in a table whose home pid namespace is `home_ns`.
uint64_t holder_word_of_self(uint64_t home_ns);

/// One slot of a holder table, in shared memory (8 bytes, lock-free).
class HolderSlot {
 public:
  /// Creator only: marks the slot free.
  void clear() noexcept { word_.store(0, std::memory_order_relaxed); }
  uint64_t word() const noexcept { return word_.load(std::memory_order_seq_cst); }
  bool free() const noexcept { return word() == 0; }
  /// The process key the word names, without its flags; 0 when free.
  uint64_t key() const noexcept { return word() & ~HOLDER_FLAGS; }

  /// Takes the slot for `me` if it is free.
  bool claim(uint64_t me) noexcept;
  /// Gives the slot back if `me` holds it.
  bool release(uint64_t me) noexcept;
  /// For slots handed out by other means (a counter slot from its free list): records the
  /// holder, or clears it with 0.
  void set(uint64_t word) noexcept { word_.store(word, std::memory_order_seq_cst); }

  /// The word's process is known dead (holder_word_dead).
  bool dead(uint64_t home_ns) const { return holder_word_dead(word(), home_ns); }
  /// Held by a process that may be alive (not free, not being reaped, not known dead).
  bool held_alive(uint64_t home_ns) const;
  /// If the word's process is dead, makes the slot REAPING | `reaper` (this process's key):
  /// true if this call won it; the caller then takes back what the slot stands for and
  /// calls end_reap().
  bool begin_reap(uint64_t home_ns, uint64_t reaper);
  /// begin_reap for a word the caller already judged dead, outside any lock (a dead word never
  /// lives again: it names the process's start time): true if this call won the slot.
  bool begin_reap_judged(uint64_t dead_word, uint64_t reaper) noexcept {
    return word_.compare_exchange_strong(dead_word, HOLDER_REAPING | reaper,
                                         std::memory_order_seq_cst);
  }
  /// Frees a slot this process was reaping.
  void end_reap(uint64_t reaper) noexcept;

 private:
  std::atomic<uint64_t> word_{0};
};

static_assert(sizeof(HolderSlot) == 8, "HolderSlot is part of the shared layouts");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

/// A view of `count` slots spaced `stride` bytes apart (the slots may sit inside bigger
/// per-holder records) of a table whose home pid namespace is `home_ns`. Owns nothing.
class HolderTable {
 public:
  HolderTable(HolderSlot* first, size_t count, size_t stride, uint64_t home_ns)
      : first_(reinterpret_cast<char*>(first)), count_(count), stride_(stride),
        home_ns_(home_ns) {}
  /// The table of `rows[i].*slot`.
  template <typename Row>
  HolderTable(Row* rows, size_t count, HolderSlot Row::*slot, uint64_t home_ns)
      : HolderTable(&(rows->*slot), count, sizeof(Row), home_ns) {}

  size_t size() const { return count_; }
  HolderSlot& operator[](size_t i) const {
    return *reinterpret_cast<HolderSlot*>(first_ + i * stride_);
  }
  uint64_t home_ns() const { return home_ns_; }
  /// This process's word in this table.
  uint64_t self() const { return holder_word_of_self(home_ns_); }
  /// This process can judge the table's holders (it lives in the home namespace).
  bool can_judge() const;

  /// Claims a free slot for this process: its index, or -1 when the table is full.
  int claim() const;
  /// The slot this process holds, or -1.
  int find() const;
  /// True if a slot other than `except` (a word) may be held by a live process; always
  /// true for a caller that cannot judge.
  bool any_alive(uint64_t except = 0) const {
    return any_alive_where([except](const HolderSlot& slot) { return slot.word() != except; });
  }
  /// any_alive, counting only the live slots for which `counts(slot)` is true.
  template <typename Counts>
  bool any_alive_where(Counts&& counts) const {
    if (!can_judge()) return true;
    for (size_t i = 0; i < count_; ++i) {
      const HolderSlot& slot = (*this)[i];
      if (slot.held_alive(home_ns_) && counts(slot)) return true;
    }
    return false;
  }
  /// reap() with the verdicts of `dead(word)` (a caller that judges many tables at once
  /// asks each process once: Note [Reclaiming off the allocation path] in shm/arena.h).
  template <typename Dead, typename TakeBack>
  size_t reap_judged(Dead&& dead, TakeBack&& take_back) const {
    if (!can_judge()) return 0;
    const uint64_t me = self();
    size_t reaped = 0;
    for (size_t i = 0; i < count_; ++i) {
      HolderSlot& slot = (*this)[i];
      uint64_t word = slot.word();
      if (word == 0 || (word & HOLDER_FLAGS) || !dead(word)) continue;
      if (!slot.begin_reap_judged(word, me)) continue;
      take_back(i);
      slot.end_reap(me);
      ++reaped;
    }
    return reaped;
  }
  /// Reaps every slot whose process is dead: `take_back(i)` runs between begin_reap and
  /// end_reap of slot i. Returns the slots reaped (0 for a caller that cannot judge).
  template <typename TakeBack>
  size_t reap(TakeBack&& take_back) const {
    if (!can_judge()) return 0;
    const uint64_t me = self();
    size_t reaped = 0;
    for (size_t i = 0; i < count_; ++i) {
      HolderSlot& slot = (*this)[i];
      if (!slot.begin_reap(home_ns_, me)) continue;
      take_back(i);
      slot.end_reap(me);
      ++reaped;
    }
    return reaped;
  }

 private:
  char* first_;
  size_t count_;
  size_t stride_;
  uint64_t home_ns_;
};

}  // namespace torch_mp_ext
