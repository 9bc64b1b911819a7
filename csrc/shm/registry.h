// The process-wide table of mapped segments and live block references.
//
// Note [fd budget]
// A process holds an fd only for anonymous segments it created (receivers fetch it from the
// owner's fd server, map, and close it at once). So receiving 10,000 tensors costs no fds,
// and sending them costs one fd per arena segment, not one per tensor.
//
// Note [Idle mappings of a gone owner]
// A receiver keeps up to MAX_IDLE_MAPPINGS mappings with no live block (LRU), so a block the
// owner hands out again is already mapped and faulted in. A mapping whose owner has gone is
// useless and pins its memory: a DataLoader epoch's exited workers left their batch segments
// (tens of MB each) mapped in the main process, epoch after epoch. So an owner retires every
// segment it owns when it releases its references at exit (release_all), and idle mappings
// of retired segments go at the next sweep (each mapping turning idle: one atomic load per
// idle mapping). A SIGKILLed owner retires nothing: sweeps that map a new segment, and
// drop_orphaned_idle() (empty_cache()), also drop idle mappings whose owner pid is gone.
//
// Note [Mappings and fork]
// After fork(2) the child inherits every mapping and every live BlockRef. Its references are
// counted by the *parent*, in the atfork prepare handler, under the registry mutex: one
// increment per block this process holds, before the child exists. The child handler then
// registers the child as a holder of every segment and sets its bit on those blocks (Note
// [Dead holders]: counted, then marked), forgets ownership (the parent allocates from its
// segments; the child makes its own) and closes inherited owner fds.
// Counting in the child instead (as this once did) over-drops: the parent resumes as soon as
// fork returns and may drop its own reference to a block before the child's handler has run;
// if that was the last one, the block goes back to the free stack, and the child's increment
// then lands on a free block that the owner hands out again (issue 12: a TaskPool worker
// forked as a replacement while its parent let go of task values; caught by the kill-anywhere
// harness, reproduced by tests/test_crash_consistency.py with a delayed child handler).
// What a death costs: a child killed before its handler marked its bits, or a fork that
// fails (the prepare handler cannot know), leaks those references (never frees one early).
// The registry mutex is taken in the prepare handler so the child never inherits it locked.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <list>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "shm/segment.h"

namespace torch_mp_ext {

/// What travels in a pickle to name one block (plus one counted reference to it).
struct Handle {
  bool named = false;
  uint64_t segment_id = 0;
  uint64_t secret = 0;
  uint64_t size = 0;  ///< segment size, checked on map
  uint32_t index = 0;
  uint32_t generation = 0;
  int32_t owner_pid = 0;
  std::string location;  ///< named: the shm name; anonymous: the owner's fd-server address
};

/// One counted reference to a block, held by this process. Destroying it drops the reference
/// (Note [Block lifetime]).
class BlockRef {
 public:
  BlockRef(std::shared_ptr<Mapping> mapping, uint32_t index);  ///< adopts a counted reference
  BlockRef(const BlockRef&) = delete;
  BlockRef& operator=(const BlockRef&) = delete;
  ~BlockRef();

  /// Drops the reference now (idempotent).
  void release();
  bool live() const { return live_; }
  char* data() const { return mapping_->block_data(index_); }
  size_t capacity() const { return mapping_->block_size(); }
  uint32_t index() const { return index_; }
  uint32_t generation() const;
  const std::shared_ptr<Mapping>& mapping() const { return mapping_; }
  /// A handle carrying one new reference (for a message in flight).
  Handle share() const;

 private:
  friend class Registry;
  std::shared_ptr<Mapping> mapping_;
  uint32_t index_;
  uint32_t adopted_generation_;  ///< the block's generation when adopted (Note [Audit])
  bool live_ = true;
  BlockRef* prev_ = nullptr;
  BlockRef* next_ = nullptr;
};

struct RegistryStats {
  size_t mapped_segments = 0;
  size_t owned_segments = 0;
  size_t mapped_bytes = 0;
  size_t live_refs = 0;
  size_t idle_mappings = 0;
  uint64_t refcount_underflows = 0;
};

/// Process-wide; all methods are thread-safe.
class Registry {
 public:
  static Registry& instance();

  std::mutex& mutex() { return mu_; }

  /// Adds a mapping created by this process (allocator side) and links a BlockRef on `index`.
  void add_owned_locked(const std::shared_ptr<Mapping>& mapping);
  /// `redeem`: the reference is a handle's, leaving the segment's `inflight` count.
  std::unique_ptr<BlockRef> adopt_locked(const std::shared_ptr<Mapping>& mapping,
                                         uint32_t index, bool redeem = false);

