#include "shm/sigbus.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>

#include "common/check.h"

namespace torch_mp_ext {

namespace {

// Static TLS (initial-exec): reading it in a signal handler never allocates.
__attribute__((tls_model("initial-exec"))) thread_local int t_depth = 0;
__attribute__((tls_model("initial-exec"))) thread_local uintptr_t t_lost = 0;

struct sigaction g_previous;  // written before our handler is installed, read in it
uintptr_t g_page = 4096;     // likewise
std::atomic<unsigned long> g_pages_lost{0};
std::mutex g_install_mu;

void chain(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it and return; the faulting access runs again and the kernel
  // delivers the SIGBUS for real (core dump and all), as if we had never been here.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  if (info->si_code <= 0) ::raise(sig);  // sent by kill(): it would not come again
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  int saved = errno;
  if (t_depth > 0 && info->si_code == BUS_ADRERR) {
    auto at = reinterpret_cast<uintptr_t>(info->si_addr) & ~(g_page - 1);
    void* p = ::mmap(reinterpret_cast<void*>(at), g_page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p != MAP_FAILED) {
      if (t_lost == 0) t_lost = reinterpret_cast<uintptr_t>(info->si_addr) | 1;
      g_pages_lost.fetch_add(1, std::memory_order_relaxed);
      errno = saved;
      return;
    }
  }
  errno = saved;
  chain(sig, info, context);
}

}  // namespace

void install_sigbus_handler() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  struct sigaction now {};
  TMX_SYSCHECK(::sigaction(SIGBUS, nullptr, &now), "sigaction", "SIGBUS");
  if ((now.sa_flags & SA_SIGINFO) != 0 && now.sa_sigaction == &on_sigbus) return;
  struct sigaction ours {};
  ours.sa_sigaction = &on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&ours.sa_mask);
  // g_previous must be complete before a SIGBUS can reach on_sigbus: block it meanwhile.
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGBUS);
  ::pthread_sigmask(SIG_BLOCK, &block, &old);
  g_previous = now;
  g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  int rc = ::sigaction(SIGBUS, &ours, nullptr);
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  TMX_SYSCHECK(rc, "sigaction", "SIGBUS");
}

SigbusGuard::SigbusGuard() noexcept : outer_(t_depth++ == 0) {
  if (outer_) t_lost = 0;
}

SigbusGuard::~SigbusGuard() {
  --t_depth;
  if (outer_) t_lost = 0;
}

void SigbusGuard::check(const char* what) {
  if (!outer_ || t_lost == 0) return;
  uintptr_t at = t_lost & ~uintptr_t{1};
  t_lost = 0;
  throw CorruptSegmentError(detail::str_cat(
      "a shared-memory file was truncated under this process while it ", what,
      " (no page behind address 0x", std::hex, at, std::dec,
      "): another process shrank a /dev/shm segment it still maps. The segment is unusable "
      "here; its tensors must not be read (that would be a SIGBUS). Use the file_descriptor "
      "sharing strategy (sealed memfds cannot shrink) or find what truncates /dev/shm files"));
}

bool SigbusGuard::lost() const noexcept { return t_lost != 0; }

unsigned long sigbus_pages_lost() { return g_pages_lost.load(std::memory_order_relaxed); }

}  // namespace torch_mp_ext
