#include "shm/arena.h"

#include <fcntl.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "common/arith.h"
#include "common/check.h"
#include "ipc/fd_server.h"
#include "platform/process.h"
#include "shm/sigbus.h"
#include "shm/unmapper.h"

namespace torch_mp_ext {

namespace {

uint64_t next_pow2(uint64_t n) {
  uint64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

void init_allocated(Mapping& m, uint32_t index) {
  BlockSlot& slot = m.slots()[index];
  tickets_of(slot).store(0, std::memory_order_relaxed);  // Note [Tickets]
  slot.generation.fetch_add(1, std::memory_order_acq_rel);
  slot.refcount.store(1, std::memory_order_release);
  m.header()->live_blocks.fetch_add(1, std::memory_order_acq_rel);
}

bool fully_free(const Mapping& m) {
  return m.header()->live_blocks.load(std::memory_order_acquire) == 0;
}

}  // namespace

Arena& Arena::instance() {
  static auto* arena = new Arena();  // leaked: see Registry::instance()
  return *arena;
}

Arena::Arena() {
  if (const char* env = std::getenv("TORCH_MP_EXT_ARENA_CACHE_BYTES")) {
    char* end = nullptr;
    unsigned long long value = std::strtoull(env, &end, 10);
    if (end != env && *end == '\0') cache_limit_ = static_cast<size_t>(value);
  }
  if (const char* env = std::getenv("TORCH_MP_EXT_NAMED_CACHE_S")) {
    char* end = nullptr;
    double value = std::strtod(env, &end);
    if (end != env && *end == '\0' && value >= 0 && value < 1e6) named_idle_s_ = value;
  }
}

uint64_t Arena::class_size(size_t nbytes) {
  if (nbytes <= MIN_BLOCK) return MIN_BLOCK;
  if (nbytes <= SMALL_MAX) return next_pow2(nbytes);
  uint64_t granule = next_pow2(nbytes) / 8;
  if (granule < 4096) granule = 4096;
  return round_up(nbytes, granule);
}

uint32_t Arena::blocks_per_segment(uint64_t block_size) {
  if (block_size > SMALL_MAX) return 1;
  return static_cast<uint32_t>(SLAB_BYTES / block_size);
}

std::unique_ptr<BlockRef> Arena::take_locked(const std::shared_ptr<Mapping>& mapping) {
  uint32_t index = NO_BLOCK;
  try {
    index = mapping->pop_free();
  } catch (const CorruptSegmentError&) {
    // A peer scribbled on the free stack: this segment hands out nothing more (its live blocks
    // stay mapped); the next allocation makes a fresh one.
    retire_pooled_locked(mapping);
    throw;
  }
  if (index == NO_BLOCK) return nullptr;
  mapping->idle_ticks = 0;  // Note [Pooled names]: in use since the expiry thread last looked
  init_allocated(*mapping, index);
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  return registry.adopt_locked(mapping, index);
}

void Arena::retire_pooled_locked(std::shared_ptr<Mapping> mapping) {
  auto& pool = pools_[{mapping->block_size(), mapping->named()}];
  pool.erase(std::remove(pool.begin(), pool.end(), mapping), pool.end());
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  registry.retire_locked(mapping);
}

std::shared_ptr<Mapping> Arena::new_segment_locked(uint64_t block_size, bool named) {
  std::string address = named ? std::string() : FdServer::instance().address();
  SegmentSpec spec;
  spec.kind = SegmentKind::Arena;
  spec.block_size = block_size;
  spec.nblocks = blocks_per_segment(block_size);
  spec.named = named;
  spec.flags = FLAG_FREE_ON_ZERO;
  std::shared_ptr<Mapping> mapping = create_or_trim_locked(spec);
  // An anonymous segment's name field says where its fd is served; a named one's is its name.
  if (!named) std::snprintf(mapping->header()->name, NAME_CAPACITY, "%s", address.c_str());
  pools_[{block_size, named}].push_back(mapping);
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  registry.add_owned_locked(mapping);
  return mapping;
}

std::unique_ptr<BlockRef> Arena::allocate(size_t nbytes, bool named) {
  TMX_CHECK_VALUE(nbytes > 0, "cannot allocate an empty shared-memory block");
  TMX_CHECK_VALUE(nbytes <= (size_t{1} << 46), "shared-memory block of ", nbytes,
                  " bytes is larger than the 64 TiB this arena supports");
  if (named && named_idle_s_ <= 0) return allocate_dedicated(nbytes);
  uint64_t block_size = class_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  auto& pool = pools_[{block_size, named}];
  // Newest segments first: they are the likeliest to have free blocks and hot pages.
  for (auto it = pool.rbegin(); it != pool.rend(); ++it) {
    if (auto ref = take_locked(*it)) return ref;
  }
  if (!pool.empty()) request_reclaim_locked();  // dead receivers' blocks come back later
  size_t cached = 0;
  for (auto& [size, segments] : pools_) {
    for (auto& m : segments) {
      if (fully_free(*m)) cached += m->size();
    }
  }
  if (cached > cache_limit_) trim_locked(cache_limit_ / 2);
  auto mapping = new_segment_locked(block_size, named);
  auto ref = take_locked(mapping);
  TMX_CHECK(ref != nullptr, "a new segment had no free block");
  if (named && !expiry_running_) {
    expiry_running_ = true;
    std::thread([this] {
      name_this_thread("tmx-expiry");
      expire_named();
    }).detach();
  }
  return ref;
}

// Note [Reclaiming off the allocation path] in arena.h.
void Arena::request_reclaim_locked() {
  reclaim_wanted_ = true;
  if (reclaimer_running_) {
    reclaim_cv_.notify_one();
    return;
  }
  reclaimer_running_ = true;
  std::thread([this] {
    name_this_thread("tmx-reclaim");
    reclaim_loop();
  }).detach();
}

void Arena::reclaim_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    reclaim_cv_.wait(lock, [this] { return reclaim_wanted_; });
    reclaim_wanted_ = false;
    std::vector<std::shared_ptr<Mapping>> segments;
    for (auto& [key, pool] : pools_) segments.insert(segments.end(), pool.begin(), pool.end());
    {
      // Taken before mu_ is let go: create_or_trim_locked() waits on it for the segments
      // this snapshot keeps (their fds and mappings) before it retries.
      std::lock_guard<std::mutex> pass(reclaim_pass_mu_);
      lock.unlock();
      Registry::reclaim_segments(segments);
      segments.clear();  // a segment retired meanwhile is closed and unmapped here
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(RECLAIM_INTERVAL_MS));
    lock.lock();
  }
}

