// The layout of every shared-memory segment torch_mp_ext creates.
//
// Note [Segment layout]
// A segment is one mapping, shared by every process that received a handle to it:
//
//   offset 0            SegmentHeader   magic, version, identity, owner, flags, free stack,
//                                       name, holder table                 (fixed size)
//   slots_offset()      BlockSlot[n]    per-block refcount, free-stack link, generation
//   data_offset         block 0 | block 1 | ... | block n-1   (block_size bytes each,
//                                       page aligned start, 64-byte aligned blocks)
//
// Everything another process can touch concurrently is a lock-free std::atomic (asserted
// below) at a fixed offset; nothing in the segment is a pointer (each process maps it at its
// own address). The header is written completely by the creator before any handle to the
// segment exists, so readers never see a half-initialised header. A reader validates magic,
// layout version, segment id and sizes before trusting anything else (CorruptSegmentError).
//
// Note [Block lifetime]
// A block's refcount counts references anywhere: each live BlockRef in any process holds one,
// and each handle in flight (pickled, not yet rebuilt) holds one. The creator sets it to 1 at
// allocation. Whoever takes it to zero, in whichever process, frees the block: for arena
// segments (FLAG_FREE_ON_ZERO) it pushes the block on the segment's lock-free free stack, where
// only the owner pops it again; for dedicated named segments (FLAG_UNLINK_ON_ZERO) it unlinks
// the name, so the memory goes away with the last mapping. Counter files (the CUDA keep-alive
// slots) set neither flag: their owner polls the counts and recycles slots itself.
//
// Note [Holder table]
// Every segment lists the processes that map it in a holder table (Note [Holder tables] in
// sync/holders.h: one word per process, its key), registered on map and released on unmap.
// When every registered holder is dead (pid gone, or reused by a process with another start
// time) the name can be unlinked by anyone, which is how names survive no SIGKILL: see
// reaper.h. The table's home is the creator's pid namespace (`pidns`); holders elsewhere are
// never judged.
// References held by handles in flight are counted apart (`inflight`): a name whose holders
// are all gone but which a pickled message still names is left alone (its sender may have
// exited normally after put()); one with no live holder and nothing in flight is garbage.
//
// Note [Dead holders]
// Arena segments also record which registered holder holds which block: a process holds at
// most one counted reference per block (its BlockRefs on one block share it), marked by its
// bit in the block's HolderMask. The bit is set after the reference is counted and cleared
// before it is dropped, so a process killed in between leaks one reference, never frees a
// block early. A reclaimer (the owner's reclaim thread after a pool ran dry: Note [Reclaiming off the
// allocation path] in arena.h; or empty_cache()) reaps the
// dead holders' slots (Note [Holder tables]: a second reclaimer only takes over from a dead
// one): for each, it clears the dead holder's bits one by one with an atomic AND (whoever
// clears a bit drops that one reference), then frees the slot. So a SIGKILLed receiver's
// tensors go back to the pool while their owner lives on.
//
// Note [Tickets]
// A handle in flight carries one counted reference, and it must be spent exactly once. Each
// arena block therefore counts its handles in flight as tickets (BlockSlot::tag, which only
// counter files use otherwise): BlockRef::share() adds one with the reference, and redeeming
// the handle (Registry::attach) or giving it back (Registry::release_handle) takes one with a
// floored compare-and-swap, after checking the block's generation. A handle with no ticket
// left (the same pickle loaded twice, or a record forged from a seen one) finds none and
// raises CorruptSegmentError: it can never drop a reference that someone else holds, which
// once put a block back on the free stack under a live tensor (issue 26). Allocation sets
// the count to 0 with the new generation. Tickets are counted, not named: with two handles
// to one block in flight, loading one twice spends the other's ticket, and that handle then
// raises and leaks its reference until the owner exits. That is the price; aliasing never is.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "sync/holders.h"

