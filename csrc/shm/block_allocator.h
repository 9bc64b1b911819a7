// malloc-like allocation over arena blocks, for other libraries' allocators (Note [Arrays born
// shared]).
//
// Note [Arrays born shared]
// An array that a pipeline stage computes with numpy lives in private memory, so sending it
// costs a copy into a block, and for large arrays that copy (cache-cold, in another process
// than the one that reads it next) costs about as much as the numpy operation that made it.
// numpy lets a thread route its array allocations through a handler (NEP 49,
// PyDataMem_SetHandler); torch_mp_ext's handler (python/bind_numpy.cpp) calls this
// allocator, which serves requests of at least min_bytes from arena blocks and smaller ones
// from the C heap. An array born in a block is pickled as a handle (reductions.py finds its
// block by address): sending it copies nothing, and the block is recycled through its owner's
// pool, already mapped and faulted in, once the last process drops it.
//
// Each block served is one BlockRef kept here under the data pointer handed out; free()
// destroys it, dropping this process's reference (a message in flight or a receiver may
// still hold others). Unknown pointers go to the C heap. Failures to allocate a block fall
// back to the C heap too: a handler must never throw into numpy.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "shm/registry.h"

namespace torch_mp_ext {

class BlockAllocator {
 public:
  static BlockAllocator& instance();

  /// Requests of at least this many bytes get a block (others the C heap). Thread-safe.
  void set_min_bytes(size_t nbytes);
  size_t min_bytes() const { return min_bytes_; }

  /// malloc/calloc (zero=true): never throws; nullptr only if the C heap fails too.
  void* allocate(size_t nbytes, bool zero) noexcept;
  /// realloc semantics for pointers from allocate(); never throws.
  void* reallocate(void* ptr, size_t nbytes) noexcept;
  /// free semantics for pointers from allocate(); never throws.
  void release(void* ptr) noexcept;

  /// Blocks handed out and not yet released. Thread-safe.
  size_t live_blocks();

 private:
  BlockAllocator();
  std::unique_ptr<BlockRef> take(void* ptr);

  std::mutex mu_;  // a leaf: never held while calling into the arena or the registry
  std::unordered_map<void*, std::unique_ptr<BlockRef>> blocks_;
  size_t min_bytes_ = 64 * 1024;
};

}  // namespace torch_mp_ext
