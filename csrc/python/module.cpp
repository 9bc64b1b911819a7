#include "python/bindings.h"
#include "shm/registry.h"

#ifndef VERSION_INFO
#define VERSION_INFO "0.0.0+unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = R"pbdoc(
    torch_mp_ext._C: the C++ core (segments, arena, queue rings, fd passing, counters,
    platform helpers).

    Private: use the torch_mp_ext package. Nothing here includes torch or CUDA headers.
  )pbdoc";
  m.attr("__version__") = VERSION_INFO;
  torch_mp_ext::Registry::instance();  // installs the fork handlers before any segment exists
  torch_mp_ext::python::init_errors(m);
  torch_mp_ext::python::init_platform(m);
  torch_mp_ext::python::init_shm(m);
  torch_mp_ext::python::init_ipc(m);
  torch_mp_ext::python::init_exchange(m);
  torch_mp_ext::python::init_queue(m);
  torch_mp_ext::python::init_numpy(m);
}
