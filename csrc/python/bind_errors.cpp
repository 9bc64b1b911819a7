// C++ exceptions -> Python exceptions of torch_mp_ext.errors (Note [Syscall discipline]).
#include <exception>
#include <stdexcept>

#include "common/errors.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

namespace {

/// `s` as a Python str; bytes that are not UTF-8 become \x escapes. A message can quote what
/// a peer wrote (a forged handle's location): a strict conversion raised UnicodeDecodeError
/// in place of the error being reported.
py::str text(const std::string& s) {
  PyObject* out = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()),
                                       "backslashreplace");
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(out);
}

void raise_from(const char* class_name, const std::string& message) {
  py::object cls = py::module_::import("torch_mp_ext.errors").attr(class_name);
  PyErr_SetObject(cls.ptr(), text(message).ptr());
}

}  // namespace

void init_errors(py::module_& m) {
  (void)m;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const SyscallError& e) {
      // errors.oserror() picks the class: FileNotFoundError for ENOENT, SharedMemoryError
      // for ENOSPC/ENOMEM/EMFILE, ... and keeps errno, the message and the resource name.
      py::object make = py::module_::import("torch_mp_ext.errors").attr("oserror");
      py::object exc = make(e.err(), text(e.what()), text(e.resource()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const CorruptSegmentError& e) {
      raise_from("CorruptSegmentError", e.what());
    } catch (const PeerDiedError& e) {
      raise_from("PeerDiedError", e.what());
    } catch (const std::invalid_argument& e) {
      // TMX_CHECK's ValueError, as pybind11 makes it but with text(): its message can quote
      // a peer's bytes too (an fd-server address read from a handle).
      PyErr_SetObject(PyExc_ValueError, text(e.what()).ptr());
    }
  });
}

}  // namespace torch_mp_ext::python
