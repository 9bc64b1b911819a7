// The latest-value channel (Note [Latest-value channel] in exchange/latest.h).
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <string>

#include "exchange/latest.h"
#include "platform/process.h"
#include "python/bindings.h"
#include "shm/registry.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

namespace {

/// Blocking waits run without the GIL in slices of this many seconds, so that Ctrl-C (a
/// pending signal) interrupts them within a slice.
constexpr double WAIT_SLICE_S = 0.05;

/// A channel laid out in a Block; keeps the Block (and so the mapping) alive.
struct PyLatestChannel {
  py::object block;  // the _C.Block holding the memory
  LatestChannel channel;
  char* base;  // the Block's first byte (buffer offsets count from it)
};

/// One borrowed version (Note [Pin lifetime] in torch_mp_ext/exchange/borrow.py): exports
/// its buffer's bytes (the buffer protocol: torch.frombuffer wraps it in a storage that
/// holds it) and unpins when its last reference goes -- in the process that pinned it only
/// (a forked copy leaves the pin to its parent).
struct PyPin {
  py::object owner;  // the LatestChannel (and so the mapping) stays alive while pinned
  PyLatestChannel* channel;
  ReadTicket ticket;
  pid_t pid;
  std::string label;

  PyPin(py::object o, PyLatestChannel* c, const ReadTicket& t, std::string l)
      : owner(std::move(o)), channel(c), ticket(t), pid(::getpid()), label(std::move(l)) {}
  PyPin(const PyPin&) = delete;
  PyPin& operator=(const PyPin&) = delete;

  ~PyPin() {
    if (::getpid() != pid || channel->channel.end_read(ticket)) return;
    // Cannot happen unless a writer judged this live process dead (Note [Latest-value
    // channel]); a destructor cannot raise, so it is logged, loudly.
    try {
      py::module_::import("logging").attr("getLogger")("torch_mp_ext.exchange").attr("error")(
          "version %d of %s changed while process %d borrowed it: a writer misjudged this "
          "process dead; borrowed weights may have been torn",
          ticket.version, label, static_cast<long>(pid));
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("torch_mp_ext Pin.__del__");
    }
  }
};

/// Runs `step(slice_deadline)` without the GIL until it answers something else than a
/// signal or the end of a slice before the overall deadline (Note [Waiting without the GIL]).
template <typename Step>
LatestStatus sliced(const py::object& timeout, Step step) {
  Deadline overall(timeout.is_none() ? -1.0 : std::max(0.0, timeout.cast<double>()));
  return wait_without_gil([&] { return step(overall.slice(WAIT_SLICE_S)); },
                          [&](LatestStatus st) {
                            return st == LatestStatus::Interrupted ||
                                   (st == LatestStatus::Timeout && !overall.expired());
                          });
}

std::vector<CopySpan> to_spans(const std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>& in) {
  std::vector<CopySpan> out;
  out.reserve(in.size());
  for (const auto& [offset, address, nbytes] : in) out.push_back({offset, address, nbytes});
  return out;
}

}  // namespace

