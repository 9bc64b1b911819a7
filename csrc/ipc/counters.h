// Counter files: shared slots of atomic counts, the keep-alive primitive for CUDA IPC.
//
// Note [Counter files]
// A counter file is a named segment of kind Counters: the same header, holder table and
// BlockSlot table as an arena segment, with no data blocks. A slot stands for one reference
// lent to another process: its count, the holder key of the process that received it, and a
// tag naming what it keeps alive (the lender's id of a CUDA block). Any process acquires a
// slot (the free list is a tagged Treiber stack, safe for many poppers): the lender for each
// send, and a receiver forwarding what it received (a new slot in the *original* lender's
// file, with the same tag). The receiver claims the slot (records itself as holder), and
// decrements it when its storage dies. The holder field is a holder-table slot (Note [Holder
// tables]) that comes with the counter slot instead of being claimed from a free pool; only
// the owner judges it, and reaps it in collect() by recycling the counter slot. Unlike arena
// blocks, a slot reaching zero is not freed by whoever got it there: only the owner recycles
// slots, in collect(), so a slot is never reused while its old count still means something
// (generations catch stale handles).
//
// Note [Counter snapshots]
// collect() answers "which tags are still referenced?" for the owner. Reading the slots one
// by one is not a snapshot: a forwarder may tag a new slot the scan already passed and then
// release its old slot before the scan reaches it, and the tag would look dead. So collect()
// reads every slot twice and trusts the reading only if both passes agree on every field.
// Between two recycles each field changes at most once or monotonically (tag, holder and the
// initial count are set once, then the count only decreases) and acquiring bumps
// `generation`, so two equal readings mean every slot held those values at the instant
// between the passes: a true snapshot. A slot being acquired gets its count before its tag
// (the generation last): were the tag first, a snapshot taken in between would see a tagged
// slot with a count of 0, take it for released and recycle it under its acquirer, which would
// then share it with the next one (and a tag would be reported dead while referenced). A tag
// is dead if no slot carrying it is still counted; a dead tag stays dead, because only a
// process holding a live slot of a tag may acquire another one for it. If the passes keep
// disagreeing (heavy churn), collect() reports `stable = false` and recycles nothing; the
// caller tries again later.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shm/segment.h"

namespace torch_mp_ext {

/// What CounterFile::collect() found.
struct CounterCollect {
  bool stable = false;                ///< false: the slots kept changing; nothing recycled
  /// Tags whose last counted slot was recycled by this call (sorted, unique): what they kept
  /// alive may go now. A tag that still has a counted slot is never listed.
  std::vector<uint64_t> dead_tags;
  /// (slot, holder key, tag) of counted slots whose holder is dead: reclaimed and recycled.
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> reclaimed;
  uint32_t recycled = 0;              ///< slots returned to the free list (reclaimed included)
};

class CounterFile {
 public:
  /// A new named counter file with `nslots` slots, owned by this process.
  static std::shared_ptr<CounterFile> create(uint32_t nslots);
  /// Opens an existing counter file by name (any process).
  static std::shared_ptr<CounterFile> open(const std::string& name, uint64_t segment_id);
  ~CounterFile();

  /// Any process: takes a free slot, sets its tag and count; false when every slot is in use.
  /// Tag 0 means untagged: collect() neither reports nor recycles such slots.
  bool acquire(int64_t initial, uint64_t tag, uint32_t* slot, uint32_t* generation);
  /// Owner: returns a slot to the free list (its count should be zero by now).
  void recycle(uint32_t slot);
  /// Adds `delta` to a slot's count; returns the new count.
  int64_t add(uint32_t slot, int64_t delta);
  int64_t value(uint32_t slot) const;
  uint32_t generation(uint32_t slot) const;
  uint64_t tag(uint32_t slot) const;
  /// Records the process holding a slot (0 clears it); holder_alive() checks it.
  void set_holder(uint32_t slot, uint64_t key);
  uint64_t holder(uint32_t slot) const;
  bool holder_alive(uint32_t slot) const;
  /// Receiver: false if the slot is no longer of `generation` (a stale handle); else records
  /// this process as its holder -- unless this process is in another pid namespace than the
  /// owner, whose liveness the owner cannot judge (the slot then stays unclaimed: never
  /// reclaimed, only released).
  bool claim(uint32_t slot, uint32_t generation);
  /// Owner: Note [Counter snapshots]. Recycles the slots whose count reached zero, and, with
  /// `check_holders`, reclaims (recycles) counted slots whose holder died.
  CounterCollect collect(bool check_holders, int attempts = 8);
  /// (slot, tag, count, holder) of every tagged slot still counted (for reports; not atomic).
  std::vector<std::tuple<uint32_t, uint64_t, int64_t, uint64_t>> counted_slots() const;

  uint32_t capacity() const { return mapping_->nblocks(); }
  uint32_t in_use() const;
  const std::string& name() const { return mapping_->name(); }
  uint64_t segment_id() const { return mapping_->id(); }
  /// Holder key (pid << 32 | start time) of the process that created the file.
  uint64_t owner_key() const { return mapping_->header()->owner_key; }
  bool owner() const { return owner_; }
  /// Removes the name now (the owner, when every slot is back); idempotent.
  bool unlink();

 private:
  CounterFile(std::shared_ptr<Mapping> mapping, bool owner);
  void check_slot(uint32_t slot) const;

  std::shared_ptr<Mapping> mapping_;
  bool owner_;
};

}  // namespace torch_mp_ext