std::unique_ptr<BlockRef> Arena::allocate_dedicated(size_t nbytes) {
  SegmentSpec spec;
  spec.kind = SegmentKind::Arena;
  spec.block_size = round_up(nbytes, BLOCK_ALIGNMENT);
  spec.nblocks = 1;
  spec.named = true;
  spec.flags = FLAG_UNLINK_ON_ZERO;
  std::shared_ptr<Mapping> mapping;
  try {
    mapping = create_segment(spec);
  } catch (const SyscallError& e) {  // Note [Unmapping off the caller's path]: wait, retry
    if (e.err() != ENOSPC && e.err() != ENOMEM) throw;
    finish_pending_unmaps();  // an unmap may also have ended meanwhile: retry anyway
    mapping = create_segment(spec);
  }
  uint32_t index = mapping->pop_free();
  init_allocated(*mapping, index);
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  registry.add_owned_locked(mapping);
  mapping->owned = false;  // never pooled: unmapped with its last local reference
  return registry.adopt_locked(mapping, index);
}

size_t Arena::named_budget() {
  size_t budget = cache_limit_;
  struct statvfs st;
  if (::statvfs("/dev/shm", &st) == 0) {
    budget = std::min<size_t>(budget, static_cast<size_t>(st.f_blocks) * st.f_frsize / 4);
  }
  return budget;
}

