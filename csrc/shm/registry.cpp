#include "shm/registry.h"

#include <pthread.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cerrno>
#include <cstring>

#include "common/check.h"
#include "ipc/fd_keeper.h"
#include "ipc/fd_server.h"
#include "platform/process.h"
#include "shm/arena.h"
#include "shm/session.h"
#include "shm/sigbus.h"
#include "shm/unmapper.h"

namespace torch_mp_ext {

namespace {

/// Idle anonymous mappings a process keeps (Note [fd budget]): re-mapping needs the owner.
constexpr size_t MAX_IDLE_MAPPINGS = 64;

std::atomic<uint64_t> g_underflows{0};

bool owner_gone(const SegmentHeader* h) {
  return holder_word_dead(h->owner_key, h->pidns);  // a reused pid is not the owner
}

bool pooled(const SegmentHeader* h) {
  return (h->flags.load(std::memory_order_acquire) & FLAG_FREE_ON_ZERO) != 0;
}

/// Crash cleanup for a named segment this process stops mapping (Note [Holder table]). A
/// dedicated segment's name is already gone once no block is referenced; a pooled one's goes
/// when no live process holds it (Note [Pooled names] in arena.h).
void maybe_reap_on_unmap(Mapping& m) {
  SegmentHeader* h = m.header();
  m.deregister_holder();
  if (h->inflight.load(std::memory_order_acquire) != 0) return;
  bool referenced = pooled(h);
  for (uint32_t i = 0; i < m.nblocks() && !referenced; ++i) {
    if (m.slots()[i].refcount.load(std::memory_order_acquire) > 0) referenced = true;
  }
  if (referenced && !holders_of(h).any_alive()) unlink_name(m.name());
}

/// The owner lets go of a pooled named segment: with no block live nothing can name it any
/// more (Note [Pooled names] in arena.h); with some, its holders' unmaps decide.
void unlink_if_free(Mapping& m) {
  SegmentHeader* h = m.header();
  if (m.named() && pooled(h) && h->live_blocks.load(std::memory_order_acquire) == 0 &&
      h->inflight.load(std::memory_order_acquire) == 0) {
    unlink_name(m.name());
  }
}

/// One handle in flight was redeemed. Never below zero: a handle redeemed twice (a pickle
/// loaded twice) must not make every later reaper believe a message is still in flight.
void drop_inflight(SegmentHeader* h) {
  int64_t n = h->inflight.load(std::memory_order_acquire);
  while (n > 0 && !h->inflight.compare_exchange_weak(n, n - 1, std::memory_order_acq_rel)) {
  }
}

}  // namespace

uint64_t refcount_underflows() { return g_underflows.load(); }

void decref_block(Mapping& mapping, uint32_t index) {
  SegmentHeader* h = mapping.header();
  BlockSlot& slot = mapping.slots()[index];
  int64_t left = slot.refcount.fetch_sub(1, std::memory_order_acq_rel) - 1;
  if (left > 0) return;
  if (left < 0) {  // a reference dropped twice: undo, count it, keep the block alive
    slot.refcount.fetch_add(1, std::memory_order_acq_rel);
    g_underflows.fetch_add(1);
    return;
  }
  uint32_t flags = h->flags.load(std::memory_order_acquire);
  if (flags & FLAG_UNLINK_ON_ZERO) unlink_name(mapping.name());
  if (flags & FLAG_FREE_ON_ZERO) {
    free_push(h, index);
    h->live_blocks.fetch_sub(1, std::memory_order_acq_rel);
  }
}

// ---- BlockRef --------------------------------------------------------------------------

BlockRef::BlockRef(std::shared_ptr<Mapping> mapping, uint32_t index)
    : mapping_(std::move(mapping)),
      index_(index),
      adopted_generation_(mapping_->slots()[index].generation.load(std::memory_order_acquire)) {}

BlockRef::~BlockRef() { release(); }

void BlockRef::release() {
  if (!live_) return;
  SigbusGuard guard;  // a truncated file must not kill a destructor (Note [Truncated under us])
  Registry::instance().on_release(this);
}

uint32_t BlockRef::generation() const {
  return mapping_->slots()[index_].generation.load(std::memory_order_acquire);
}

Handle BlockRef::share() const {
  TMX_CHECK_VALUE(live_, "this block was already released");
  SegmentHeader* h = mapping_->header();
  BlockSlot& slot = mapping_->slots()[index_];
  slot.refcount.fetch_add(1, std::memory_order_acq_rel);
  tickets_of(slot).fetch_add(1, std::memory_order_acq_rel);  // Note [Tickets]
  h->inflight.fetch_add(1, std::memory_order_acq_rel);
  Handle out;
  out.named = mapping_->named();
  out.segment_id = h->segment_id;
  out.secret = out.named ? 0 : h->secret;
  out.size = h->total_size;
  out.index = index_;
  out.generation = generation();
  out.owner_pid = h->owner_pid;
  // The name field is shared: never trust it to be NUL-terminated.
  out.location = out.named ? mapping_->name() : std::string(h->name, ::strnlen(h->name, NAME_CAPACITY));
  return out;
}

// ---- Registry --------------------------------------------------------------------------

Registry& Registry::instance() {
  static auto* registry = new Registry();  // leaked: BlockRefs may die during interpreter exit
  return *registry;
}

Registry::Registry() {
  ::pthread_atfork([] { Registry::instance().atfork_prepare(); },
                   [] { Registry::instance().atfork_parent(); },
                   [] { Registry::instance().atfork_child(); });
}

std::shared_ptr<Mapping> Registry::find_locked(uint64_t id) {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

std::shared_ptr<Mapping> Registry::insert_locked(std::shared_ptr<Mapping> mapping) {
  auto [it, inserted] = by_id_.emplace(mapping->id(), mapping);
  if (!inserted) return it->second;  // another thread mapped it first; ours is unmapped
  by_address_[reinterpret_cast<uintptr_t>(mapping->data_begin())] = mapping.get();
  return mapping;
}

// Erases this very mapping, never another one of the same segment id (issue 26: erasing by
// id alone could drop a live mapping that replaced it, and a later fork then over-dropped).
void Registry::erase_locked(const std::shared_ptr<Mapping>& mapping) {
  mapping->deregister_holder();
  idle_.remove(mapping);
  auto at = by_address_.find(reinterpret_cast<uintptr_t>(mapping->data_begin()));
  if (at != by_address_.end() && at->second == mapping.get()) by_address_.erase(at);
  auto it = by_id_.find(mapping->id());
  if (it != by_id_.end() && it->second == mapping) by_id_.erase(it);
}

void Registry::add_owned_locked(const std::shared_ptr<Mapping>& mapping) {
  mapping->owned = true;
  insert_locked(mapping);
}

void Registry::link_locked(BlockRef* ref) {
  ref->next_ = refs_;
  ref->prev_ = nullptr;
  if (refs_ != nullptr) refs_->prev_ = ref;
  refs_ = ref;
  ++live_refs_;
  if (ref->mapping_->local_refs++ == 0) idle_.remove(ref->mapping_);
}

void Registry::unlink_locked(BlockRef* ref) {
  if (ref->prev_ != nullptr) ref->prev_->next_ = ref->next_;
  if (ref->next_ != nullptr) ref->next_->prev_ = ref->prev_;
  if (refs_ == ref) refs_ = ref->next_;
  ref->prev_ = ref->next_ = nullptr;
  --live_refs_;
  --ref->mapping_->local_refs;
}

std::unique_ptr<BlockRef> Registry::adopt_locked(const std::shared_ptr<Mapping>& mapping,
                                                 uint32_t index, bool redeem) {
  auto ref = std::make_unique<BlockRef>(mapping, index);
  auto& counts = mapping->local_counts;
  if (counts.empty()) counts.assign(mapping->nblocks(), 0);
  TMX_CHECK(index < counts.size(), "block ", index, " of a ", counts.size(), "-block segment");
  // Note [Dead holders]: a handle's reference leaves `inflight` only now, after everything
  // that allocates, so that a death between that and the mark below is a few instructions.
  if (redeem) drop_inflight(mapping->header());
  if (counts[index]++ == 0) {
    HolderMask* masks = mapping->masks();
    if (masks != nullptr && mapping->holder_index >= 0) {
      mask_set(masks[index], mapping->holder_index);  // Note [Dead holders]: after counting
    }
  } else {
    decref_block(*mapping, index);  // this process already holds its one counted reference
  }
  link_locked(ref.get());
  return ref;
}

void Registry::drop_local_locked(Mapping& mapping, uint32_t index) {
  if (--mapping.local_counts[index] != 0) return;
  HolderMask* masks = mapping.masks();
  if (masks != nullptr && mapping.holder_index >= 0) {
    mask_clear(masks[index], mapping.holder_index);  // Note [Dead holders]: before dropping
  }
  decref_block(mapping, index);
}

void Registry::on_release(BlockRef* ref) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ref->live_) return;
  ref->live_ = false;
  if (released_) return;  // release_all() already dropped this process's references
  unlink_locked(ref);
  drop_local_locked(*ref->mapping_, ref->index_);
  maybe_unmap_locked(ref->mapping_);
}

