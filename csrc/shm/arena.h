// The pooled shared-memory arena: many blocks per segment, recycled across processes.
//
// Note [Arena size classes]
// Requests up to SMALL_MAX bytes are rounded up to a power of two (at least MIN_BLOCK) and
// served from slab segments of about SLAB_BYTES holding many blocks of that class. Larger
// requests get a segment of their own, its size rounded up to 1/8 of the next power of two, so
// a freed 100 MB block serves the next 95-100 MB request without a new segment. Segments of
// the file_descriptor strategy are anonymous and pooled: a block freed in any process returns
// to its segment's free stack and the owner hands it out again, already mapped and faulted in.
// Fully free segments are kept up to the cache limit (TORCH_MP_EXT_ARENA_CACHE_BYTES, default
// 1 GiB), then retired; empty_cache() retires them all. file_system blocks are pooled the same
// way in named segments of their own pools (Note [Pooled names]).
//
// Note [Pooled names]
// A file_system block lives in a named slab (or, past SMALL_MAX, a named segment of one
// block) that outlives the block: freed, it goes back on the free stack and the owner hands
// it out again, and receivers keep their mapping of the name (an idle mapping, as for
// anonymous segments), so a hand-off maps nothing new once the pool is warm. The name goes:
// - when its owner retires the segment with no block live: nothing can name it any more (a
//   handle in flight holds a reference, so a live block). Besides trim, empty_cache() and
//   normal exit, a thread of the owner's (checking every NAMED_TICK_MS) retires every named
//   segment it finds fully free that no other live process maps (nothing gains from keeping
//   it: its name goes within a tick of its last tensor, as torch's would, so leak checks
//   that wait for the names of exited workers see them go; issue 26), every named segment
//   that stayed fully free for TORCH_MP_EXT_NAMED_CACHE_S seconds (default 10), and
//   the longest idle ones while free named segments hold more than a quarter of /dev/shm
//   (named_budget(): /dev/shm is often small, and torch's own segments need it too). So
//   names still go soon after their tensors, as torch's file_system users (and PyTorch's
//   own leak checks, which wait 30 s) expect, while a loop that shares a tensor every few
//   seconds finds its segment still mapped. With 0 nothing named is pooled: each block is a
//   segment of its own whose name goes with its last reference, as in torch;
// - otherwise with the last holder that unmaps it once its owner is gone and nothing in flight
//   names it (maybe_reap_on_unmap: the owner is a registered holder while it keeps the
//   segment), or at a join's run-time reclaim (Note [Reclaiming names at run time]) or the
//   session's sweep (Note [Session names]) when that holder was killed too.
// So a killed owner's cached free segments, which nobody else maps, go at the next join.
//
// Note [Reclaiming off the allocation path]
// Blocks that dead receivers held come back when someone reaps their holder slots (Note
// [Dead holders]), which means judging every holder of every segment: a /proc read each.
// Done on the allocation path whenever a pool ran dry, that made each allocation cost
// O(segments held by others): 15-35 ms with 1,500 segments kept by a live consumer (a replay
// buffer), against 0.3 ms with 20 (issue 26). So a dry pool only wakes the owner's reclaim
// thread and allocates a new segment at once; the thread snapshots the pools (shared_ptrs:
// they stay mapped), reaps without the arena or registry mutex, judging each process once
// per pass, and sleeps RECLAIM_INTERVAL_MS before it looks at the next request (idle, it
// waits on a condition variable and costs nothing). empty_cache() still reclaims at once.
// Its snapshot keeps segments (their fds and mappings) alive for the length of a pass: an
// allocation that failed for room waits for the pass (reclaim_pass_mu_) before it retries.
// What dead receivers held is back within about that interval, and the next allocations
// find it; meanwhile at most the segments that interval needs are made.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "shm/registry.h"

