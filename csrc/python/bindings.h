// The only place besides csrc/python/*.cpp that knows pybind11 exists.
#pragma once

#include <pybind11/pybind11.h>

namespace torch_mp_ext::python {

void init_errors(pybind11::module_& m);
void init_shm(pybind11::module_& m);
void init_ipc(pybind11::module_& m);
void init_platform(pybind11::module_& m);
void init_exchange(pybind11::module_& m);
void init_queue(pybind11::module_& m);
void init_numpy(pybind11::module_& m);

}  // namespace torch_mp_ext::python
