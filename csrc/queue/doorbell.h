// SimpleQueue's wake-up pipe, kept by the ring's doorbell word (Note [Doorbell] in ring.h).
#pragma once

#include <cstdint>
#include <functional>

#include "queue/ring.h"

namespace torch_mp_ext {

/// One process's ends of a SimpleQueue's doorbell pipe (non-blocking; the Python object owns
/// and closes them). Each step is a no-op while the ring's doorbell is off.
class Doorbell {
 public:
  /// Items queued, read under the ring's mutex (the caller decides how to wait for it).
  using CountFn = std::function<uint64_t()>;

  Doorbell(int read_fd, int write_fd) : read_fd_(read_fd), write_fd_(write_fd) {}

  /// After a put committed: writes the byte if the word made this process the ringer.
  void after_put(Ring& ring) const;
  /// After a get: claims the word, drains the pipe, then re-rings if items remain or gives
  /// the word back and re-checks like a put.
  void after_get(Ring& ring, const CountFn& count) const;
  /// Someone is about to wait on the pipe: arms the doorbell for every process, then rings
  /// if items are queued and nobody alive owes the byte (repairs a killed ringer's debt).
  void watch(Ring& ring, const CountFn& count) const;

 private:
  void ring_bell() const;
  int read_fd_;
  int write_fd_;
};

}  // namespace torch_mp_ext