namespace torch_mp_ext {

constexpr size_t MIN_BLOCK = 512;
constexpr size_t SMALL_MAX = 256 * 1024;
constexpr size_t SLAB_BYTES = 2 * 1024 * 1024;
constexpr size_t DEFAULT_CACHE_LIMIT = size_t{1} << 30;
/// Note [Pooled names]: how long a fully free named segment waits for reuse, and the period of
/// the thread that checks.
constexpr double DEFAULT_NAMED_IDLE_S = 10.0;
constexpr int NAMED_TICK_MS = 250;
constexpr int RECLAIM_INTERVAL_MS = 250;  ///< Note [Reclaiming off the allocation path]

struct ArenaStats {
  size_t segments = 0;
  size_t reserved_bytes = 0;     ///< bytes of all owned segments
  size_t cached_free_bytes = 0;  ///< bytes of owned segments with no live block
  size_t live_blocks = 0;
  size_t cache_limit = 0;
};

/// Process-wide allocator; thread-safe.
class Arena {
 public:
  static Arena& instance();

  /// A new block of at least `nbytes` bytes with refcount 1, owned by the caller.
  /// `named`: from a named (file_system) segment, else an anonymous one; both are pooled.
  std::unique_ptr<BlockRef> allocate(size_t nbytes, bool named);
  /// A block of `nbytes` of which only the first `reserved` bytes have pages now: a segment
  /// of its own, never pooled with others (Note [Ring growth] in queue/ring.h). Fully free
  /// sparse segments of the same size are reused (their sparse part emptied first).
  std::unique_ptr<BlockRef> allocate_sparse(size_t nbytes, size_t reserved, bool named);
  /// Reclaims dead holders' references, then retires every owned segment with no live block;
  /// returns the bytes released.
  size_t empty_cache();
  ArenaStats stats();

  static uint64_t class_size(size_t nbytes);
  static uint32_t blocks_per_segment(uint64_t block_size);

  void atfork_prepare() { mu_.lock(); }
  void atfork_parent() { mu_.unlock(); }
  void atfork_child();

 private:
  Arena();
  std::unique_ptr<BlockRef> take_locked(const std::shared_ptr<Mapping>& mapping);
  /// Drops dead processes' references on `segments` (Note [Dead holders]).
  size_t reclaim_locked(const std::vector<std::shared_ptr<Mapping>>& segments);
  size_t trim_locked(size_t keep_bytes);
  std::shared_ptr<Mapping> new_segment_locked(uint64_t block_size, bool named);
  /// Takes `mapping` out of its pool and retires it (by value: callers may pass the pool's
  /// own element).
  void retire_pooled_locked(std::shared_ptr<Mapping> mapping);
  /// A named segment of one block whose name goes with its last reference (named_idle_s_ 0).
  std::unique_ptr<BlockRef> allocate_dedicated(size_t nbytes);
  /// The expiry thread's loop (Note [Pooled names]); returns once no named segment is pooled.
  void expire_named();
  void request_reclaim_locked();
  void reclaim_loop();
  /// Bytes of fully free named segments the expiry thread lets stay: a quarter of /dev/shm,
  /// at most the cache limit.
  size_t named_budget();
  /// Retires the sparse segments none of whose block is in use; returns their bytes.
  size_t retire_free_sparse_locked();
  /// create_segment, retried once after dropping cached free segments when it failed for
  /// lack of room or fds.
  std::shared_ptr<Mapping> create_or_trim_locked(const SegmentSpec& spec);

  std::mutex mu_;
  /// Owned pooled segments by (block size, named), largest classes last.
  std::map<std::pair<uint64_t, bool>, std::vector<std::shared_ptr<Mapping>>> pools_;
  std::vector<std::shared_ptr<Mapping>> sparse_;  ///< owned anonymous sparse segments
  size_t cache_limit_ = DEFAULT_CACHE_LIMIT;
  /// Seconds a fully free named segment stays pooled (TORCH_MP_EXT_NAMED_CACHE_S).
  double named_idle_s_ = DEFAULT_NAMED_IDLE_S;
  bool expiry_running_ = false;  ///< an expiry thread watches the named pools
  std::condition_variable reclaim_cv_;  ///< with mu_: Note [Reclaiming off the allocation path]
  bool reclaim_wanted_ = false;
  std::mutex reclaim_pass_mu_;  ///< held by a reclaim pass (after mu_ in the lock order)
  bool reclaimer_running_ = false;
};

}  // namespace torch_mp_ext