  /// Rebuilds a handle: maps the segment if needed and adopts the handle's reference.
  std::unique_ptr<BlockRef> attach(const Handle& handle, double timeout);
  /// Drops the handle's reference without keeping the block.
  void release_handle(const Handle& handle, double timeout);
  /// The block holding [address, address + nbytes), with a new reference in a handle, or
  /// false when that memory is not in a block of this process's mappings.
  bool share_address(uintptr_t address, size_t nbytes, Handle* out, size_t* offset);
  /// True if [address, address + nbytes) lies in one live block of this process's mappings.
  bool contains(uintptr_t address, size_t nbytes);

  /// Calls `use` with the fd of an owned anonymous segment, under the registry mutex (so the
  /// fd stays open meanwhile, and passing it needs no spare fd: a sender at its fd limit
  /// still answers, issue 35 D3); false if the segment or secret is unknown.
  bool with_fd_for(uint64_t segment_id, uint64_t secret, const std::function<void(int)>& use);
  /// Retires an owned segment whose blocks are all free (arena cache trimming).
  void retire_locked(const std::shared_ptr<Mapping>& mapping);

  /// Drops every reference this process still holds (interpreter exit); later BlockRef
  /// destructions are no-ops.
  void release_all();
  /// Unmaps idle mappings of segments whose owner retired them or is gone (Note [Idle
  /// mappings of a gone owner]), or every idle mapping with `all`; returns how many.
  size_t drop_idle(bool all);
  /// Drops the references of dead processes on every mapped segment (Note [Dead holders]);
  /// returns how many were dropped.
  size_t reclaim_dead_holders();
  size_t reclaim_locked(Mapping& mapping);
  /// Note [Reclaiming off the allocation path] (arena.h): reclaim_locked for many segments,
  /// without the registry mutex (it only touches shared memory, and `segments` keeps them
  /// mapped), judging each process once.
  static size_t reclaim_segments(const std::vector<std::shared_ptr<Mapping>>& segments);
  /// Note [Reclaiming names at run time]: drops dead processes' references to named
  /// segments created by this process or by dead ones; returns the names reclaimed.
  std::vector<std::string> reclaim_named(const std::string& prefix);
  RegistryStats stats();
  /// Note [Audit]: the invariants of every segment this process maps; one line per
  /// violation (empty: all hold). Meaningful while no other process changes them.
  /// `reclaimed`: dead processes' references should be gone too.
  std::vector<std::string> audit(bool reclaimed);

  void atfork_prepare();
  void atfork_parent();
  void atfork_child();

  /// Internal: called by BlockRef.
  void on_release(BlockRef* ref);

 private:
  Registry();
  std::shared_ptr<Mapping> map_handle(const Handle& handle, double timeout);
  /// `give_back`: a map that fails for room gives the handle's reference back first (Note
  /// [A receive that cannot map] in registry.cpp).
  std::shared_ptr<Mapping> map_new(const Handle& handle, double timeout, bool give_back = false);
  std::shared_ptr<Mapping> lock_mapping(const Handle& handle, double timeout,
                                        std::unique_lock<std::mutex>* lock);
  BlockSlot& check_block_locked(const Handle& handle, const std::shared_ptr<Mapping>& mapping,
                                const char* action);
  std::shared_ptr<Mapping> find_locked(uint64_t id);
  Mapping* locate_locked(uintptr_t address, size_t nbytes, uint32_t* index, size_t* offset);
  std::shared_ptr<Mapping> insert_locked(std::shared_ptr<Mapping> mapping);
  void link_locked(BlockRef* ref);
  void drop_local_locked(Mapping& mapping, uint32_t index);
  void unlink_locked(BlockRef* ref);
  void maybe_unmap_locked(const std::shared_ptr<Mapping>& mapping);
  void erase_locked(const std::shared_ptr<Mapping>& mapping);
  /// Unmaps a mapping without live blocks (a named one is judged by the reaper's rule first).
  void unmap_locked(const std::shared_ptr<Mapping>& mapping);
  size_t sweep_idle_locked(bool check_owners);

  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Mapping>> by_id_;
  std::map<uintptr_t, Mapping*> by_address_;      // data_begin -> mapping
  std::list<std::shared_ptr<Mapping>> idle_;      // non-owned anonymous, no live refs, LRU
  BlockRef* refs_ = nullptr;                        // intrusive list of live BlockRefs
  size_t live_refs_ = 0;
  bool released_ = false;
  bool forking_keeper_ = false;  // Note [Exit keeper]: set around its fork, in this thread
};

/// Decrements block `index` of `mapping` in shared memory and frees it at zero
/// (Note [Block lifetime]). Thread- and process-safe.
void decref_block(Mapping& mapping, uint32_t index);

uint64_t refcount_underflows();

/// Test hook (Note [Mappings and fork]): the atfork child handler of later forks sleeps
/// `milliseconds` before marking its blocks, widening the window a parent's drop races.
void set_fork_child_delay_for_tests(int milliseconds);
/// Test hook (Note [One critical section per lookup] in registry.cpp): attach() and
/// release_handle() sleep `milliseconds` between mapping a segment and locking to use it.
void set_attach_delay_for_tests(int milliseconds);

}  // namespace torch_mp_ext