// Note [Pooled names]: the owner's thread that retires named segments left fully free.
void Arena::expire_named() {
  const auto tick = std::chrono::milliseconds(NAMED_TICK_MS);
  const int ticks = std::max(1, static_cast<int>(named_idle_s_ * 1000 / NAMED_TICK_MS));
  const size_t budget = named_budget();
  for (;;) {
    std::this_thread::sleep_for(tick);
    std::lock_guard<std::mutex> lock(mu_);
    SigbusGuard guard;  // a truncated file reads as zeros here (Note [Truncated under us])
    // Every fully free named segment; busy ones start their idle count over.
    std::vector<std::shared_ptr<Mapping>> free;
    size_t watched = 0;
    size_t free_bytes = 0;
    std::vector<std::shared_ptr<Mapping>> unwatched;
    for (auto& [key, segments] : pools_) {
      if (!key.second) continue;
      watched += segments.size();
      for (auto& m : segments) {
        m->idle_ticks = fully_free(*m) ? m->idle_ticks + 1 : 0;
        if (m->idle_ticks == 0) continue;
        // Note [Pooled names]: a free segment that no other live process maps keeps no
        // receiver's mapping warm; its name goes now, as torch's would.
        HolderTable holders = holders_of(m->header());
        if (!holders.any_alive(holders.self())) {
          unwatched.push_back(m);
          continue;
        }
        free.push_back(m);
        free_bytes += m->size();
      }
    }
    for (const auto& m : unwatched) {
      retire_pooled_locked(m);  // unlinks the name: no block is live
      --watched;
    }
    // Longest idle first: past the idle time, or past the share of /dev/shm a cache may hold.
    std::sort(free.begin(), free.end(),
              [](const auto& a, const auto& b) { return a->idle_ticks > b->idle_ticks; });
    for (const auto& m : free) {
      if (m->idle_ticks < ticks && free_bytes <= budget) break;
      free_bytes -= m->size();
      retire_pooled_locked(m);  // unlinks the name: no block is live
      --watched;
    }
    if (watched == 0) {  // nothing named left to watch: the next named segment starts a new thread
      expiry_running_ = false;
      return;
    }
  }
}

std::unique_ptr<BlockRef> Arena::allocate_sparse(size_t nbytes, size_t reserved, bool named) {
  TMX_CHECK_VALUE(nbytes > 0 && nbytes <= (size_t{1} << 46), "a sparse shared-memory block "
                  "must be between 1 byte and 64 TiB, got ", nbytes);
  SegmentSpec spec;
  spec.kind = SegmentKind::Arena;
  spec.block_size = round_up(nbytes, 4096);
  spec.nblocks = 1;
  spec.named = named;
  spec.flags = named ? FLAG_UNLINK_ON_ZERO : FLAG_FREE_ON_ZERO;
  spec.reserve_bytes = round_up(std::max<size_t>(reserved, 1), 4096);
  auto& registry = Registry::instance();
  if (named) {
    auto mapping = create_segment(spec);
    uint32_t index = mapping->pop_free();
    init_allocated(*mapping, index);
    std::lock_guard<std::mutex> lock(registry.mutex());
    registry.add_owned_locked(mapping);
    mapping->owned = false;  // never pooled: unmapped with its last local reference
    return registry.adopt_locked(mapping, index);
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Reuse one fully free segment of this size; keep two more for the next queues, retire
  // the rest (each holds its reserved pages).
  std::shared_ptr<Mapping> reuse;
  size_t kept = 0;
  for (auto it = sparse_.begin(); it != sparse_.end();) {
    Mapping& m = **it;
    if (!fully_free(m)) {
      ++it;
    } else if (reuse == nullptr && m.block_size() == spec.block_size && m.fd() >= 0) {
      reuse = *it++;
    } else if (++kept > 2) {
      std::lock_guard<std::mutex> rlock(registry.mutex());
      registry.retire_locked(*it);
      it = sparse_.erase(it);
    } else {
      ++it;
    }
  }
  if (reuse != nullptr) {
    // Its last user may have left pages past the reserved part (a growth cut short by a kill).
    size_t from = (reuse->data_begin() - reuse->base()) + spec.reserve_bytes;
    if (from < reuse->size()) {
      (void)::fallocate(reuse->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(from), static_cast<off_t>(reuse->size() - from));
    }
    if (auto ref = take_locked(reuse)) return ref;
  }
  std::string address = FdServer::instance().address();
  std::shared_ptr<Mapping> mapping = create_or_trim_locked(spec);
  std::snprintf(mapping->header()->name, NAME_CAPACITY, "%s", address.c_str());
  sparse_.push_back(mapping);
  {
    std::lock_guard<std::mutex> rlock(registry.mutex());
    registry.add_owned_locked(mapping);
  }
  auto ref = take_locked(mapping);
  TMX_CHECK(ref != nullptr, "a new segment had no free block");
  return ref;
}

size_t Arena::trim_locked(size_t keep_bytes) {
  size_t cached = 0;
  for (auto& [size, segments] : pools_) {
    for (auto& m : segments) {
      if (fully_free(*m)) cached += m->size();
    }
  }
  size_t released = 0;
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  // Largest classes first: they free the most memory per retired segment.
  for (auto pool = pools_.rbegin(); pool != pools_.rend() && cached > keep_bytes; ++pool) {
    auto& segments = pool->second;
    for (auto it = segments.begin(); it != segments.end() && cached > keep_bytes;) {
      if (fully_free(**it)) {
        cached -= (*it)->size();
        released += (*it)->size();
        registry.retire_locked(*it);
        it = segments.erase(it);
      } else {
        ++it;
      }
    }
  }
  return released;
}

size_t Arena::reclaim_locked(const std::vector<std::shared_ptr<Mapping>>& segments) {
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  size_t reclaimed = 0;
  for (auto& mapping : segments) reclaimed += registry.reclaim_locked(*mapping);
  return reclaimed;
}

size_t Arena::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, segments] : pools_) reclaim_locked(segments);
  Registry::instance().drop_idle(/*all=*/true);  // Note [Idle mappings under a limit]
  reclaim_locked(sparse_);
  size_t released = retire_free_sparse_locked();
  return released + trim_locked(0);
}

