#include "ipc/counters.h"

#include "common/check.h"
#include "platform/process.h"

namespace torch_mp_ext {

CounterFile::CounterFile(std::shared_ptr<Mapping> mapping, bool owner)
    : mapping_(std::move(mapping)), owner_(owner) {}

CounterFile::~CounterFile() {
  if (mapping_->holder_registered) holder_deregister(mapping_->header(), self_key());
}

std::shared_ptr<CounterFile> CounterFile::create(uint32_t nslots) {
  TMX_CHECK_VALUE(nslots > 0, "a counter file needs at least one slot");
  SegmentSpec spec;
  spec.kind = SegmentKind::Counters;
  spec.block_size = 0;
  spec.nblocks = nslots;
  spec.named = true;
  spec.flags = 0;
  return std::shared_ptr<CounterFile>(new CounterFile(create_segment(spec), true));
}

std::shared_ptr<CounterFile> CounterFile::open(const std::string& name, uint64_t segment_id) {
  auto mapping = open_named_segment(name, segment_id);
  if (mapping->header()->kind != static_cast<uint32_t>(SegmentKind::Counters)) {
    throw CorruptSegmentError("shared memory segment /dev/shm" + name +
                              " is not a counter file");
  }
  return std::shared_ptr<CounterFile>(new CounterFile(std::move(mapping), false));
}

void CounterFile::check_slot(uint32_t slot) const {
  TMX_CHECK_VALUE(slot < capacity(), "counter slot ", slot, " out of range (file has ",
                  capacity(), " slots)");
}

bool CounterFile::acquire(int64_t initial, uint32_t* slot, uint32_t* generation) {
  TMX_CHECK_VALUE(owner_, "only the process that created a counter file acquires its slots");
  uint32_t index = free_pop(mapping_->header());
  if (index == NO_BLOCK) return false;
  BlockSlot& s = mapping_->slots()[index];
  *generation = s.generation.fetch_add(1, std::memory_order_acq_rel) + 1;
  s.holder.store(0, std::memory_order_relaxed);
  s.refcount.store(initial, std::memory_order_release);
  mapping_->header()->live_blocks.fetch_add(1, std::memory_order_acq_rel);
  *slot = index;
  return true;
}

void CounterFile::recycle(uint32_t slot) {
  check_slot(slot);
  TMX_CHECK_VALUE(owner_, "only the process that created a counter file recycles its slots");
  mapping_->slots()[slot].holder.store(0, std::memory_order_relaxed);
  free_push(mapping_->header(), slot);
  mapping_->header()->live_blocks.fetch_sub(1, std::memory_order_acq_rel);
}

int64_t CounterFile::add(uint32_t slot, int64_t delta) {
  check_slot(slot);
  return mapping_->slots()[slot].refcount.fetch_add(delta, std::memory_order_acq_rel) + delta;
}

int64_t CounterFile::value(uint32_t slot) const {
  check_slot(slot);
  return mapping_->slots()[slot].refcount.load(std::memory_order_acquire);
}

uint32_t CounterFile::generation(uint32_t slot) const {
  check_slot(slot);
  return mapping_->slots()[slot].generation.load(std::memory_order_acquire);
}

void CounterFile::set_holder(uint32_t slot, uint64_t key) {
  check_slot(slot);
  mapping_->slots()[slot].holder.store(key, std::memory_order_release);
}

uint64_t CounterFile::holder(uint32_t slot) const {
  check_slot(slot);
  return mapping_->slots()[slot].holder.load(std::memory_order_acquire);
}

bool CounterFile::holder_alive(uint32_t slot) const {
  uint64_t key = holder(slot);
  if (key == 0) return false;
  return process_alive(static_cast<pid_t>(key >> 32), static_cast<uint32_t>(key));
}

uint32_t CounterFile::in_use() const {
  return mapping_->header()->live_blocks.load(std::memory_order_acquire);
}

bool CounterFile::unlink() { return unlink_name(mapping_->name()); }

}  // namespace torch_mp_ext
