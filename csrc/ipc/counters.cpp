#include "ipc/counters.h"

#include <algorithm>

#include "common/check.h"
#include "platform/process.h"

namespace torch_mp_ext {

CounterFile::CounterFile(std::shared_ptr<Mapping> mapping, bool owner)
    : mapping_(std::move(mapping)), owner_(owner) {}

CounterFile::~CounterFile() {
  mapping_->deregister_holder();
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

bool CounterFile::acquire(int64_t initial, uint64_t tag, uint32_t* slot,
                          uint32_t* generation) {
  uint32_t index = free_pop(mapping_->header());
  if (index == NO_BLOCK) return false;
  BlockSlot& s = mapping_->slots()[index];
  // Holder and count, then the tag, the generation last (Note [Counter snapshots]): a slot
  // shows its tag only once it is counted.
  s.holder.set(0);
  s.refcount.store(initial, std::memory_order_release);
  s.tag.store(tag, std::memory_order_release);
  *generation = s.generation.fetch_add(1, std::memory_order_acq_rel) + 1;
  mapping_->header()->live_blocks.fetch_add(1, std::memory_order_acq_rel);
  *slot = index;
  return true;
}

void CounterFile::recycle(uint32_t slot) {
  check_slot(slot);
  TMX_CHECK_VALUE(owner_, "only the process that created a counter file recycles its slots");
  mapping_->slots()[slot].tag.store(0, std::memory_order_release);
  mapping_->slots()[slot].holder.set(0);
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

uint64_t CounterFile::tag(uint32_t slot) const {
  check_slot(slot);
  return mapping_->slots()[slot].tag.load(std::memory_order_acquire);
}

void CounterFile::set_holder(uint32_t slot, uint64_t key) {
  check_slot(slot);
  mapping_->slots()[slot].holder.set(key);
}

uint64_t CounterFile::holder(uint32_t slot) const {
  check_slot(slot);
  return mapping_->slots()[slot].holder.word();
}

bool CounterFile::holder_alive(uint32_t slot) const {
  check_slot(slot);
  return mapping_->slots()[slot].holder.held_alive(mapping_->header()->pidns);
}

bool CounterFile::claim(uint32_t slot, uint32_t generation) {
  check_slot(slot);
  BlockSlot& s = mapping_->slots()[slot];
  if (s.generation.load(std::memory_order_acquire) != generation) return false;
  if (mapping_->header()->pidns == self_pidns()) s.holder.set(self_key());
  return true;
}

namespace {

struct SlotReading {
  uint32_t generation;
  uint64_t tag;
  int64_t count;
  uint64_t holder;
  bool operator==(const SlotReading& o) const {
    return generation == o.generation && tag == o.tag && count == o.count && holder == o.holder;
  }
};

void read_slots(const BlockSlot* slots, uint32_t n, std::vector<SlotReading>* out) {
  out->resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    (*out)[i].generation = slots[i].generation.load(std::memory_order_seq_cst);
    (*out)[i].tag = slots[i].tag.load(std::memory_order_seq_cst);
    (*out)[i].count = slots[i].refcount.load(std::memory_order_seq_cst);
    (*out)[i].holder = slots[i].holder.word();
  }
}

}  // namespace

CounterCollect CounterFile::collect(bool check_holders, int attempts) {
  TMX_CHECK_VALUE(owner_, "only the process that created a counter file collects its slots");
  CounterCollect result;
  const uint32_t n = capacity();
  BlockSlot* slots = mapping_->slots();
  std::vector<SlotReading> first, second;
  read_slots(slots, n, &first);
  for (int attempt = 0; attempt < attempts; ++attempt) {
    read_slots(slots, n, &second);
    if (first == second) {
      result.stable = true;
      break;
    }
    first.swap(second);
  }
  if (!result.stable) return result;
  const uint64_t home_ns = mapping_->header()->pidns;
  std::vector<std::pair<uint64_t, bool>> dead_cache;  // few distinct holders: a flat list
  auto holder_is_dead = [&](uint64_t word) {
    for (const auto& [w, dead] : dead_cache) {
      if (w == word) return dead;
    }
    bool dead = holder_word_dead(word, home_ns);  // Note [Holder tables]
    dead_cache.emplace_back(word, dead);
    return dead;
  };
  std::vector<uint64_t> live_tags, recycled_tags;
  for (uint32_t i = 0; i < n; ++i) {
    const SlotReading& r = second[i];
    if (r.tag == 0) continue;  // free, or untagged (not ours to judge)
    if (r.count > 0) {
      if (!(check_holders && holder_is_dead(r.holder))) {
        live_tags.push_back(r.tag);
        continue;
      }
      result.reclaimed.emplace_back(i, r.holder, r.tag);
    }
    recycle(i);
    recycled_tags.push_back(r.tag);
    ++result.recycled;
  }
  std::sort(live_tags.begin(), live_tags.end());
  std::sort(recycled_tags.begin(), recycled_tags.end());
  recycled_tags.erase(std::unique(recycled_tags.begin(), recycled_tags.end()),
                      recycled_tags.end());
  for (uint64_t tag : recycled_tags) {
    if (!std::binary_search(live_tags.begin(), live_tags.end(), tag)) {
      result.dead_tags.push_back(tag);
    }
  }
  return result;
}

std::vector<std::tuple<uint32_t, uint64_t, int64_t, uint64_t>> CounterFile::counted_slots()
    const {
  std::vector<std::tuple<uint32_t, uint64_t, int64_t, uint64_t>> out;
  const BlockSlot* slots = mapping_->slots();
  for (uint32_t i = 0; i < capacity(); ++i) {
    uint64_t tag = slots[i].tag.load(std::memory_order_acquire);
    int64_t count = slots[i].refcount.load(std::memory_order_acquire);
    if (tag != 0 && count > 0) {
      out.emplace_back(i, tag, count, slots[i].holder.word());
    }
  }
  return out;
}

uint32_t CounterFile::in_use() const {
  return mapping_->header()->live_blocks.load(std::memory_order_acquire);
}

bool CounterFile::unlink() { return unlink_name(mapping_->name()); }

}  // namespace torch_mp_ext