size_t Registry::reclaim_locked(Mapping& mapping) {
  SegmentHeader* h = mapping.header();
  HolderMask* masks = mapping.masks();
  if (masks == nullptr) return 0;
  size_t reclaimed = 0;
  holders_of(h).reap([&](size_t slot) {  // Note [Dead holders]
    for (uint32_t i = 0; i < mapping.nblocks(); ++i) {
      if (mask_clear(masks[i], static_cast<int>(slot))) {
        decref_block(mapping, i);
        ++reclaimed;
      }
    }
  });
  return reclaimed;
}

size_t Registry::reclaim_segments(const std::vector<std::shared_ptr<Mapping>>& segments) {
  std::unordered_map<uint64_t, bool> verdicts;  // holder word -> dead
  size_t reclaimed = 0;
  SigbusGuard guard;  // a truncated file reads as zeros here (Note [Truncated under us])
  for (const auto& mapping : segments) {
    SegmentHeader* h = mapping->header();
    HolderMask* masks = mapping->masks();
    if (masks == nullptr) continue;
    const uint64_t home = h->pidns;
    auto dead = [&](uint64_t word) {
      auto it = verdicts.find(word);
      if (it == verdicts.end()) it = verdicts.emplace(word, holder_word_dead(word, home)).first;
      return it->second;
    };
    holders_of(h).reap_judged(dead, [&](size_t slot) {  // Note [Dead holders]
      for (uint32_t i = 0; i < mapping->nblocks(); ++i) {
        if (mask_clear(masks[i], static_cast<int>(slot))) {
          decref_block(*mapping, i);
          ++reclaimed;
        }
      }
    });
  }
  return reclaimed;
}

