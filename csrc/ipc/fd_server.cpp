#include "ipc/fd_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "ipc/fdpass.h"
#include "platform/process.h"
#include "shm/registry.h"

namespace torch_mp_ext {

namespace {

constexpr double SERVER_IO_TIMEOUT = 5.0;  // a client that stalls longer is dropped

struct Request {
  uint64_t segment_id;
  uint64_t secret;
};

socklen_t make_address(const std::string& address, sockaddr_un* out) {
  TMX_CHECK_VALUE(!address.empty() && address[0] == '@' &&
                      address.size() < sizeof(out->sun_path),
                  "invalid fd-server address '", address, "'");
  std::memset(out, 0, sizeof(*out));
  out->sun_family = AF_UNIX;
  // Abstract namespace: sun_path[0] == '\0', the rest is the name (not NUL-terminated).
  std::memcpy(out->sun_path + 1, address.data() + 1, address.size() - 1);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
}

void set_io_timeout(int fd, double seconds) {
  if (seconds < 0) return;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - static_cast<double>(tv.tv_sec)) * 1e6);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/// Takes the spare fd back after it was used (Note [A server at its fd limit]); while the
/// process stays at its limit it cannot, and the server backs off a little.
void guard_spare(UniqueFd* spare) {
  spare->reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!spare->valid()) ::usleep(10000);
}

/// The soft RLIMIT_NOFILE of process `pid` ("Max open files" in /proc/<pid>/limits), as text;
/// "its limit" when it cannot be read.
std::string fd_limit_of(pid_t pid) {
  char path[48];
  std::snprintf(path, sizeof(path), "/proc/%d/limits", static_cast<int>(pid));
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  char buf[4096];
  ssize_t n = fd.valid() ? ::read(fd.get(), buf, sizeof(buf) - 1) : -1;
  if (n <= 0) return "its limit";
  buf[n] = '\0';
  const char* at = std::strstr(buf, "Max open files");
  if (at == nullptr) return "its limit";
  at += std::strlen("Max open files");
  while (*at == ' ') ++at;
  const char* end = at;
  while (*end != ' ' && *end != '\0' && *end != '\n') ++end;
  return "RLIMIT_NOFILE=" + std::string(at, end);
}

}  // namespace

FdServer& FdServer::instance() {
  static auto* server = new FdServer();  // leaked: its thread may outlive static destructors
  return *server;
}

std::string FdServer::address() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!address_.empty()) return address_;
  char name[64];
  std::snprintf(name, sizeof(name), "@tmx-%d-%016" PRIx64, static_cast<int>(self_pid()),
                random_u64());
  int raw_listen = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (raw_listen < 0) {
    int err = errno;
    throw SyscallError(err, "socket", "fd server",
                       err == EMFILE || err == ENFILE
                           ? detail::str_cat("this process is at its open-file limit "
                                             "(RLIMIT_NOFILE=", fd_limit(), ") and cannot "
                                             "start the server that passes its segments' fds: "
                                             "raise the limit (ulimit -n), free tensors, or "
                                             "use set_sharing_strategy('file_system')")
                           : "");
  }
  UniqueFd fd(raw_listen);
  sockaddr_un addr;
  socklen_t len = make_address(name, &addr);
  TMX_SYSCHECK(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len), "bind", name);
  TMX_SYSCHECK(::listen(fd.get(), 128), "listen", name);
  int raw = fd.get();
  // Opened here, not in the thread: the caller sees every fd the server will hold.
  spare_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  std::thread([this, raw] {
    name_this_thread("tmx-fdserver");
    serve(raw);
  }).detach();
  listen_fd_ = std::move(fd);
  address_ = name;
  return address_;
}

int FdServer::listen_fd() {
  std::lock_guard<std::mutex> lock(mu_);
  return listen_fd_.get();
}

void FdServer::atfork_child() {
  // mu_ was locked by atfork_prepare() in the thread that forked, which is this thread now.
  listen_fd_.reset();
  spare_.reset();
  address_.clear();
  mu_.unlock();
}

