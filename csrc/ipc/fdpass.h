// Passing file descriptors between processes over Unix sockets (SCM_RIGHTS).
#pragma once

#include <cstddef>
#include <vector>

#include "common/unique_fd.h"

namespace torch_mp_ext {

/// Sends `len` bytes (at least 1) with `nfds` descriptors attached. Retries EINTR; throws
/// SyscallError.
void send_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds);

/// Receives up to `len` bytes and up to `max_fds` descriptors (close-on-exec). Returns the byte
/// count (0 at EOF). Descriptors the kernel had to drop because this process is at its fd
/// limit are an error (EMFILE) that names the limit and the alternatives, never a silent loss.
size_t recv_fds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds, size_t max_fds);

}  // namespace torch_mp_ext