size_t Registry::reclaim_dead_holders() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t reclaimed = 0;
  for (auto& [id, mapping] : by_id_) reclaimed += reclaim_locked(*mapping);
  return reclaimed;
}

void Registry::maybe_unmap_locked(const std::shared_ptr<Mapping>& mapping) {
  if (mapping->local_refs > 0 || mapping->owned) return;
  SegmentHeader* h = mapping->header();
  // A dedicated named segment is never handed out again: its one block's name went with its
  // last reference (FLAG_UNLINK_ON_ZERO), so keeping its mapping would only pin its memory.
  uint32_t flags = h->flags.load(std::memory_order_acquire);
  if ((flags & (FLAG_UNLINK_ON_ZERO | FLAG_RETIRED)) || owner_gone(h)) {
    unmap_locked(mapping);
    return;
  }
  idle_.remove(mapping);  // Note [Idle mappings of a gone owner]
  idle_.push_back(mapping);
  sweep_idle_locked(false);
}

void Registry::unmap_locked(const std::shared_ptr<Mapping>& mapping) {
  if (mapping->named()) maybe_reap_on_unmap(*mapping);  // deregisters this process first
  erase_locked(mapping);
}

// Note [Idle mappings of a gone owner] in registry.h.
size_t Registry::sweep_idle_locked(bool check_owners) {
  std::vector<std::shared_ptr<Mapping>> drop;
  size_t kept = idle_.size();
  for (const auto& mapping : idle_) {
    SegmentHeader* h = mapping->header();
    if ((h->flags.load(std::memory_order_acquire) & FLAG_RETIRED) ||
        kept > MAX_IDLE_MAPPINGS || (check_owners && owner_gone(h))) {
      drop.push_back(mapping);  // the least recently used first
      --kept;
    }
  }
  for (const auto& mapping : drop) unmap_locked(mapping);
  return drop.size();
}