void FdServer::serve(int listen_fd) {
  // Note [A server at its fd limit]: a process at its fd limit (each anonymous segment it
  // created holds one) must still answer, or the handles in flight to its blocks could be
  // neither redeemed nor given back, and its blocks would stay live for ever (issue 35 D3).
  // The answer passes the segment's own fd (Registry::with_fd_for), so it needs no new fd;
  // the connection does. So the server keeps one spare fd; at the limit it gives the spare up
  // for the connection and answers it, then takes it back. Only when even that fails (the
  // spare is gone) does a receiver time out, and its error names the owner's limit.
  UniqueFd& spare = spare_;  // only this thread touches it once the server runs
  for (;;) {
    int conn = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0 && (errno == EMFILE || errno == ENFILE) && spare.valid()) {
      spare.reset();
      conn = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn >= 0) {
        UniqueFd guard(conn);
        try {
          answer(conn);
        } catch (...) {
        }
      }
      guard_spare(&spare);
      continue;
    }
    if (conn < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE ||
          errno == ENOBUFS || errno == ENOMEM) {
        if (errno != EINTR && errno != ECONNABORTED) ::usleep(10000);  // back off, retry
        continue;
      }
      return;  // the socket was closed (fork child, shutdown): the server ends
    }
    UniqueFd guard(conn);
    try {
      answer(conn);
    } catch (...) {
      // A misbehaving client must not end the server; it just gets no fd.
    }
  }
}

void FdServer::answer(int conn) {
  set_io_timeout(conn, SERVER_IO_TIMEOUT);
  ucred cred{};
  socklen_t cred_len = sizeof(cred);
  int32_t status = 0;
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0 ||
      (cred.uid != ::geteuid() && cred.uid != 0)) {
    status = EACCES;
  }
  Request req{};
  size_t got = 0;
  while (status == 0 && got < sizeof(req)) {
    ssize_t n = ::recv(conn, reinterpret_cast<char*>(&req) + got, sizeof(req) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    got += static_cast<size_t>(n);
  }
  // The segment's own fd is passed, under the registry mutex, never a dup: an owner at its
  // fd limit (each of its anonymous segments holds one) must still answer, or the handles in
  // flight could be neither redeemed nor given back (issue 35 D3). The answer is a few bytes
  // on an idle socket with a send timeout: it does not block.
  if (status == 0 &&
      Registry::instance().with_fd_for(req.segment_id, req.secret, [&](int fd) {
        send_fds(conn, &status, sizeof(status), &fd, 1);
      })) {
    return;
  }
  if (status == 0) status = ENOENT;
  send_fds(conn, &status, sizeof(status), nullptr, 0);
}

