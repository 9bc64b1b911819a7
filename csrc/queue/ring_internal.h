// The ring's shared layout and helpers, private to csrc/queue/ (Note [Ring layout]).
#pragma once

#include <atomic>
#include <cstdint>

#include "queue/ring.h"
#include "sync/holders.h"

namespace torch_mp_ext {

/// SIGKILLs this process if the test hook set_crash_point() chose `point`.
void maybe_crash(CrashPoint point);

struct RingHolder {
  HolderSlot key;  ///< the process holding the ring (Note [Holder tables]); free: no holder
  uint32_t refs;   ///< queue objects of that process holding it (each holds one block reference)
  uint32_t reserved;
};
static_assert(sizeof(RingHolder) == 16, "RingHolder is part of the shared layout");

struct RingHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t flags;
  uint64_t capacity;      ///< the initial (and smallest) data area
  uint64_t max_capacity;  ///< the data area mapped: what it may grow to (Note [Ring growth])
  uint64_t maxsize;
  uint64_t data_offset;
  int64_t spin_ns;
  uint64_t pidns;  ///< pid namespace of the creator: holders elsewhere are never judged
  std::atomic<int64_t> inflight;   ///< holders travelling in pickles, not yet opened
  std::atomic<int64_t> untracked;  ///< holders that found the table full (never reaped)
  std::atomic<uint64_t> recoveries;
  std::atomic<uint32_t> broken;
  std::atomic<uint32_t> journal_valid;
  std::atomic<uint64_t> doorbell;  ///< 0, or the key of the process owing a byte (Note [Doorbell])
  uint32_t in_dev_shm;  ///< pages come from /dev/shm (else memfd): picks the no-space hint
  uint32_t reserved1;
  SharedCondition not_empty;
  SharedCondition not_full;
  SharedCondition all_done;
  alignas(64) RobustMutex mutex;
  alignas(64) RingState state;
  RingState journal;
  RingHolder holders[MAX_RING_HOLDERS];  ///< guarded by the mutex (Note [Ring holders])
};

static_assert(std::atomic<int64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

/// Store order is what makes a death at any instruction safe (Note [Ring commit]).
inline void store_fence() { std::atomic_signal_fence(std::memory_order_seq_cst); }

/// The ring's holder table (Note [Ring holders]).
inline HolderTable holders_of(RingHeader* h) {
  return HolderTable(h->holders, MAX_RING_HOLDERS, &RingHolder::key, h->pidns);
}

/// Unlocks the ring's mutex on every exit path while `on`; wait_on() clears and sets it.
struct Ring::Held {
  Ring* ring;
  bool on = true;
  ~Held() {
    if (on) ring->h_->mutex.unlock_noexcept();
  }
  void release() {
    on = false;
    ring->unlock();
  }
};

}  // namespace torch_mp_ext