namespace torch_mp_ext {

constexpr uint64_t SEGMENT_MAGIC = 0x314d474553584d54ULL;  // "TMXSEGM1" little-endian
/// 3: holder words carry the flags of Note [Holder tables] (FOREIGN is new).
/// 4: arena blocks count their handles in flight (Note [Tickets]).
constexpr uint32_t LAYOUT_VERSION = 4;
/// Processes that can be registered as holders of one named segment (Note [Holder table]).
constexpr size_t MAX_HOLDERS = 128;
/// Bytes for a segment name, including the leading '/' and the terminating NUL.
constexpr size_t NAME_CAPACITY = 64;
/// Alignment of every block's first byte: enough for any dtype and for AVX-512 loads.
constexpr size_t BLOCK_ALIGNMENT = 64;
constexpr uint32_t NO_BLOCK = 0xffffffffu;

enum class SegmentKind : uint32_t { Arena = 1, Counters = 2 };

enum SegmentFlags : uint32_t {
  FLAG_NAMED = 1u << 0,           ///< has a name in /dev/shm (file_system strategy)
  FLAG_FREE_ON_ZERO = 1u << 1,    ///< a block whose refcount reaches 0 goes on the free stack
  FLAG_UNLINK_ON_ZERO = 1u << 2,  ///< block 0 reaching 0 unlinks the name (dedicated segments)
  FLAG_RETIRED = 1u << 3,         ///< the owner dropped the segment; idle mappings may go
};

struct BlockSlot {
  std::atomic<int64_t> refcount;
  std::atomic<uint32_t> next;        ///< free-stack link (index of the next free block)
  std::atomic<uint32_t> generation;  ///< bumped at each allocation; handles carry it
  HolderSlot holder;                 ///< counters only: the receiving process (its key)
  std::atomic<uint64_t> tag;  ///< counters: what the slot keeps alive (0: untagged); arena
                              ///< blocks: handles in flight (Note [Tickets])
};
static_assert(sizeof(BlockSlot) == 32, "BlockSlot is part of the shared layout");

/// Arena segments: which registered holders (bit i = holders[i]) hold a block.
struct HolderMask {
  std::atomic<uint64_t> bits[MAX_HOLDERS / 64];
};
static_assert(sizeof(HolderMask) == MAX_HOLDERS / 8, "HolderMask is part of the shared layout");

struct SegmentHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t kind;
  uint64_t segment_id;  ///< random; names the segment across processes
  uint64_t secret;      ///< random; required to fetch an anonymous segment's fd
  uint64_t total_size;  ///< bytes of the whole mapping
  uint64_t block_size;
  uint64_t data_offset;
  uint64_t masks_offset;  ///< HolderMask table (arena segments), 0 if none
  uint32_t nblocks;
  int32_t owner_pid;
  uint64_t owner_key;  ///< holder key of the creator
  uint64_t pidns;      ///< pid namespace of the creator
  std::atomic<uint32_t> flags;
  std::atomic<uint32_t> live_blocks;  ///< blocks allocated and not yet freed
  std::atomic<uint64_t> free_head;    ///< (tag << 32) | index of the first free block
  std::atomic<int64_t> inflight;      ///< references held by handles not yet rebuilt
  char name[NAME_CAPACITY];
  HolderSlot holders[MAX_HOLDERS];  ///< Note [Holder table]
};

static_assert(std::atomic<int64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

/// Offset of the BlockSlot table: right after the header, 64-byte aligned.
constexpr size_t slots_offset() {
  return (sizeof(SegmentHeader) + 63) & ~size_t{63};
}

inline BlockSlot* slots_of(SegmentHeader* h) {
  return reinterpret_cast<BlockSlot*>(reinterpret_cast<char*>(h) + slots_offset());
}

/// The segment's holder table (Note [Holder table]).
inline HolderTable holders_of(SegmentHeader* h) {
  return HolderTable(h->holders, MAX_HOLDERS, sizeof(HolderSlot), h->pidns);
}

inline void mask_set(HolderMask& mask, int holder) {
  mask.bits[holder / 64].fetch_or(uint64_t{1} << (holder % 64), std::memory_order_acq_rel);
}

/// Clears `holder`'s bit; true if this call cleared it (it was set).
inline bool mask_clear(HolderMask& mask, int holder) {
  uint64_t bit = uint64_t{1} << (holder % 64);
  return mask.bits[holder / 64].fetch_and(~bit, std::memory_order_acq_rel) & bit;
}

/// Note [Tickets]: an arena block's count of handles in flight.
inline std::atomic<uint64_t>& tickets_of(BlockSlot& slot) { return slot.tag; }

/// Takes one ticket; false when none is left (never below zero).
inline bool take_ticket(BlockSlot& slot) {
  auto& tickets = tickets_of(slot);
  uint64_t n = tickets.load(std::memory_order_acquire);
  while (n > 0) {
    if (tickets.compare_exchange_weak(n, n - 1, std::memory_order_acq_rel)) return true;
  }
  return false;
}

// ---- lock-free free stack (Treiber stack with an ABA tag) -------------------------------

inline uint64_t pack_head(uint32_t index, uint32_t tag) {
  return (static_cast<uint64_t>(tag) << 32) | index;
}

/// Pushes block `i`. Any process may push. A process killed mid-push loses at most block `i`
/// (it stays allocated-looking); the stack itself is never corrupted.
inline void free_push(SegmentHeader* h, uint32_t i) {
  BlockSlot* slots = slots_of(h);
  uint64_t old = h->free_head.load(std::memory_order_acquire);
  for (;;) {
    slots[i].next.store(static_cast<uint32_t>(old), std::memory_order_relaxed);
    uint64_t desired = pack_head(i, static_cast<uint32_t>(old >> 32) + 1);
    if (h->free_head.compare_exchange_weak(old, desired, std::memory_order_release,
                                           std::memory_order_acquire)) {
      return;
    }
  }
}

/// What free_pop returns when the stack names a block at or past `nblocks` (a peer wrote
/// garbage into the segment: Note [Geometry snapshot]); never a valid index.
constexpr uint32_t CORRUPT_BLOCK = NO_BLOCK - 1;

/// Pops a free block, or NO_BLOCK. Only the owner pops. `nblocks` is the caller's validated
/// copy of the segment's block count: an index at or past it is CORRUPT_BLOCK, never read.
inline uint32_t free_pop(SegmentHeader* h, uint32_t nblocks) {
  BlockSlot* slots = slots_of(h);
  uint64_t old = h->free_head.load(std::memory_order_acquire);
  for (;;) {
    uint32_t index = static_cast<uint32_t>(old);
    if (index == NO_BLOCK) return NO_BLOCK;
    if (index >= nblocks) return CORRUPT_BLOCK;
    uint32_t next = slots[index].next.load(std::memory_order_relaxed);
    uint64_t desired = pack_head(next, static_cast<uint32_t>(old >> 32) + 1);
    if (h->free_head.compare_exchange_weak(old, desired, std::memory_order_acq_rel,
                                           std::memory_order_acquire)) {
      return index;
    }
  }
}

}  // namespace torch_mp_ext
