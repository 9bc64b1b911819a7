#include "ipc/fd_keeper.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/deadline.h"
#include "shm/session.h"

namespace torch_mp_ext {

namespace {

constexpr int POLL_MS = 50;
constexpr int POLLS_PER_SESSION_CHECK = 5;  // the session's members are looked at every 250 ms

bool any_inflight(const KeptSegment* segments, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (segments[i].header->inflight.load(std::memory_order_acquire) > 0) return true;
  }
  return false;
}

bool needed(int fd, int listen_fd, const KeptSegment* segments, size_t n) {
  if (fd == listen_fd) return true;
  for (size_t i = 0; i < n; ++i) {
    if (segments[i].fd == fd) return true;
  }
  return false;
}

/// Closes every fd except the listening socket and the segment fds; 0-2 go to /dev/null.
void close_others(int listen_fd, const KeptSegment* segments, size_t n) {
  int devnull = ::open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; ++fd) {
    if (!needed(fd, listen_fd, segments, n) && devnull >= 0) ::dup2(devnull, fd);
  }
  if (devnull > 2 && !needed(devnull, listen_fd, segments, n)) ::close(devnull);
  rlimit rl;
  int limit = (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < (1u << 20))
                  ? static_cast<int>(rl.rlim_cur)
                  : (1 << 20);
  int start = 3;
  for (int fd = 3; fd <= limit; ++fd) {
    if (fd == limit || needed(fd, listen_fd, segments, n)) {
      if (fd > start) {
#ifdef SYS_close_range
        if (::syscall(SYS_close_range, start, fd - 1, 0) != 0)
#endif
        {
          for (int f = start; f < fd; ++f) ::close(f);
        }
      }
      start = fd + 1;
    }
  }
}

void answer(int conn, const KeptSegment* segments, size_t n) {
  timeval tv{1, 0};
  ::setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  if (cred.uid != ::geteuid() && cred.uid != 0) return;
  uint64_t request[2];
  size_t got = 0;
  while (got < sizeof(request)) {
    ssize_t r = ::recv(conn, reinterpret_cast<char*>(request) + got, sizeof(request) - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;
    got += static_cast<size_t>(r);
  }
  int fd = -1;
  for (size_t i = 0; i < n; ++i) {
    if (segments[i].segment_id == request[0] && segments[i].secret == request[1]) {
      fd = segments[i].fd;
    }
  }
  int32_t status = fd >= 0 ? 0 : ENOENT;
  iovec iov{&status, sizeof(status)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  }
  while (::sendmsg(conn, &msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

[[noreturn]] void keeper_main(int listen_fd, const KeptSegment* segments, size_t n,
                              double seconds) {
  ::prctl(PR_SET_NAME, "tmx-keeper", 0, 0, 0);
  ::setsid();  // out of the terminal's process group: a Ctrl-C aimed at the job is not ours
  close_others(listen_fd, segments, n);
  const Deadline deadline(seconds > 0 ? seconds : 0.0);
  for (int polls = 1; any_inflight(segments, n) && !deadline.expired(); ++polls) {
    if (polls % POLLS_PER_SESSION_CHECK == 0 && !session_may_have_members()) break;
    pollfd pfd{listen_fd, POLLIN, 0};
    int ready = ::poll(&pfd, 1, POLL_MS);
    if (ready <= 0) continue;
    int conn = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    answer(conn, segments, n);
    ::close(conn);
  }
  ::_exit(0);
}

}  // namespace

pid_t start_exit_keeper(const std::vector<KeptSegment>& segments, int listen_fd,
                        double seconds) {
  if (listen_fd < 0 || seconds <= 0 || !any_inflight(segments.data(), segments.size())) {
    return 0;
  }
  pid_t pid = ::fork();
  if (pid == 0) keeper_main(listen_fd, segments.data(), segments.size(), seconds);
  return pid < 0 ? 0 : pid;  // no keeper if fork failed: receivers get the usual error
}

}  // namespace torch_mp_ext
