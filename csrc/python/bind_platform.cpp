#include <pybind11/stl.h>

#include "platform/compat.h"
#include "platform/process.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

void init_platform(py::module_& m) {
  m.def("set_pdeathsig", &set_pdeathsig, py::arg("signum"),
        R"pbdoc(prctl(PR_SET_PDEATHSIG, signum): get `signum` when the parent thread exits.)pbdoc");
  m.def("kill_self_when_process_exits", &kill_self_when_process_exits, py::arg("pid"),
        R"pbdoc(A native thread SIGKILLs this process when process `pid` (not a thread) ends.)pbdoc");
  m.def("process_start_time", &process_start_time, py::arg("pid"),
        R"pbdoc(Start time of `pid` in clock ticks since boot, 0 if unknown.)pbdoc");
  m.def(
      "process_alive",
      [](int pid, uint64_t start_time) {
        return process_alive(pid, static_cast<uint32_t>(start_time));
      },
      py::arg("pid"), py::arg("start_time") = 0,
      R"pbdoc(True if `pid` exists (and started at `start_time` when given).)pbdoc");
  m.def("pid_namespace_id", &pid_namespace_id);
  m.def("holder_key", &self_key,
        R"pbdoc(This process's identity: pid << 32 | low 32 bits of its start time.)pbdoc");
  m.def("fd_limit", &fd_limit, R"pbdoc(The RLIMIT_NOFILE soft limit.)pbdoc");
  m.def(
      "platform_features",
      [] {
        py::dict d;
        d["fallbacks_forced"] = fallbacks_forced();
        d["clocklock"] = has_clocklock();
        d["seals"] = seals_usable();
        d["pidfd"] = pidfd_usable();
        return d;
      },
      R"pbdoc(Which calls above the platform floor are used (False: their fallback), and whether
TORCH_MP_EXT_FALLBACKS=1 forced every fallback (Note [Platform floor] in platform/compat.h).)pbdoc");
}

}  // namespace torch_mp_ext::python
