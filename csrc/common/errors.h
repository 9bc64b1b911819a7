// C++ exception types of the core. Only csrc/python/bind_errors.cpp turns them into Python
// exceptions; nothing here knows about Python.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

namespace torch_mp_ext {

/// A failed system call: the errno it left, the call's name and the resource it acted on.
/// Python sees the matching OSError subclass (FileNotFoundError for ENOENT, ...) with
/// `errno`, `strerror` and `filename` set.
class SyscallError : public std::runtime_error {
 public:
  SyscallError(int err, std::string call, std::string resource, std::string hint = "");
  int err() const noexcept { return err_; }
  const std::string& call() const noexcept { return call_; }
  const std::string& resource() const noexcept { return resource_; }
  const std::string& hint() const noexcept { return hint_; }

 private:
  int err_;
  std::string call_;
  std::string resource_;
  std::string hint_;
};

/// Shared memory that is not ours or not of this layout version (bad magic, wrong version,
/// truncated). Python: torch_mp_ext.errors.CorruptSegmentError (a RuntimeError).
class CorruptSegmentError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A peer died while holding a lock on shared state that could not be repaired.
/// Python: torch_mp_ext.errors.PeerDiedError (a RuntimeError).
class PeerDiedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace torch_mp_ext
