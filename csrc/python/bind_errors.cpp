// C++ exceptions -> Python exceptions of torch_mp_ext.errors (Note [Syscall discipline]).
#include <exception>

#include "common/errors.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

namespace {

void raise_from(const char* class_name, const std::string& message) {
  py::object cls = py::module_::import("torch_mp_ext.errors").attr(class_name);
  PyErr_SetObject(cls.ptr(), py::str(message).ptr());
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
      py::object exc = make(e.err(), e.what(), e.resource());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const CorruptSegmentError& e) {
      raise_from("CorruptSegmentError", e.what());
    } catch (const PeerDiedError& e) {
      raise_from("PeerDiedError", e.what());
    }
  });
}

}  // namespace torch_mp_ext::python
