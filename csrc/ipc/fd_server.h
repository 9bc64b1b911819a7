// The per-process server that hands out fds of anonymous segments this process created.
//
// Note [fd server]
// Anonymous (file_descriptor strategy) segments have no name, so a receiver that meets one for
// the first time asks its owner for the fd: it connects to the owner's abstract Unix socket
// ("\0tmx-<pid>-<random>", named in the handle), sends (segment id, secret) and gets the fd by
// SCM_RIGHTS; it maps the segment and closes the fd. This happens once per segment per
// process, whatever the number of tensors in the segment (Note [fd budget]). The server is one
// C++ thread, started on first use, that never takes the GIL; it answers only peers of the same
// uid (SO_PEERCRED) that know the segment's random secret. Abstract sockets vanish with their
// process, so nothing is left on disk. The owner must be alive when a receiver first maps a
// segment (as with torch's fd strategy); receivers that already mapped it do not need it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "common/unique_fd.h"

namespace torch_mp_ext {

class FdServer {
 public:
  static FdServer& instance();
  /// The server's address ("@" marks the abstract namespace), starting it on first use.
  std::string address();
  /// The listening socket (-1 if the server never started), for the exit keeper.
  int listen_fd();
  void atfork_prepare() { mu_.lock(); }
  void atfork_parent() { mu_.unlock(); }
  /// In a forked child: forget the parent's server (its thread did not survive the fork).
  void atfork_child();

 private:
  FdServer() = default;
  void serve(int listen_fd);
  void answer(int conn);

  std::mutex mu_;
  std::string address_;
  UniqueFd listen_fd_;
  UniqueFd spare_;  ///< Note [A server at its fd limit] (fd_server.cpp)
};

/// Asks the server at `address` (owner `owner_pid`) for segment `segment_id`'s fd.
UniqueFd fetch_fd(const std::string& address, uint64_t segment_id, uint64_t secret,
                  pid_t owner_pid, double timeout);

}  // namespace torch_mp_ext
