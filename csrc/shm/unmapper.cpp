#include "shm/unmapper.h"

#include <pthread.h>
#include <sys/mman.h>

#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "platform/process.h"

namespace torch_mp_ext {

namespace {

class Unmapper {
 public:
  static Unmapper& instance() {
    // Never destroyed: the thread may still be waiting when static destructors run.
    static Unmapper* unmapper = new Unmapper();
    return *unmapper;
  }

  void push(void* base, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      std::thread([this] {
        name_this_thread("tmx-unmapper");
        run();
      }).detach();
      started_ = true;
    }
    pending_.emplace_back(base, size);
    cv_.notify_one();
  }

  size_t finish() {
    std::unique_lock<std::mutex> lock(mu_);
    size_t bytes = busy_bytes_;
    std::vector<std::pair<void*, size_t>> mine;
    mine.swap(pending_);
    for (const auto& p : mine) bytes += p.second;
    lock.unlock();
    for (const auto& p : mine) ::munmap(p.first, p.second);
    lock.lock();
    idle_.wait(lock, [this] { return busy_bytes_ == 0; });
    return bytes;
  }

 private:
  Unmapper() {
    // No prepare handler: holding mu_ across fork() would order it before the registry's
    // mutex (handlers run in reverse order of registration), while a thread holding that
    // mutex may be unmapping into this queue. The child rebuilds everything instead.
    ::pthread_atfork(nullptr, nullptr, [] { instance().after_fork_in_child(); });
  }

  void after_fork_in_child() {
    // The parent's ranges were MADV_DONTFORK: none of them exists here. Forget them, and
    // the thread (it was not forked). Another parent thread may have held the lock or been
    // changing the list at fork time: make new ones, leaking the old list's buffer.
    new (&mu_) std::mutex();
    new (&cv_) std::condition_variable();
    new (&idle_) std::condition_variable();
    new (&pending_) std::vector<std::pair<void*, size_t>>();
    busy_bytes_ = 0;
    started_ = false;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return !pending_.empty(); });
      auto [base, size] = pending_.back();
      pending_.pop_back();
      busy_bytes_ = size;
      lock.unlock();
      ::munmap(base, size);
      lock.lock();
      busy_bytes_ = 0;
      idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;    ///< work arrived
  std::condition_variable idle_;  ///< an unmap in progress finished
  std::vector<std::pair<void*, size_t>> pending_;
  size_t busy_bytes_ = 0;
  bool started_ = false;
};

}  // namespace

void unmap_later(void* base, size_t size) {
  if (size < DEFERRED_UNMAP_BYTES || ::madvise(base, size, MADV_DONTFORK) != 0) {
    ::munmap(base, size);
    return;
  }
  try {
    Unmapper::instance().push(base, size);
  } catch (...) {  // no thread or no memory for the list: unmap here, as before
    ::munmap(base, size);
  }
}

size_t finish_pending_unmaps() { return Unmapper::instance().finish(); }

}  // namespace torch_mp_ext
