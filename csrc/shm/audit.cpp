// A debug audit of the shared bookkeeping this process can see (Note [Audit]).
//
// Note [Audit]
// What must hold in every segment whatever process died at whatever instruction, checked by
// Registry::audit() (the crash tests call it after every kill, through _C.audit()):
//   1. A block this process references (a live BlockRef) has the generation it had when the
//      reference was adopted, and a refcount of at least 1: it was never freed (and perhaps
//      reused, aliasing another tensor or another queue's ring) while referenced here.
//   2. The free stack of an arena segment is a chain of distinct blocks of the segment; a
//      block on it has refcount 0 and no holder bit; `live_blocks` counts the others.
//   3. A block's refcount is at least the number of holder bits set on it (each bit is one
//      counted reference, Note [Dead holders]); over the segment, references not marked by a
//      bit are exactly the handles in flight (`inflight`), so nothing was dropped twice and
//      nothing leaked (holders beyond the 128-slot table are the one blind spot). A process
//      killed inside a count-then-mark window leaks one reference: reported prefixed
//      "leak: " (wasted memory until the owner exits, never a block freed under a user).
//   4. This process's bit on a block is set iff it holds the block (its local count).
//   5. With `reclaimed` (after the survivors' repair): no dead process keeps a holder bit.
// Other processes may change the counts while the audit reads them: call it when they are
// idle (the tests do), or expect transient reports.
#include <bitset>
#include <sstream>

#include "platform/process.h"
#include "shm/registry.h"

namespace torch_mp_ext {

namespace {

int popcount(const HolderMask& mask) {
  int n = 0;
  for (const auto& word : mask.bits) n += static_cast<int>(std::bitset<64>(word.load()).count());
  return n;
}

std::string where(const Mapping& m, uint32_t index) {
  std::ostringstream s;
  s << "block " << index << " of segment " << m.id();
  if (!m.name().empty()) s << " (" << m.name() << ")";
  return s.str();
}

}  // namespace

std::vector<std::string> Registry::audit(bool reclaimed) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  auto report = [&out](const std::string& what) { out.push_back(what); };
  for (BlockRef* ref = refs_; ref != nullptr; ref = ref->next_) {  // 1.
    BlockSlot& slot = ref->mapping_->slots()[ref->index_];
    uint32_t generation = slot.generation.load(std::memory_order_acquire);
    int64_t count = slot.refcount.load(std::memory_order_acquire);
    if (generation != ref->adopted_generation_) {
      report(where(*ref->mapping_, ref->index_) + " is referenced here at generation " +
             std::to_string(ref->adopted_generation_) + " but was freed and reused (now " +
             std::to_string(generation) + ")");
    } else if (count < 1) {
      report(where(*ref->mapping_, ref->index_) + " is referenced here but its refcount is " +
             std::to_string(count));
    }
  }
  if (released_) return out;
  for (auto& [id, mapping] : by_id_) {
    Mapping& m = *mapping;
    SegmentHeader* h = m.header();
    if (h->kind != static_cast<uint32_t>(SegmentKind::Arena)) continue;
    uint32_t n = m.nblocks();
    BlockSlot* slots = m.slots();
    HolderMask* masks = m.masks();
    bool pooled = (h->flags.load(std::memory_order_acquire) & FLAG_FREE_ON_ZERO) != 0;
    std::vector<char> is_free(n, 0);
    if (pooled) {  // 2.
      uint32_t free_count = 0;
      uint32_t i = static_cast<uint32_t>(h->free_head.load(std::memory_order_acquire));
      while (i != NO_BLOCK) {
        if (i >= n || is_free[i]) {
          report("segment " + std::to_string(id) + ": free stack is corrupt at block " +
                 std::to_string(i));
          break;
        }
        is_free[i] = 1;
        ++free_count;
        int64_t count = slots[i].refcount.load(std::memory_order_acquire);
        if (count != 0) {
          report(where(m, i) + " is on the free stack with refcount " + std::to_string(count));
        }
        if (masks != nullptr && popcount(masks[i]) != 0) {
          report(where(m, i) + " is on the free stack but a process holds it");
        }
        i = slots[i].next.load(std::memory_order_acquire);
      }
      uint32_t live = h->live_blocks.load(std::memory_order_acquire);
      if (live + free_count != n) {
        report("segment " + std::to_string(id) + ": " + std::to_string(live) +
               " live blocks + " + std::to_string(free_count) + " free != " +
               std::to_string(n) + " blocks");
      }
    }
    if (masks == nullptr) continue;
    int64_t unmarked = 0;
    std::string unmarked_blocks;
    for (uint32_t i = 0; i < n; ++i) {  // 3. and 4.
      if (is_free[i]) continue;
      int64_t count = slots[i].refcount.load(std::memory_order_acquire);
      int bits = popcount(masks[i]);
      if (count < bits) {
        report(where(m, i) + " has refcount " + std::to_string(count) + " but " +
               std::to_string(bits) + " processes hold it: a reference was dropped twice");
      }
      unmarked += count - bits;
      if (count > bits && unmarked_blocks.size() < 200) {
        unmarked_blocks += " " + std::to_string(i) + ":" + std::to_string(count) + "/" +
                           std::to_string(bits);
      }
      if (m.holder_index >= 0) {
        int slot = m.holder_index;
        bool mine = (masks[i].bits[slot / 64].load() >> (slot % 64)) & 1;
        bool held = i < m.local_counts.size() && m.local_counts[i] > 0;
        if (mine != held) {
          report(where(m, i) + (held ? " is held here without this process's holder bit"
                                     : " carries this process's holder bit but is not held"));
        }
      }
    }
    int64_t inflight = h->inflight.load(std::memory_order_acquire);
    if (pooled && unmarked != inflight) {
      // More than in flight: a process died between counting a reference and marking it
      // (or between unmarking and dropping it): leaked, never freed early (Note [Dead
      // holders]). Fewer: something was dropped that nobody marked: corruption.
      report(std::string(unmarked > inflight ? "leak: " : "") + "segment " +
             std::to_string(id) + ": " + std::to_string(unmarked) +
             " references held by no registered process, but " + std::to_string(inflight) +
             " handles in flight (block:refcount/holders" + unmarked_blocks + ")");
    }
    if (!reclaimed) continue;
    for (size_t slot = 0; slot < MAX_HOLDERS; ++slot) {  // 5.
      if (!h->holders[slot].dead(h->pidns)) continue;
      for (uint32_t i = 0; i < n; ++i) {
        if ((masks[i].bits[slot / 64].load() >> (slot % 64)) & 1) {
          report(where(m, i) + " is still held by dead process " +
                 std::to_string(h->holders[slot].key() >> 32));
        }
      }
    }
  }
  return out;
}

}  // namespace torch_mp_ext
