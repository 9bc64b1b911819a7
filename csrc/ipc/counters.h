// Counter files: shared slots of atomic counts, the keep-alive primitive for CUDA IPC.
//
// Note [Counter files]
// A counter file is a named segment of kind Counters: the same header, holder table and
// BlockSlot table as an arena segment, with no data blocks. Its creator (a producer) acquires a
// slot per thing it lends out, sets the count, and sends (file name, slot, generation); any
// process opens the file by name and adjusts the count. Unlike arena blocks, a slot reaching
// zero is not freed by whoever got it there: the owner polls, releases what the slot kept
// alive, and only then recycles the slot, so a slot is never reused while its old count still
// means something. A receiver may record itself as the slot's holder; a slot whose holder died
// can then be reclaimed by the owner.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shm/segment.h"

namespace torch_mp_ext {

class CounterFile {
 public:
  /// A new named counter file with `nslots` slots, owned by this process.
  static std::shared_ptr<CounterFile> create(uint32_t nslots);
  /// Opens an existing counter file by name (any process).
  static std::shared_ptr<CounterFile> open(const std::string& name, uint64_t segment_id);
  ~CounterFile();

  /// Owner: takes a free slot and sets its count; false when every slot is in use.
  bool acquire(int64_t initial, uint32_t* slot, uint32_t* generation);
  /// Owner: returns a slot to the free list (its count should be zero by now).
  void recycle(uint32_t slot);
  /// Adds `delta` to a slot's count; returns the new count.
  int64_t add(uint32_t slot, int64_t delta);
  int64_t value(uint32_t slot) const;
  uint32_t generation(uint32_t slot) const;
  /// Records the process holding a slot (0 clears it); holder_alive() checks it.
  void set_holder(uint32_t slot, uint64_t key);
  uint64_t holder(uint32_t slot) const;
  bool holder_alive(uint32_t slot) const;

  uint32_t capacity() const { return mapping_->nblocks(); }
  uint32_t in_use() const;
  const std::string& name() const { return mapping_->name(); }
  uint64_t segment_id() const { return mapping_->id(); }
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