void init_exchange(py::module_& m) {
  py::class_<PyPin>(m, "Pin", py::buffer_protocol(), R"pbdoc(
    A pinned version of a LatestChannel (LatestChannel.pin): its buffer's bytes, writable
    (read-only by contract), unpinned when the last reference goes.
  )pbdoc")
      .def_buffer([](PyPin& p) -> py::buffer_info {
        auto* data = p.channel->base + p.channel->channel.buffer_offset(p.ticket.index);
        auto n = static_cast<py::ssize_t>(p.channel->channel.buffer_bytes());
        return py::buffer_info(data, 1, py::format_descriptor<uint8_t>::format(), 1, {n}, {1});
      });
  using Spans = std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>;
  py::class_<PyLatestChannel>(m, "LatestChannel", R"pbdoc(
    A versioned latest-value channel laid out in a shared-memory Block: one writer, many
    readers, K buffers (Note [Latest-value channel]). Status codes of begin_write/begin_read:
    0 ok, 1 timeout, 2 closed, 3 stale version, 4 another process is publishing.
  )pbdoc")
      .def(py::init([](py::object block, uint32_t nbuffers, uint64_t buffer_bytes, bool create) {
             auto& ref = block.cast<BlockRef&>();
             return new PyLatestChannel{
                 block, LatestChannel(ref.data(), ref.capacity(), nbuffers, buffer_bytes, create),
                 ref.data()};
           }),
           py::arg("block"), py::arg("nbuffers"), py::arg("buffer_bytes"), py::arg("create"))
      .def_static("required_bytes", &LatestChannel::required_bytes, py::arg("nbuffers"),
                  py::arg("buffer_bytes"))
      .def_property_readonly("block", [](const PyLatestChannel& c) { return c.block; })
      .def_property_readonly("nbuffers", [](const PyLatestChannel& c) { return c.channel.nbuffers(); })
      .def_property_readonly("buffer_bytes",
                             [](const PyLatestChannel& c) { return c.channel.buffer_bytes(); })
      .def_property_readonly("latest", [](const PyLatestChannel& c) { return c.channel.latest(); })
      .def_property_readonly("closed", [](const PyLatestChannel& c) { return c.channel.closed(); })
      .def("buffer_offset", [](const PyLatestChannel& c, uint32_t i) { return c.channel.buffer_offset(i); },
           py::arg("index"))
      .def(
          "begin_write",
          [](PyLatestChannel& c, uint64_t version, const py::object& timeout) {
            uint32_t index = 0;
            uint64_t busy = 0;
            LatestStatus st = sliced(timeout, [&](const Deadline& d) {
              return c.channel.begin_write(version, d, &index, &busy);
            });
            return py::make_tuple(static_cast<int>(st), index, busy);
          },
          py::arg("version"), py::arg("timeout"),
          R"pbdoc((status, index, busy_key): claims a back buffer for `version`.)pbdoc")
      .def(
          "copy_in",
          [](PyLatestChannel& c, uint32_t index, const Spans& spans) {
            std::vector<CopySpan> s = to_spans(spans);
            py::gil_scoped_release nogil;
            c.channel.copy_in(index, s);
          },
          py::arg("index"), py::arg("spans"),
          R"pbdoc(memcpy of (buffer offset, source address, nbytes) spans into a claimed buffer.)pbdoc")
      .def("commit", [](PyLatestChannel& c, uint32_t i, uint64_t v) { c.channel.commit(i, v); },
           py::arg("index"), py::arg("version"))
      .def("abort", [](PyLatestChannel& c, uint32_t i) { c.channel.abort(i); }, py::arg("index"))
      .def(
          "begin_read",
          [](PyLatestChannel& c, int64_t newer_than, uint64_t multiple_of, const py::object& timeout) {
            ReadTicket t;
            LatestStatus st = sliced(timeout, [&](const Deadline& d) {
              return c.channel.begin_read(newer_than, std::max<uint64_t>(multiple_of, 1), d, &t);
            });
            return py::make_tuple(static_cast<int>(st), t.index, t.slot, t.version, t.published_ns);
          },
          py::arg("newer_than"), py::arg("multiple_of"), py::arg("timeout"),
          R"pbdoc((status, index, slot, version, published_ns): pins the newest matching version.)pbdoc")
      .def(
          "pin",
          [](py::object self, int64_t newer_than, uint64_t multiple_of, const py::object& timeout,
             std::string label) -> py::tuple {
            auto& c = self.cast<PyLatestChannel&>();
            ReadTicket t;
            LatestStatus st = sliced(timeout, [&](const Deadline& d) {
              return c.channel.begin_read(newer_than, std::max<uint64_t>(multiple_of, 1), d, &t);
            });
            if (st != LatestStatus::Ok) return py::make_tuple(static_cast<int>(st), 0, py::none());
            // Nothing can throw between the pin and its owner: the Pin unpins when it goes.
            return py::make_tuple(0, t.version, py::cast(new PyPin(self, &c, t, std::move(label)),
                                                         py::return_value_policy::take_ownership));
          },
          py::arg("newer_than"), py::arg("multiple_of"), py::arg("timeout"), py::arg("label"),
          R"pbdoc((status, version, Pin or None): begin_read whose ticket is a Pin, a buffer
          of the version's bytes that unpins when its last reference goes.)pbdoc")
      .def(
          "end_read",
          [](PyLatestChannel& c, uint32_t index, uint32_t slot, uint64_t version) {
            ReadTicket t;
            t.index = index;
            t.slot = slot;
            t.version = version;
            return c.channel.end_read(t);
          },
          py::arg("index"), py::arg("slot"), py::arg("version"),
          R"pbdoc(Unpins; False if the buffer changed under the read (read again).)pbdoc")
      .def(
          "copy_out",
          [](const PyLatestChannel& c, uint32_t index, const Spans& spans) {
            std::vector<CopySpan> s = to_spans(spans);
            py::gil_scoped_release nogil;
            c.channel.copy_out(index, s);
          },
          py::arg("index"), py::arg("spans"),
          R"pbdoc(memcpy of (buffer offset, destination address, nbytes) spans out of a buffer.)pbdoc")
      .def(
          "wait",
          [](PyLatestChannel& c, int64_t newer_than, uint64_t multiple_of, const py::object& timeout) {
            return static_cast<int>(sliced(timeout, [&](const Deadline& d) {
              return c.channel.wait(newer_than, std::max<uint64_t>(multiple_of, 1), d);
            }));
          },
          py::arg("newer_than"), py::arg("multiple_of"), py::arg("timeout"),
          R"pbdoc(Status of waiting, pinning nothing, for a matching version.)pbdoc")
      .def(
          "peek",
          [](const PyLatestChannel& c, int64_t newer_than, uint64_t multiple_of) -> py::object {
            uint64_t version = 0, at = 0;
            if (!c.channel.peek(newer_than, std::max<uint64_t>(multiple_of, 1), &version, &at)) {
              return py::none();
            }
            return py::make_tuple(version, at);
          },
          py::arg("newer_than"), py::arg("multiple_of"),
          R"pbdoc((version, published_ns) of the newest matching complete version, or None.)pbdoc")
      .def("close", [](PyLatestChannel& c) { c.channel.close(); })
      .def("set_publisher", [](PyLatestChannel& c) { c.channel.set_publisher(); },
           R"pbdoc(Records this process as the publisher (Note [Publisher death]).)pbdoc")
      .def_property_readonly("publisher", [](const PyLatestChannel& c) { return c.channel.publisher(); })
      .def("check_publisher", [](PyLatestChannel& c) { return c.channel.check_publisher(); },
           R"pbdoc(Closes the channel as 'publisher died' if it is open and its publisher is
           known dead; True when it is closed so (Note [Publisher death]).)pbdoc")
      .def_property_readonly("publisher_died",
                             [](const PyLatestChannel& c) { return c.channel.publisher_died(); })
      .def(
          "state",
          [](const PyLatestChannel& c) {
            const LatestHeader& h = c.channel.header();
            py::list stamps, readers;
            for (uint32_t i = 0; i < c.channel.nbuffers(); ++i) stamps.append(h.buffers[i].stamp.load());
            for (uint32_t s = 0; s < LATEST_READER_SLOTS; ++s) {
              uint64_t key = h.readers[s].holder.key();
              if (key == 0) continue;
              readers.append(py::make_tuple(key_pid(key), h.readers[s].pinned.load()));
            }
            py::dict d;
            d["latest"] = c.channel.latest();
            d["writer_pid"] = key_pid(h.writer.key());
            d["stamps"] = stamps;
            d["readers"] = readers;
            d["waiters"] = h.changed.waiters();
            d["closed"] = c.channel.closed();
            return d;
          },
          R"pbdoc(A snapshot for tests and debugging: stamps, writer pid, (pid, pinned) of readers.)pbdoc");
  m.attr("LATEST_WRITING") = py::int_(STAMP_WRITING);
  m.attr("LATEST_MAX_VERSION") = py::int_(LATEST_MAX_VERSION);
}

}  // namespace torch_mp_ext::python