size_t Registry::drop_idle(bool all) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!all) return sweep_idle_locked(true);
  std::vector<std::shared_ptr<Mapping>> drop(idle_.begin(), idle_.end());
  for (const auto& mapping : drop) unmap_locked(mapping);
  return drop.size();
}

namespace {

/// Test hook (Note [One critical section per lookup]): attach() and release_handle() sleep
/// this long between mapping a segment and using the mapping.
std::atomic<int> g_attach_delay_ms{0};

void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/// A mapping found by id serves a handle only if the handle proves it knows the segment: the
/// secret of an anonymous one, the name of a named one. Without this, a handle forged from a
/// seen (segment, index, generation) could drop references in segments its sender cannot map.
void check_credentials(const Handle& handle, Mapping& mapping) {
  bool ok = handle.named ? (mapping.named() && handle.location == mapping.name())
                         : (!mapping.named() && handle.secret == mapping.header()->secret);
  if (!ok) {
    throw CorruptSegmentError(detail::str_cat(
        "a handle names shared memory segment ", mapping.describe(), " with the wrong ",
        handle.named ? "name" : "secret",
        ": it is forged or corrupt (handles come only from pickling a shared tensor)"));
  }
}

bool out_of_room(const SyscallError& e) {
  return e.err() == ENOMEM || e.err() == EMFILE || e.err() == ENFILE;
}

}  // namespace

void set_attach_delay_for_tests(int milliseconds) { g_attach_delay_ms.store(milliseconds); }

// Note [A receive that cannot map]
// A handle whose segment cannot be mapped (the receiver is at its address-space or fd limit
// even after Note [Idle mappings under a limit]) still carries its reference: left alone, the
// owner's block stays live until the owner exits (issue 35 D3/D4: a sender that could never
// allocate again). So before the error is raised, the reference is given back through a
// mapping of only the header and the block's slot (a page or two): its ticket taken, its
// `inflight` and refcount dropped exactly as release_handle() would. If even that cannot be
// mapped, the reference stays (a leak until the owner exits, never an early free).
static void give_back_unmapped(int fd, const Handle& handle) {
  size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_t span = slots_offset() + (static_cast<size_t>(handle.index) + 1) * sizeof(BlockSlot);
  span = (span + page - 1) / page * page;
  if (fd < 0 || span > handle.size) return;
  void* base = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return;
  {
    SigbusGuard guard;  // a truncated file reads as zeros: then nothing matches below
    auto* h = static_cast<SegmentHeader*>(base);
    if (h->magic == SEGMENT_MAGIC && h->layout_version == LAYOUT_VERSION &&
        h->segment_id == handle.segment_id &&
        h->kind == static_cast<uint32_t>(SegmentKind::Arena) && handle.index < h->nblocks) {
      BlockSlot& slot = slots_of(h)[handle.index];
      if (slot.generation.load(std::memory_order_acquire) == handle.generation &&
          take_ticket(slot)) {
        drop_inflight(h);
        int64_t left = slot.refcount.fetch_sub(1, std::memory_order_acq_rel) - 1;
        if (left < 0) {
          slot.refcount.fetch_add(1, std::memory_order_acq_rel);
        } else if (left == 0) {
          uint32_t flags = h->flags.load(std::memory_order_acquire);
          if (flags & FLAG_UNLINK_ON_ZERO) unlink_name(handle.location);
          if (flags & FLAG_FREE_ON_ZERO) {
            free_push(h, handle.index);
            h->live_blocks.fetch_sub(1, std::memory_order_acq_rel);
          }
        }
      }
    }
  }
  ::munmap(base, span);
}

