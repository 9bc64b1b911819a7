#include <pybind11/stl.h>

#include <vector>

#include "ipc/counters.h"
#include "ipc/fd_server.h"
#include "ipc/fdpass.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

void init_ipc(py::module_& m) {
  m.def(
      "send_fds",
      [](int sock, py::bytes data, std::vector<int> fds) {
        std::string payload = data;
        py::gil_scoped_release nogil;
        send_fds(sock, payload.data(), payload.size(), fds.data(), fds.size());
      },
      py::arg("sock"), py::arg("data"), py::arg("fds"),
      R"pbdoc(Sends `data` with `fds` attached (SCM_RIGHTS) on a connected Unix socket.)pbdoc");
  m.def(
      "recv_fds",
      [](int sock, size_t maxlen, size_t max_fds) {
        std::string buffer(maxlen, '\0');
        std::vector<UniqueFd> fds;
        size_t n;
        {
          py::gil_scoped_release nogil;
          n = recv_fds(sock, buffer.data(), buffer.size(), &fds, max_fds);
        }
        std::vector<int> raw;
        for (auto& fd : fds) raw.push_back(fd.release());
        return py::make_tuple(py::bytes(buffer.data(), n), raw);
      },
      py::arg("sock"), py::arg("maxlen"), py::arg("max_fds"),
      R"pbdoc(Receives (data, fds); the caller owns (and must close) the fds.)pbdoc");
  m.def("fd_server_address", [] { return FdServer::instance().address(); },
        R"pbdoc(This process's fd-server address, starting the server if needed.)pbdoc");
  m.def(
      "fetch_fd",
      [](const std::string& address, uint64_t segment_id, uint64_t secret, int owner_pid,
         double timeout) {
        py::gil_scoped_release nogil;
        return fetch_fd(address, segment_id, secret, owner_pid, timeout).release();
      },
      py::arg("address"), py::arg("segment_id"), py::arg("secret"), py::arg("owner_pid"),
      py::arg("timeout") = 30.0,
      R"pbdoc(Asks an fd server for a segment's fd (the caller owns the returned fd).)pbdoc");

  py::class_<CounterFile, std::shared_ptr<CounterFile>>(m, "CounterFile", R"pbdoc(
    Shared slots of atomic counts (Note [Counter files]); the CUDA keep-alive primitive.
  )pbdoc")
      .def_static("create", &CounterFile::create, py::arg("nslots"))
      .def_static("open", &CounterFile::open, py::arg("name"), py::arg("segment_id") = 0)
      .def(
          "acquire",
          [](CounterFile& self, int64_t initial, uint64_t tag) -> py::object {
            uint32_t slot = 0, generation = 0;
            if (!self.acquire(initial, tag, &slot, &generation)) return py::none();
            return py::make_tuple(slot, generation);
          },
          py::arg("initial") = 1, py::arg("tag") = 0,
          R"pbdoc(Any process: (slot, generation) with the count and tag set, or None when
full. Tag 0 (untagged) slots are ignored by collect().)pbdoc")
      .def("recycle", &CounterFile::recycle, py::arg("slot"))
      .def("add", &CounterFile::add, py::arg("slot"), py::arg("delta"))
      .def("value", &CounterFile::value, py::arg("slot"))
      .def("generation", &CounterFile::generation, py::arg("slot"))
      .def("set_holder", &CounterFile::set_holder, py::arg("slot"), py::arg("key"))
      .def("holder", &CounterFile::holder, py::arg("slot"))
      .def("holder_alive", &CounterFile::holder_alive, py::arg("slot"))
      .def("tag", &CounterFile::tag, py::arg("slot"))
      .def("claim", &CounterFile::claim, py::arg("slot"), py::arg("generation"),
           R"pbdoc(Receiver: False for a stale slot; else records this process as holder.)pbdoc")
      .def(
          "collect",
          [](CounterFile& self, bool check_holders) {
            CounterCollect r;
            {
              py::gil_scoped_release nogil;
              r = self.collect(check_holders);
            }
            py::list reclaimed;
            for (const auto& [slot, holder, tag] : r.reclaimed) {
              reclaimed.append(py::make_tuple(slot, holder, tag));
            }
            return py::make_tuple(r.stable, r.dead_tags, reclaimed, r.recycled);
          },
          py::arg("check_holders") = true,
          R"pbdoc(Owner: (stable, dead tags, [(slot, holder, tag) reclaimed], recycled count).
Note [Counter snapshots]: recycles released slots and, with check_holders, those of dead
holders; dead tags are those whose last counted slot went. When the slots kept changing,
stable is False and nothing was recycled.)pbdoc")
      .def("counted_slots", &CounterFile::counted_slots,
           R"pbdoc([(slot, tag, count, holder)] of the tagged slots still counted.)pbdoc")
      .def("unlink", &CounterFile::unlink)
      .def_property_readonly("capacity", &CounterFile::capacity)
      .def_property_readonly("in_use", &CounterFile::in_use)
      .def_property_readonly("name", &CounterFile::name)
      .def_property_readonly("segment_id", &CounterFile::segment_id)
      .def_property_readonly("owner_key", &CounterFile::owner_key)
      .def_property_readonly("owner", &CounterFile::owner);
}

}  // namespace torch_mp_ext::python
