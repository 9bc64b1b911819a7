#include "common/errors.h"

#include <cstring>

namespace torch_mp_ext {

namespace {
std::string describe(int err, const std::string& call, const std::string& resource,
                     const std::string& hint) {
  std::string msg = call + "(" + resource + ") failed: " + std::strerror(err);
  if (!hint.empty()) msg += ". " + hint;
  return msg;
}
}  // namespace

SyscallError::SyscallError(int err, std::string call, std::string resource, std::string hint)
    : std::runtime_error(describe(err, call, resource, hint)),
      err_(err),
      call_(std::move(call)),
      resource_(std::move(resource)),
      hint_(std::move(hint)) {}

}  // namespace torch_mp_ext