std::shared_ptr<Mapping> Registry::map_new(const Handle& handle, double timeout,
                                           bool give_back) {
  std::shared_ptr<Mapping> mapping;
  if (handle.named) {
    try {
      mapping = open_named_segment(handle.location, handle.segment_id, handle.size);
    } catch (const SyscallError& e) {
      if (give_back && e.err() == ENOMEM) {
        UniqueFd fd(::shm_open(handle.location.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0));
        give_back_unmapped(fd.get(), handle);
      }
      throw;
    }
  } else {
    UniqueFd fd = fetch_fd(handle.location, handle.segment_id, handle.secret,
                           handle.owner_pid, timeout);
    try {
      mapping = map_segment_fd(fd, handle.segment_id, handle.size);
    } catch (const SyscallError& e) {
      if (give_back && out_of_room(e)) give_back_unmapped(fd.get(), handle);
      throw;
    }
  }
  if (mapping->size() != handle.size) {
    throw CorruptSegmentError(detail::str_cat("shared memory segment ", handle.segment_id,
                                              " is ", mapping->size(),
                                              " bytes but the handle says ", handle.size));
  }
  return mapping;
}

// Note [Idle mappings under a limit]
// A receiver at its address-space limit (RLIMIT_AS: mmap fails with ENOMEM) or its fd limit
// may be so only because of what it keeps for speed: idle mappings of live owners (up to
// MAX_IDLE_MAPPINGS) and, as an owner itself, cached free segments (one fd each). Before a
// map that failed for room is reported, all of those go (and pending unmaps finish), and the
// map is tried once more: a receiver that dropped what it held receives again.
std::shared_ptr<Mapping> Registry::map_handle(const Handle& handle, double timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto found = find_locked(handle.segment_id)) {
      check_credentials(handle, *found);
      return found;
    }
  }
  // Map without the lock: fetching an fd may wait for the owner.
  std::shared_ptr<Mapping> mapping;
  try {
    mapping = map_new(handle, timeout);
  } catch (const SyscallError& e) {
    if (!out_of_room(e)) throw;
    Arena::instance().empty_cache();  // takes the arena, then this registry's mutex
    drop_idle(/*all=*/true);
    finish_pending_unmaps();
    mapping = map_new(handle, timeout, /*give_back=*/true);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto kept = insert_locked(mapping);
  if (kept == mapping) sweep_idle_locked(true);
  return kept;
}

// Note [One critical section per lookup]
// map_handle() maps without the registry mutex (an fd fetch may wait for the owner), so the
// mapping it returns may have been unmapped and erased by another thread (its last local
// reference dropped) before the caller locks again. Using it then would count a reference on
// a mapping the registry no longer knows, beside a fresh mapping of the same segment. So
// attach() and release_handle() check, under the lock in which they use it, that the mapping
// is still the registry's one for that id, and look it up again if not.
std::shared_ptr<Mapping> Registry::lock_mapping(const Handle& handle, double timeout,
                                                std::unique_lock<std::mutex>* lock) {
  for (int attempt = 0;; ++attempt) {
    auto mapping = map_handle(handle, timeout);
    if (mapping->id() != handle.segment_id) {
      throw CorruptSegmentError(detail::str_cat(
          "a handle names shared memory segment ", handle.segment_id, " but ",
          mapping->describe(), " is segment ", mapping->id(), ": the handle is forged or the "
          "segment was replaced"));
    }
    if (int delay = g_attach_delay_ms.load()) sleep_ms(delay);
    lock->lock();
    if (find_locked(mapping->id()) == mapping) return mapping;
    lock->unlock();
    // Unmapped under us: map again. Each round needs another thread to unmap it meanwhile.
    TMX_CHECK(attempt < 100, "shared memory segment ", handle.segment_id,
              " was unmapped under this thread 100 times while it attached a handle");
  }
}

