// The file-size limit and shared-memory files (Note [File size limit]).
//
// Note [File size limit]
// RLIMIT_FSIZE (`ulimit -f`, set by batch schedulers) bounds every file a process makes,
// memfds and /dev/shm files included, and a process that ftruncates past it is sent SIGXFSZ,
// whose default action kills it (Python ignores it, so there it is EFBIG; a program that
// embeds Python may not). So sizes are checked against the limit first, and a request past
// it is EFBIG naming the limit, with no signal. Growable rings ask for less address space
// when refused (queues/ring_queue.py: _sparse_block).
#pragma once

#include <cstdint>
#include <string>

namespace torch_mp_ext {

/// Whether this process may make a file of `size` bytes (one getrlimit).
bool file_size_allowed(uint64_t size);

/// Throws SharedMemoryError-to-be (SyscallError EFBIG, "ftruncate") naming the limit and the
/// fix, for a file of `size` bytes that file_size_allowed refused.
[[noreturn]] void throw_file_too_big(uint64_t size, const std::string& resource);

}  // namespace torch_mp_ext