size_t Arena::retire_free_sparse_locked() {
  size_t released = 0;
  auto& registry = Registry::instance();
  std::lock_guard<std::mutex> lock(registry.mutex());
  for (auto it = sparse_.begin(); it != sparse_.end();) {
    if (fully_free(**it)) {
      released += (*it)->size();
      registry.retire_locked(*it);
      it = sparse_.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

std::shared_ptr<Mapping> Arena::create_or_trim_locked(const SegmentSpec& spec) {
  try {
    return create_segment(spec);
  } catch (const SyscallError& e) {
    // Out of room or out of fds: the cached free segments hold both (one fd each, and
    // their pages). Drop them and try once more.
    if (e.err() != ENOSPC && e.err() != ENOMEM && e.err() != EMFILE && e.err() != ENFILE) {
      throw;
    }
    // Pages of segments let go of just now may still be on their way out (Note [Unmapping
    // off the caller's path]); one that ended during the failed attempt counts too, so
    // retry after waiting whatever was found.
    finish_pending_unmaps();
    trim_locked(0);
    retire_free_sparse_locked();
    // A reclaim pass may still hold segments just retired (their fds and mappings): wait for
    // it (Note [Reclaiming off the allocation path]), then for the unmaps they queued.
    { std::lock_guard<std::mutex> pass(reclaim_pass_mu_); }
    finish_pending_unmaps();
    return create_segment(spec);
  }
}

ArenaStats Arena::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats s;
  s.cache_limit = cache_limit_;
  for (auto& m : sparse_) {  // growable queue rings: count them, not their address space
    ++s.segments;
    s.live_blocks += m->header()->live_blocks.load(std::memory_order_acquire);
  }
  for (auto& [size, segments] : pools_) {
    for (auto& m : segments) {
      ++s.segments;
      s.reserved_bytes += m->size();
      uint32_t live = m->header()->live_blocks.load(std::memory_order_acquire);
      s.live_blocks += live;
      if (live == 0) s.cached_free_bytes += m->size();
    }
  }
  return s;
}

void Arena::atfork_child() {
  sparse_.clear();
  pools_.clear();  // the parent keeps allocating from its segments; the child makes its own
  expiry_running_ = false;  // the parent's expiry thread was not forked
  reclaimer_running_ = false;  // nor its reclaim thread, which may have been waiting on
  reclaim_wanted_ = false;     // the condition variable: a fresh one has no phantom waiter
  new (&reclaim_cv_) std::condition_variable();
  new (&reclaim_pass_mu_) std::mutex();  // the reclaim thread may have held it at the fork
  mu_.unlock();
}

}  // namespace torch_mp_ext
