// The only place besides csrc/python/*.cpp that knows pybind11 exists.
//
// Note [Waiting without the GIL]
// A blocking call of the core must neither hold the GIL (the other Python threads run while
// it waits) nor stay deaf to signals (Ctrl-C must interrupt a queue get() or a channel read).
// The core cannot run Python's signal handlers, so every blocking call returns to the binding
// now and then: when a signal interrupted its futex wait (EINTR) and when a wait slice ended
// (the ring slices its waits itself; the channel is given slices of the caller's deadline).
// wait_without_gil() is the one loop around such a call: it runs one step without the GIL,
// and while the step's answer means "not done yet", runs the signal handlers with the GIL
// (their exception, KeyboardInterrupt, propagates) and steps again.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>

namespace torch_mp_ext::python {

/// Runs `step()` with the GIL released until `again(answer)` is false, checking for signals
/// between steps (Note [Waiting without the GIL]); returns the last answer.
template <typename Step, typename Again>
auto wait_without_gil(Step&& step, Again&& again) -> decltype(step()) {
  for (;;) {
    decltype(step()) answer;
    {
      pybind11::gil_scoped_release nogil;
      answer = step();
    }
    if (!again(answer)) return answer;
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

void init_errors(pybind11::module_& m);
void init_shm(pybind11::module_& m);
void init_ipc(pybind11::module_& m);
void init_platform(pybind11::module_& m);
void init_exchange(pybind11::module_& m);
void init_queue(pybind11::module_& m);
void init_numpy(pybind11::module_& m);

}  // namespace torch_mp_ext::python