BlockSlot& Registry::check_block_locked(const Handle& handle,
                                        const std::shared_ptr<Mapping>& mapping,
                                        const char* action) {
  try {
    if (mapping->kind() != SegmentKind::Arena) {
      throw CorruptSegmentError(detail::str_cat("shared memory segment ", mapping->describe(),
                                                " is a counter file, not a block segment"));
    }
    TMX_CHECK_VALUE(handle.index < mapping->nblocks(), "block index ", handle.index,
                    " out of range for segment ", handle.segment_id);
    BlockSlot& slot = mapping->slots()[handle.index];
    uint32_t generation = slot.generation.load(std::memory_order_acquire);
    if (generation == 0) {  // never, for a block ever handed out: its page reads as zeros
      throw CorruptSegmentError(detail::str_cat(
          "cannot ", action, " a handle: shared memory segment ", mapping->describe(),
          " is corrupt (block ", handle.index, " has generation 0: was the file truncated or "
          "overwritten by another process?); the file_descriptor sharing strategy's segments "
          "cannot be truncated"));
    }
    if (generation != handle.generation) {
      throw CorruptSegmentError(detail::str_cat(
          "cannot ", action, " a stale handle: block ", handle.index, " of segment ",
          handle.segment_id, " was freed and reused (generation ", generation, ", handle ",
          handle.generation, "); the handle was used already (a pickle loaded twice?) or is "
          "forged"));
    }
    // Note [Tickets]: the ticket is taken while the block's generation is the handle's; the
    // reference the ticket stands for keeps it so, and a second look catches a spent handle
    // racing a reuse.
    if (!take_ticket(slot)) {
      throw CorruptSegmentError(detail::str_cat(
          "cannot ", action, " a spent handle: block ", handle.index,
          " of shared memory segment ", mapping->describe(), " has no handle in flight left, "
          "so this one was used already (a pickle loaded twice, or a message read twice) or "
          "is forged. No reference is taken or dropped; pickle the tensor once per "
          "receiver"));
    }
    if (slot.generation.load(std::memory_order_acquire) != handle.generation) {
      tickets_of(slot).fetch_add(1, std::memory_order_acq_rel);  // not ours: give it back
      throw CorruptSegmentError(detail::str_cat(
          "cannot ", action, " a stale handle: block ", handle.index, " of segment ",
          handle.segment_id, " was reused meanwhile (the handle was used already)"));
    }
    return slot;
  } catch (...) {
    maybe_unmap_locked(mapping);  // a bad handle leaves no mapping behind
    throw;
  }
}

std::unique_ptr<BlockRef> Registry::attach(const Handle& handle, double timeout) {
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  auto mapping = lock_mapping(handle, timeout, &lock);
  check_block_locked(handle, mapping, "redeem");
  return adopt_locked(mapping, handle.index, /*redeem=*/true);
}

void Registry::release_handle(const Handle& handle, double timeout) {
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  auto mapping = lock_mapping(handle, timeout, &lock);
  check_block_locked(handle, mapping, "release");
  drop_inflight(mapping->header());
  decref_block(*mapping, handle.index);
  maybe_unmap_locked(mapping);
}

Mapping* Registry::locate_locked(uintptr_t address, size_t nbytes, uint32_t* index,
                                 size_t* offset) {
  auto it = by_address_.upper_bound(address);
  if (it == by_address_.begin()) return nullptr;
  --it;
  Mapping* m = it->second;
  auto begin = reinterpret_cast<uintptr_t>(m->data_begin());
  auto end = reinterpret_cast<uintptr_t>(m->data_end());
  if (address < begin || address >= end || m->block_size() == 0) return nullptr;
  *index = static_cast<uint32_t>((address - begin) / m->block_size());
  *offset = address - begin - static_cast<size_t>(*index) * m->block_size();
  if (*offset + nbytes > m->block_size()) return nullptr;  // spans blocks: not one of ours
  if (m->slots()[*index].refcount.load(std::memory_order_acquire) <= 0) {
    // This process holds the block, so its count cannot be 0: the slot was zeroed under us
    // (its file truncated to a few bytes by a peer, or garbage written). Saying "not ours"
    // would send the caller to copy the tensor's data: a SIGBUS if the file shrank.
    if (m->local_counts.size() > *index && m->local_counts[*index] > 0) {
      throw CorruptSegmentError(detail::str_cat(
          "shared memory segment ", m->describe(), " is corrupt: block ", *index,
          " has a shared refcount of 0 while this process holds it (was the file truncated "
          "or overwritten by another process?). Its tensors must not be used; the "
          "file_descriptor sharing strategy's segments cannot be truncated"));
    }
    return nullptr;
  }
  return m;
}

