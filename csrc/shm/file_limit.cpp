#include "shm/file_limit.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstdio>

#include "common/check.h"

namespace torch_mp_ext {

bool file_size_allowed(uint64_t size) {
  struct rlimit fsize {};
  if (::getrlimit(RLIMIT_FSIZE, &fsize) != 0 || fsize.rlim_cur == RLIM_INFINITY) return true;
  return size <= static_cast<uint64_t>(fsize.rlim_cur);
}

void throw_file_too_big(uint64_t size, const std::string& resource) {
  struct rlimit fsize {};
  ::getrlimit(RLIMIT_FSIZE, &fsize);
  char gib[32];
  std::snprintf(gib, sizeof(gib), "%.1f GiB", static_cast<double>(size) / (1ull << 30));
  throw SyscallError(
      EFBIG, "ftruncate", resource,
      detail::str_cat("a shared-memory file of ", size, " bytes (", gib,
                      ") exceeds this process's file-size limit (RLIMIT_FSIZE=",
                      fsize.rlim_cur, " bytes, ulimit -f): raise it (ulimit -f unlimited, or "
                      "resource.setrlimit(resource.RLIMIT_FSIZE, ...)) or ask for less"));
}

}  // namespace torch_mp_ext
