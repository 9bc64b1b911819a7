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
// 1 GiB), then retired; empty_cache() retires them all. file_system blocks are never pooled:
// each is a named segment of its own that vanishes with its last reference, as in torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "shm/registry.h"

namespace torch_mp_ext {

constexpr size_t MIN_BLOCK = 512;
constexpr size_t SMALL_MAX = 256 * 1024;
constexpr size_t SLAB_BYTES = 2 * 1024 * 1024;
constexpr size_t DEFAULT_CACHE_LIMIT = size_t{1} << 30;

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
  /// `named`: a file_system (named, unpooled) segment; otherwise an anonymous pooled block.
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
  std::shared_ptr<Mapping> new_segment_locked(uint64_t block_size);
  /// Retires the sparse segments none of whose block is in use; returns their bytes.
  size_t retire_free_sparse_locked();
  /// create_segment, retried once after dropping cached free segments when it failed for
  /// lack of room or fds.
  std::shared_ptr<Mapping> create_or_trim_locked(const SegmentSpec& spec);

  std::mutex mu_;
  std::map<uint64_t, std::vector<std::shared_ptr<Mapping>>> pools_;
  std::vector<std::shared_ptr<Mapping>> sparse_;  ///< owned anonymous sparse segments
  size_t cache_limit_ = DEFAULT_CACHE_LIMIT;
};

}  // namespace torch_mp_ext