bool Registry::contains(uintptr_t address, size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t index = 0;
  size_t offset = 0;
  return locate_locked(address, nbytes, &index, &offset) != nullptr;
}

bool Registry::share_address(uintptr_t address, size_t nbytes, Handle* out, size_t* offset) {
  // Note [No resurrection]: the new reference is only taken while this process provably
  // holds one (its local count, under the lock), never on the strength of a refcount read
  // earlier: a block whose count reached 0 may already be on the free stack, and a reference
  // taken then would name the block's next allocation.
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t index = 0;
  Mapping* m = locate_locked(address, nbytes, &index, offset);
  if (m == nullptr) return false;
  if (m->local_counts.size() <= index || m->local_counts[index] == 0) return false;
  BlockRef probe(by_id_.at(m->id()), index);  // not linked: only used to build the handle
  *out = probe.share();
  probe.live_ = false;
  return true;
}

bool Registry::with_fd_for(uint64_t segment_id, uint64_t secret,
                           const std::function<void(int)>& use) {
  std::lock_guard<std::mutex> lock(mu_);
  auto mapping = find_locked(segment_id);
  if (!mapping || !mapping->owned || mapping->fd() < 0) return false;
  if (mapping->header()->secret != secret) return false;
  use(mapping->fd());
  return true;
}

void Registry::retire_locked(const std::shared_ptr<Mapping>& mapping) {
  mapping->header()->flags.fetch_or(FLAG_RETIRED, std::memory_order_acq_rel);
  mapping->owned = false;
  unlink_if_free(*mapping);
  erase_locked(mapping);
}

// Note [Late writes at exit]
// release_all() runs at interpreter exit, when daemon threads may still run and write into
// tensors they hold. Once this process drops its reference to a block it received, the
// block's owner may hand it out again at once, and a late write would land in someone else's
// new tensor (issue 26). So before dropping them, the data pages of every segment this process
// received blocks from are replaced, in this process only, by private anonymous memory
// (mmap MAP_FIXED over the data region; the header and slot tables stay shared, since the
// drops themselves write there). A late write then changes nothing another process sees, and
// a late read sees zeros. Segments this process owns are left mapped: nobody else allocates
// from them, and their receivers are meant to see their owner's writes. Queue rings let go
// before this (their finalizers run at a higher exit priority than _release_at_exit).
static void privatize_data(Mapping& mapping) {
  char* begin = mapping.data_begin();
  char* end = mapping.base() + mapping.size();
  if (end <= begin) return;
  void* got = ::mmap(begin, static_cast<size_t>(end - begin), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  (void)got;  // MAP_FAILED leaves the shared pages: the old behaviour, never a crash
}

void Registry::release_all() {
  std::vector<KeptSegment> kept;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return;
    released_ = true;
    for (BlockRef* ref = refs_; ref != nullptr; ref = ref->next_) ref->live_ = false;
    for (auto& [id, mapping] : by_id_) {
      auto& counts = mapping->local_counts;
      if (!mapping->owned && std::any_of(counts.begin(), counts.end(),
                                         [](uint32_t n) { return n != 0; })) {
        privatize_data(*mapping);  // Note [Late writes at exit]: before the references go
      }
      for (uint32_t i = 0; i < counts.size(); ++i) {
        if (counts[i] == 0) continue;
        counts[i] = 1;
        drop_local_locked(*mapping, i);
      }
      mapping->local_refs = 0;
      if (mapping->owned) {
        // Nobody allocates from it again: receivers may drop their idle mappings (Note
        // [Idle mappings of a gone owner] in registry.h).
        SegmentHeader* h = mapping->header();
        h->flags.fetch_or(FLAG_RETIRED, std::memory_order_acq_rel);
        if (mapping->fd() >= 0) kept.push_back({h->segment_id, h->secret, mapping->fd(), h});
        unlink_if_free(*mapping);
      }
      if (mapping->named()) maybe_reap_on_unmap(*mapping);
    }
  }
  double linger = 30.0;  // Note [Exit keeper]
  if (const char* env = std::getenv("TORCH_MP_EXT_EXIT_LINGER_S")) linger = std::atof(env);
  int listen_fd = FdServer::instance().listen_fd();
  forking_keeper_ = true;  // the keeper must keep the fds our atfork child handler would close
  start_exit_keeper(kept, listen_fd, linger);
  forking_keeper_ = false;
}