namespace {

UniqueFd fetch_fd_once(const std::string& address, uint64_t segment_id, uint64_t secret,
                       pid_t owner_pid, double timeout) {
  std::string resource = detail::str_cat("shared memory segment ", segment_id,
                                         " of process ", owner_pid, " (fd server ", address,
                                         ")");
  int raw_sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (raw_sock < 0) {
    int err = errno;
    throw SyscallError(err, "socket", resource,
                       err == EMFILE || err == ENFILE
                           ? detail::str_cat("this process is at its open-file limit "
                                             "(RLIMIT_NOFILE=", fd_limit(), ") and cannot "
                                             "receive the segment: free tensors, raise the "
                                             "limit (ulimit -n) or use "
                                             "set_sharing_strategy('file_system')")
                           : "");
  }
  UniqueFd sock(raw_sock);
  set_io_timeout(sock.get(), timeout);
  sockaddr_un addr;
  socklen_t len = make_address(address, &addr);
  for (;;) {
    if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) break;
    int err = errno;
    if (err == EINTR) continue;
    std::string hint;
    if (err == ECONNREFUSED || err == ENOENT) {
      hint = detail::str_cat(
          "the process that created it (pid ", owner_pid,
          ") has exited before this process received the tensor. With the file_descriptor "
          "strategy the sender must stay alive until receivers have rebuilt what it sent; "
          "keep it alive (join it after the receiver is done) or use "
          "set_sharing_strategy('file_system')");
    }
    throw SyscallError(err, "connect", resource, hint);
  }
  // Note [Who answers]: an abstract address is free for anyone once its owner exits, so the
  // answer counts only if the listener is the owner (or its exit keeper, which inherited the
  // owner's socket: SO_PEERCRED reports who called listen(), the owner) and runs as our uid.
  ucred cred{};
  socklen_t cred_len = sizeof(cred);
  TMX_SYSCHECK(::getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_len),
               "getsockopt(SO_PEERCRED)", resource);
  if (cred.uid != ::geteuid() || (owner_pid > 0 && cred.pid != owner_pid)) {
    throw SyscallError(EACCES, "connect", resource,
                       detail::str_cat("the fd server there is pid ", cred.pid, " of uid ",
                                       cred.uid, ", not the segment's owner (pid ", owner_pid,
                                       ", uid ", ::geteuid(),
                                       "): another process took the address; nothing was "
                                       "received from it"));
  }
  Request req{segment_id, secret};
  size_t sent = 0;
  while (sent < sizeof(req)) {
    ssize_t n = ::send(sock.get(), reinterpret_cast<const char*>(&req) + sent,
                       sizeof(req) - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw SyscallError(errno, "send", resource);
    sent += static_cast<size_t>(n);
  }
  int32_t status = -1;
  std::vector<UniqueFd> fds;
  size_t n = 0;
  try {
    n = recv_fds(sock.get(), &status, sizeof(status), &fds, 1);
  } catch (const SyscallError& e) {
    if (e.err() == EAGAIN || e.err() == EWOULDBLOCK) {
      throw SyscallError(ETIMEDOUT, "recvmsg", resource,
                         detail::str_cat("process ", owner_pid, " did not answer within ",
                                         timeout, " s"));
    }
    throw;
  }
  if (n == 0) {  // closed without a word: the owner exited while answering (retried)
    throw SyscallError(ECONNRESET, "recvmsg", resource,
                       "the owner closed the connection without answering");
  }
  if (n != sizeof(status) || status != 0 || fds.size() != 1) {
    int err = (n == sizeof(status) && status > 0) ? status : EPROTO;
    std::string hint = "the owner refused or answered malformed data";
    if (err == ENOENT) hint = "the owner no longer has this segment (it was freed)";
    if (err == EMFILE || err == ENFILE) {
      std::string limit = fd_limit_of(owner_pid);
      hint = detail::str_cat(
          "the sending process (pid ", owner_pid, ") is at its open-file limit (", limit,
          err == ENFILE ? "; the system-wide limit fs.file-max is reached" : "",
          ") and could not pass the segment: raise the sender's limit (ulimit -n, or "
          "resource.setrlimit(resource.RLIMIT_NOFILE, ...) in it), have it free tensors it no "
          "longer needs, or use set_sharing_strategy('file_system'), which passes no fds");
    }
    throw SyscallError(err, "fetch_fd", resource, hint);
  }
  return std::move(fds[0]);
}

}  // namespace

// Note [An owner exiting mid-answer]
// An owner that exits normally with handles in flight leaves an exit keeper listening on
// its socket (Note [Exit keeper]), but a connection its own server thread had already
// accepted dies with it: the receiver reads a reset or an empty answer. That is the one
// case where asking again helps (the keeper answers at the same address), so it is retried
// twice; every other failure is final.
UniqueFd fetch_fd(const std::string& address, uint64_t segment_id, uint64_t secret,
                  pid_t owner_pid, double timeout) {
  for (int attempt = 0;; ++attempt) {
    try {
      return fetch_fd_once(address, segment_id, secret, owner_pid, timeout);
    } catch (const SyscallError& e) {
      if ((e.err() != ECONNRESET && e.err() != EPIPE) || attempt >= 2) throw;
      ::usleep(2000);  // let the exiting owner's keeper take over
    }
  }
}

}  // namespace torch_mp_ext
