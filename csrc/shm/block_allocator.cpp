#include "shm/block_allocator.h"

#include <pthread.h>

#include <cstdlib>
#include <cstring>

#include "shm/arena.h"

namespace torch_mp_ext {

BlockAllocator& BlockAllocator::instance() {
  static auto* allocator = new BlockAllocator();  // leaked: arrays may die during exit
  return *allocator;
}

BlockAllocator::BlockAllocator() {
  // mu_ is a leaf lock, but a fork while another thread holds it would leave it locked.
  ::pthread_atfork([] { BlockAllocator::instance().mu_.lock(); },
                   [] { BlockAllocator::instance().mu_.unlock(); },
                   [] { BlockAllocator::instance().mu_.unlock(); });
}

void BlockAllocator::set_min_bytes(size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  min_bytes_ = nbytes == 0 ? 1 : nbytes;
}

void* BlockAllocator::allocate(size_t nbytes, bool zero) noexcept {
  if (nbytes >= min_bytes_) {
    try {
      std::unique_ptr<BlockRef> ref = Arena::instance().allocate(nbytes, false);
      void* ptr = ref->data();
      if (zero) std::memset(ptr, 0, nbytes);  // a recycled block holds its last user's bytes
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace(ptr, std::move(ref));
      return ptr;
    } catch (...) {  // no shared memory to be had: private memory still works
    }
  }
  if (nbytes == 0) nbytes = 1;
  return zero ? std::calloc(nbytes, 1) : std::malloc(nbytes);
}

std::unique_ptr<BlockRef> BlockAllocator::take(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) return nullptr;
  std::unique_ptr<BlockRef> ref = std::move(it->second);
  blocks_.erase(it);
  return ref;
}

void* BlockAllocator::reallocate(void* ptr, size_t nbytes) noexcept {
  if (ptr == nullptr) return allocate(nbytes, false);
  std::unique_ptr<BlockRef> old;
  try {
    old = take(ptr);
  } catch (...) {
    return nullptr;
  }
  if (old == nullptr) return std::realloc(ptr, nbytes == 0 ? 1 : nbytes);
  if (nbytes <= old->capacity() && nbytes >= min_bytes_) {  // fits: keep the block
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.emplace(ptr, std::move(old));
    return ptr;
  }
  void* fresh = allocate(nbytes, false);
  if (fresh == nullptr) {  // realloc leaves the old memory valid on failure
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.emplace(ptr, std::move(old));
    return nullptr;
  }
  std::memcpy(fresh, ptr, nbytes < old->capacity() ? nbytes : old->capacity());
  return fresh;  // `old` drops its reference here
}

void BlockAllocator::release(void* ptr) noexcept {
  if (ptr == nullptr) return;
  try {
    if (take(ptr) != nullptr) return;  // the BlockRef dies here, outside mu_
  } catch (...) {
    return;
  }
  std::free(ptr);
}

size_t BlockAllocator::live_blocks() {
  std::lock_guard<std::mutex> lock(mu_);
  return blocks_.size();
}

}  // namespace torch_mp_ext