RegistryStats Registry::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  RegistryStats s;
  for (auto& [id, mapping] : by_id_) {
    ++s.mapped_segments;
    if (mapping->owned) ++s.owned_segments;
    s.mapped_bytes += mapping->size();
  }
  s.live_refs = live_refs_;
  s.idle_mappings = idle_.size();
  s.refcount_underflows = g_underflows.load();
  return s;
}

namespace {
/// Test hook: the atfork child handler sleeps this long before marking its blocks.
std::atomic<int> g_fork_child_delay_ms{0};
}  // namespace

void set_fork_child_delay_for_tests(int milliseconds) { g_fork_child_delay_ms.store(milliseconds); }

// Lock order everywhere: Arena, then Registry, then FdServer.
void Registry::atfork_prepare() {
  Arena::instance().atfork_prepare();
  mu_.lock();
  FdServer::instance().atfork_prepare();
  if (forking_keeper_ || released_) return;  // the keeper holds nothing (Note [Exit keeper])
  // Note [Mappings and fork]: the child's references are counted here, before it exists.
  for (auto& [id, mapping] : by_id_) {
    const auto& counts = mapping->local_counts;
    for (uint32_t i = 0; i < counts.size(); ++i) {
      if (counts[i] != 0) mapping->slots()[i].refcount.fetch_add(1, std::memory_order_acq_rel);
    }
  }
}

void Registry::atfork_parent() {
  FdServer::instance().atfork_parent();
  mu_.unlock();
  Arena::instance().atfork_parent();
}

void Registry::atfork_child() {
  if (forking_keeper_) {  // the keeper runs no Python and touches nothing but its fds
    FdServer::instance().atfork_parent();
    mu_.unlock();
    Arena::instance().atfork_parent();
    return;
  }
  refresh_self_after_fork();
  if (int delay = g_fork_child_delay_ms.load()) {
    struct timespec ts = {delay / 1000, (delay % 1000) * 1000000L};
    ::nanosleep(&ts, nullptr);
  }
  // Note [Mappings and fork]: the parent counted our references before the fork; mark them
  // ours first thing (a death before that leaks them), then the rest.
  for (auto& [id, mapping] : by_id_) {
    mapping->holder_index = -1;  // the parent's slot; the child takes its own
    mapping->register_holder();
    HolderMask* masks = mapping->masks();
    if (masks == nullptr || mapping->holder_index < 0) continue;
    const auto& counts = mapping->local_counts;
    for (uint32_t i = 0; i < counts.size(); ++i) {
      if (counts[i] != 0) mask_set(masks[i], mapping->holder_index);
    }
  }
  for (auto& [id, mapping] : by_id_) {
    mapping->owned = false;
    mapping->close_fd();
  }
  session_atfork_child();  // Note [Session names]
  FdServer::instance().atfork_child();
  mu_.unlock();
  Arena::instance().atfork_child();
}

}  // namespace torch_mp_ext
