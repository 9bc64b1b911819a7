// Precondition and syscall checks (Note [Syscall discipline]).
//
// Note [Syscall discipline]
// Every system call of the core goes through TMX_SYSCHECK: it retries on EINTR, keeps errno
// and throws SyscallError naming the call and the resource. errno is only read when the call
// reported failure (it is meaningless otherwise). Code that must undo partial work catches,
// rolls back, and rethrows; it never lets a half-built object escape.
#pragma once

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>

#include "common/errors.h"

namespace torch_mp_ext::detail {

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

}  // namespace torch_mp_ext::detail

/// Throws std::invalid_argument (Python ValueError) with the message built from the rest.
#define TMX_CHECK_VALUE(cond, ...)                                                        \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      throw std::invalid_argument(::torch_mp_ext::detail::str_cat(__VA_ARGS__));          \
    }                                                                                     \
  } while (0)

/// Throws std::logic_error (Python RuntimeError): an internal invariant broke.
#define TMX_CHECK(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      throw std::logic_error(::torch_mp_ext::detail::str_cat(                             \
          "torch_mp_ext internal error at " __FILE__ ":", __LINE__, ": ", __VA_ARGS__));  \
    }                                                                                     \
  } while (0)

/// Runs `expr` (a syscall returning -1 on failure), retrying on EINTR; on failure throws
/// SyscallError(errno, call, resource). Evaluates to the call's result.
#define TMX_SYSCHECK(expr, call, resource)                                                \
  ([&]() {                                                                                \
    for (;;) {                                                                            \
      auto tmx_rc_ = (expr);                                                              \
      if (tmx_rc_ != -1) return tmx_rc_;                                                  \
      int tmx_err_ = errno;                                                               \
      if (tmx_err_ == EINTR) continue;                                                    \
      throw ::torch_mp_ext::SyscallError(tmx_err_, (call), (resource));                   \
    }                                                                                     \
  }())
