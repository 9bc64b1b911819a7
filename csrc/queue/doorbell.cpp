#include "queue/doorbell.h"

#include <unistd.h>

#include <cerrno>

#include "common/errors.h"
#include "queue/ring_internal.h"

namespace torch_mp_ext {

void Doorbell::ring_bell() const {
  const char byte = 0;
  for (;;) {
    if (::write(write_fd_, &byte, 1) == 1) return;
    if (errno == EINTR) continue;
    if (errno == EAGAIN) return;  // the pipe is full of rings: readable already
    throw SyscallError(errno, "write", "a SimpleQueue's wake-up pipe");
  }
}

void Doorbell::after_put(Ring& ring) const {
  if (!ring.doorbell_should_ring()) return;
  maybe_crash(CrashPoint::BellNoByte);
  ring_bell();
}

void Doorbell::after_get(Ring& ring, const CountFn& count) const {
  if (!ring.doorbell_claim()) return;  // off: nobody has watched the pipe yet
  char sink[256];
  for (;;) {
    ssize_t n = ::read(read_fd_, sink, sizeof(sink));
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || errno == EAGAIN) break;
    throw SyscallError(errno, "read", "a SimpleQueue's wake-up pipe");
  }
  maybe_crash(CrashPoint::BellDrained);
  if (count() > 0) {
    ring_bell();  // the word names us: a put meanwhile left the byte to us
    return;
  }
  ring.doorbell_release();
  if (count() > 0) after_put(ring);
}

void Doorbell::watch(Ring& ring, const CountFn& count) const {
  ring.doorbell_arm();
  if (count() > 0) after_put(ring);
}

}  // namespace torch_mp_ext
