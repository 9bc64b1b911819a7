#include "ipc/fdpass.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "common/check.h"
#include "platform/process.h"

namespace torch_mp_ext {

namespace {
constexpr size_t MAX_FDS_PER_MESSAGE = 64;  // far below the kernel's SCM_MAX_FD (253)
}

void send_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds) {
  TMX_CHECK_VALUE(len > 0, "send_fds needs at least one byte of data");
  TMX_CHECK_VALUE(nfds <= MAX_FDS_PER_MESSAGE, "send_fds: at most ", MAX_FDS_PER_MESSAGE,
                  " fds per message, got ", nfds);
  iovec iov{const_cast<void*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * MAX_FDS_PER_MESSAGE)];
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    std::memset(control, 0, msg.msg_controllen);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * nfds);
  }
  TMX_SYSCHECK(::sendmsg(sock, &msg, MSG_NOSIGNAL), "sendmsg", "SCM_RIGHTS socket");
}

size_t recv_fds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds, size_t max_fds) {
  TMX_CHECK_VALUE(max_fds <= MAX_FDS_PER_MESSAGE, "recv_fds: at most ", MAX_FDS_PER_MESSAGE,
                  " fds per message, got ", max_fds);
  iovec iov{data, len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * MAX_FDS_PER_MESSAGE)];
  if (max_fds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * max_fds);
  }
  auto n = TMX_SYSCHECK(::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC), "recvmsg",
                        "SCM_RIGHTS socket");
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const auto* received = reinterpret_cast<const int*>(CMSG_DATA(cmsg));
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, received + i, sizeof(int));
      fds->emplace_back(fd);
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    throw SyscallError(
        EMFILE, "recvmsg", "SCM_RIGHTS socket",
        detail::str_cat("a file descriptor sent by another process was dropped by the kernel "
                        "because this process is at its open-file limit (RLIMIT_NOFILE=",
                        fd_limit(),
                        "): raise it (ulimit -n) or close received tensors sooner"));
  }
  return static_cast<size_t>(n);
}

}  // namespace torch_mp_ext
