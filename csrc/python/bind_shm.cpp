// Blocks, handles and the arena (Note [Segment layout], Note [Block lifetime]).
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "python/bindings.h"
#include "shm/arena.h"
#include "shm/reaper.h"
#include "shm/record.h"
#include "shm/registry.h"
#include "shm/session.h"
#include "shm/sigbus.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

namespace {

// A handle crosses Python as a plain tuple (cheap to pickle):
// (named, segment_id, secret, segment_size, index, generation, owner_pid, location)
py::tuple to_tuple(const Handle& h) {
  return py::make_tuple(h.named, h.segment_id, h.secret, h.size, h.index, h.generation,
                        h.owner_pid, h.location);
}

Handle from_tuple(const py::tuple& t) {
  if (t.size() != 8) {
    throw py::value_error("a torch_mp_ext block handle is an 8-tuple, got " +
                          std::to_string(t.size()) + " items");
  }
  // A handle arrives in a pickle, from any peer: a field of the wrong type or range is a
  // TypeError naming it (pybind11's own cast error names neither).
  static const char* const names[] = {"named", "segment_id", "secret", "size",
                                      "index", "generation", "owner_pid", "location"};
  static const char* const kinds[] = {"a bool", "an unsigned 64-bit integer",
                                      "an unsigned 64-bit integer", "an unsigned 64-bit integer",
                                      "an unsigned 32-bit integer", "an unsigned 32-bit integer",
                                      "a 32-bit integer", "a str"};
  size_t at = 0;
  try {
    Handle h;
    h.named = t[at].cast<bool>();
    h.segment_id = t[++at].cast<uint64_t>();
    h.secret = t[++at].cast<uint64_t>();
    h.size = t[++at].cast<uint64_t>();
    h.index = t[++at].cast<uint32_t>();
    h.generation = t[++at].cast<uint32_t>();
    h.owner_pid = t[++at].cast<int32_t>();
    h.location = t[++at].cast<std::string>();
    return h;
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("a torch_mp_ext block handle's field '") + names[at] +
                         "' must be " + kinds[at] + ", got " +
                         std::string(py::repr(t[at]).cast<std::string>()).substr(0, 80));
  }
}

py::tuple record_key(const Record& r) {
  // Note [Identity of rebuilt storages] in reductions.py: the same key as a handle's.
  return py::make_tuple("tmx", r.handle.segment_id, r.handle.index, r.handle.generation,
                        r.offset, r.nbytes);
}

Record record_of(const py::bytes& data) {
  return decode_record(PyBytes_AS_STRING(data.ptr()),
                       static_cast<size_t>(PyBytes_GET_SIZE(data.ptr())));
}

py::tuple to_py_tuple(const std::vector<int64_t>& v) {
  py::tuple out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = py::int_(v[i]);
  return out;
}

/// records.DENSE: the view covers its storage contiguously, first byte to last.
constexpr uint8_t RECORD_FLAG_DENSE = 2;

/// Whether `sizes`/`strides` (elements) are C-contiguous and cover exactly `nbytes`.
bool dense(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
           size_t itemsize, size_t nbytes) {
  if (sizes.size() != strides.size()) return false;
  int64_t expected = 1;  // torch's is_contiguous(): strides of size-1 dims do not matter
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] <= 0) return false;  // no elements: never all of a non-empty storage
    if (sizes[i] != 1 && strides[i] != expected) return false;
    if (expected > INT64_MAX / sizes[i]) return false;
    expected *= sizes[i];
  }
  if (static_cast<uint64_t>(expected) > SIZE_MAX / itemsize) return false;
  return static_cast<size_t>(expected) * itemsize == nbytes;
}

/// Runs `f` with this thread armed against a shared-memory file truncated under it: a lost
/// page is a CorruptSegmentError saying the thread `what`, not a SIGBUS
/// (Note [Truncated under us]).
template <typename F>
auto guarded(const char* what, F&& f) -> decltype(f()) {
  SigbusGuard guard;
  if constexpr (std::is_void_v<decltype(f())>) {
    f();
    guard.check(what);
  } else {
    auto out = f();
    guard.check(what);
    return out;
  }
}

}  // namespace

void init_records(py::module_& m) {
  // Note [Lean tensor records] in shm/record.h.
  m.def(
      "share_record",
      [](uintptr_t address, size_t nbytes, int64_t storage_offset, std::vector<int64_t> sizes,
         std::vector<int64_t> strides, uint32_t dtype, uint8_t kind, uint8_t flags,
         size_t itemsize) -> py::object {
        Record r;
        size_t offset = 0;
        bool found = guarded("shared a tensor", [&] {
          return Registry::instance().share_address(address, nbytes, &r.handle, &offset);
        });
        if (!found) return py::none();
        r.kind = kind;
        r.flags = flags;
        if (itemsize != 0 && storage_offset == 0 && dense(sizes, strides, itemsize, nbytes)) {
          r.flags |= RECORD_FLAG_DENSE;
        }
        r.dtype = dtype;
        r.offset = offset;
        r.nbytes = nbytes;
        r.storage_offset = storage_offset;
        r.sizes = std::move(sizes);
        r.strides = std::move(strides);
        std::string bytes;
        try {
          bytes = encode_record(r);
        } catch (...) {
          guarded("released a handle",
                  [&] { Registry::instance().release_handle(r.handle, 60.0); });
          throw;
        }
        return py::make_tuple(py::bytes(bytes), record_key(r));
      },
      py::arg("address"), py::arg("nbytes"), py::arg("storage_offset"), py::arg("sizes"),
      py::arg("strides"), py::arg("dtype"), py::arg("kind"), py::arg("flags"),
      py::arg("itemsize") = 0,
      R"pbdoc((record bytes, cache key) carrying one new reference for a storage of
`nbytes` at `address` inside a live block of this process, else None. With an `itemsize`,
the DENSE flag (2) is set when the view covers the storage contiguously from its first
byte to its last (the receiver then makes it with frombuffer).)pbdoc");
  m.def(
      "take_record",
      [](const py::bytes& data, double timeout) {
        Record r = record_of(data);
        std::unique_ptr<BlockRef> block;
        {
          py::gil_scoped_release nogil;
          block = guarded("attached a block",
                          [&] { return Registry::instance().attach(r.handle, timeout); });
        }
        auto address = reinterpret_cast<uintptr_t>(block->data()) + r.offset;
        return py::make_tuple(record_key(r), r.kind, r.dtype, r.flags, r.offset, r.nbytes,
                              r.storage_offset, to_py_tuple(r.sizes), to_py_tuple(r.strides),
                              address, py::cast(std::move(block)));
      },
      py::arg("data"), py::arg("timeout") = 60.0,
      R"pbdoc((key, kind, dtype, flags, offset, nbytes, storage_offset, sizes, strides,
address, Block) of a record: read_record and attach_record in one call; `address` is where
the storage starts in this process.)pbdoc");
  m.def(
      "read_record",
      [](const py::bytes& data) {
        Record r = record_of(data);
        return py::make_tuple(record_key(r), r.kind, r.dtype, r.flags, r.offset, r.nbytes,
                              r.storage_offset, to_py_tuple(r.sizes), to_py_tuple(r.strides),
                              r.handle.owner_pid);
      },
      py::arg("data"),
      R"pbdoc((key, kind, dtype, flags, offset, nbytes, storage_offset, sizes, strides,
owner_pid) of a record; CorruptSegmentError if it is malformed.)pbdoc");
  m.def(
      "release_record",
      [](const py::bytes& data, double timeout) {
        Record r = record_of(data);
        py::gil_scoped_release nogil;
        guarded("released a handle",
                [&] { Registry::instance().release_handle(r.handle, timeout); });
      },
      py::arg("data"), py::arg("timeout") = 60.0,
      R"pbdoc(Drops the reference a record carries.)pbdoc");
}

void init_shm(py::module_& m) {
  init_records(m);
  py::class_<BlockRef>(m, "Block", py::buffer_protocol(), R"pbdoc(
    One counted reference to a shared-memory block. The buffer protocol exposes its bytes
    (writable, zero-copy); the reference is dropped when the object dies.
  )pbdoc")
      .def_buffer([](BlockRef& b) -> py::buffer_info {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.capacity())}, {1}, false);
      })
      .def_property_readonly("address",
                             [](const BlockRef& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("capacity", &BlockRef::capacity)
      .def_property_readonly("index", &BlockRef::index)
      .def_property_readonly("generation",
                             [](const BlockRef& b) {
                               return guarded("read a block's generation",
                                              [&] { return b.generation(); });
                             })
      .def_property_readonly("segment_id", [](const BlockRef& b) { return b.mapping()->id(); })
      .def_property_readonly(
          "segment_address",
          [](const BlockRef& b) { return reinterpret_cast<uintptr_t>(b.mapping()->base()); },
          "Where this process maps the block's segment header (tests write garbage there).")
      .def_property_readonly("named", [](const BlockRef& b) { return b.mapping()->named(); })
      .def_property_readonly("name",
                             [](const BlockRef& b) -> py::object {
                               if (!b.mapping()->named()) return py::none();
                               return py::str(b.mapping()->name());
                             })
      .def_property_readonly("refcount",
                             [](const BlockRef& b) {
                               return guarded("read a block's refcount", [&] {
                                 return b.mapping()->slots()[b.index()].refcount.load();
                               });
                             })
      .def("share",
           [](const BlockRef& b) {
             return to_tuple(guarded("shared a block", [&] { return b.share(); }));
           },
           R"pbdoc(A handle tuple carrying one new reference (for a message in flight).)pbdoc");

  m.def(
      "allocate",
      [](size_t nbytes, bool named) {
        py::gil_scoped_release nogil;
        return guarded("allocated a block",
                       [&] { return Arena::instance().allocate(nbytes, named); });
      },
      py::arg("nbytes"), py::arg("named") = false,
      R"pbdoc(A new pooled block of at least `nbytes` bytes, in an anonymous segment or a named one
(file_system; Note [Pooled names]).)pbdoc");
  m.def(
      "allocate_sparse",
      [](size_t nbytes, size_t reserved, bool named) {
        py::gil_scoped_release nogil;
        return guarded("allocated a block", [&] {
          return Arena::instance().allocate_sparse(nbytes, reserved, named);
        });
      },
      py::arg("nbytes"), py::arg("reserved"), py::arg("named") = false,
      R"pbdoc(A block of `nbytes` with pages reserved only for its first `reserved` bytes
      (a growable queue ring: Note [Ring growth]); its own segment, never pooled.)pbdoc");
  m.def(
      "attach",
      [](const py::tuple& handle, double timeout) {
        Handle h = from_tuple(handle);
        py::gil_scoped_release nogil;
        return guarded("attached a block",
                       [&] { return Registry::instance().attach(h, timeout); });
      },
      py::arg("handle"), py::arg("timeout") = 60.0,
      R"pbdoc(Rebuilds a handle into a Block, taking over the reference it carried.)pbdoc");
  m.def(
      "release_handle",
      [](const py::tuple& handle, double timeout) {
        Handle h = from_tuple(handle);
        py::gil_scoped_release nogil;
        guarded("released a handle", [&] { Registry::instance().release_handle(h, timeout); });
      },
      py::arg("handle"), py::arg("timeout") = 60.0,
      R"pbdoc(Drops the reference a handle carries without keeping the block.)pbdoc");
  m.def(
      "reclaim_named_segments",
      [](const std::string& prefix) {
        py::gil_scoped_release nogil;
        return guarded("reclaimed named segments",
                       [&] { return Registry::instance().reclaim_named(prefix); });
      },
      py::arg("prefix") = "torch_",
      R"pbdoc(Note [Reclaiming names at run time]: drops what dead processes held of the
named segments this process or dead ones created, unlinking those nobody alive holds.
Returns the names reclaimed.)pbdoc");
  m.def(
      "audit",
      [](bool reclaim) {
        return guarded("audited its segments", [&] {
          if (reclaim) Registry::instance().reclaim_dead_holders();
          return Registry::instance().audit(reclaim);
        });
      },
      py::arg("reclaim") = true,
      R"pbdoc(Private debug audit (Note [Audit]): the violated invariants of every segment
this process maps, one string each. `reclaim`: first drop dead processes' references, as
survivors do, and report any a dead process still holds.)pbdoc");
  m.def(
      "share_address",
      [](uintptr_t address, size_t nbytes) -> py::object {
        Handle h;
        size_t offset = 0;
        bool found = guarded("shared a tensor", [&] {
          return Registry::instance().share_address(address, nbytes, &h, &offset);
        });
        if (!found) return py::none();
        return py::make_tuple(to_tuple(h), offset);
      },
      py::arg("address"), py::arg("nbytes"),
      R"pbdoc((handle, offset) for memory inside a live block of this process, else None.)pbdoc");
  m.def(
      "contains",
      [](uintptr_t address, size_t nbytes) {
        return guarded("looked a tensor up",
                       [&] { return Registry::instance().contains(address, nbytes); });
      },
      py::arg("address"), py::arg("nbytes"),
      R"pbdoc(True if the memory lies inside one live block this process maps.)pbdoc");
  m.def("session_join", &session_join, py::arg("tag"), py::arg("root"), py::arg("create"),
        R"pbdoc(Joins (or starts, as its root) a session (Note [Session names]); False if
        its member table cannot be opened or made.)pbdoc");
  m.def("session_leave", &session_leave,
        R"pbdoc(Stops being a session member; fork children still join.)pbdoc");
  m.def(
      "session_end",
      [] {
        py::gil_scoped_release nogil;
        return session_end();
      },
      R"pbdoc(At normal exit: leaves the session; the last member alive unlinks the names
      of the session that no live process holds. Returns the names removed.)pbdoc");
  m.def(
      "reap_dead_sessions",
      [](bool dry_run) {
        py::gil_scoped_release nogil;
        return reap_dead_sessions(dry_run);
      },
      py::arg("dry_run") = false,
      R"pbdoc(Sweeps sessions whose members are all dead (Note [Session names]): their names
      nobody alive holds, then their member tables. Returns the names removed (or that would
      be, with dry_run).)pbdoc");
  m.def("_set_fork_child_delay", &set_fork_child_delay_for_tests, py::arg("milliseconds"),
        R"pbdoc(Test hook: forked children wait this long before marking the blocks they
        inherited (Note [Mappings and fork]).)pbdoc");
  m.def("_set_attach_delay", &set_attach_delay_for_tests, py::arg("milliseconds"),
        R"pbdoc(Test hook: attach and release_handle wait this long between mapping a
        segment and using it (Note [One critical section per lookup]).)pbdoc");
  m.def("reclaim_dead_holders",
        [] {
          return guarded("reclaimed dead holders' blocks",
                         [] { return Registry::instance().reclaim_dead_holders(); });
        },
        R"pbdoc(Drops dead processes' block references on every mapped segment; returns how
        many (Note [Dead holders]).)pbdoc");
  m.def(
      "segment_layout",
      [] {
#define TMX_SEG_FIELD(f) \
  py::tuple(py::make_tuple(#f, offsetof(SegmentHeader, f), sizeof(SegmentHeader::f)))
        py::list out;
        for (const py::tuple& t : {TMX_SEG_FIELD(magic), TMX_SEG_FIELD(layout_version), TMX_SEG_FIELD(kind),
                         TMX_SEG_FIELD(segment_id), TMX_SEG_FIELD(secret),
                         TMX_SEG_FIELD(total_size), TMX_SEG_FIELD(block_size),
                         TMX_SEG_FIELD(data_offset), TMX_SEG_FIELD(masks_offset),
                         TMX_SEG_FIELD(nblocks), TMX_SEG_FIELD(owner_pid),
                         TMX_SEG_FIELD(owner_key), TMX_SEG_FIELD(pidns), TMX_SEG_FIELD(flags),
                         TMX_SEG_FIELD(live_blocks), TMX_SEG_FIELD(free_head),
                         TMX_SEG_FIELD(inflight), TMX_SEG_FIELD(name), TMX_SEG_FIELD(holders)}) {
          out.append(t);
        }
#undef TMX_SEG_FIELD
        out.append(py::make_tuple("slots", slots_offset(), sizeof(BlockSlot)));
        return out;
      },
      R"pbdoc((field, offset, size) of a segment's shared header; "slots" gives the slot table's
      offset and one slot's size (fuzz tests only).)pbdoc");
  m.def("empty_cache",
        [] {
          return guarded("emptied its cache", [] { return Arena::instance().empty_cache(); });
        },
        R"pbdoc(Retires every owned segment with no live block; returns bytes released.)pbdoc");
  m.def("class_size", &Arena::class_size, py::arg("nbytes"));
  m.def("sigbus_pages_lost", &sigbus_pages_lost,
        R"pbdoc(Pages of truncated shared-memory files this process replaced with zeros instead
        of dying by SIGBUS (Note [Truncated under us]; tests).)pbdoc");
  m.def("arena_stats", [] {
    ArenaStats a = Arena::instance().stats();
    RegistryStats r = Registry::instance().stats();
    py::dict d;
    d["segments"] = a.segments;
    d["reserved_bytes"] = a.reserved_bytes;
    d["cached_free_bytes"] = a.cached_free_bytes;
    d["live_blocks"] = a.live_blocks;
    d["cache_limit"] = a.cache_limit;
    d["mapped_segments"] = r.mapped_segments;
    d["mapped_bytes"] = r.mapped_bytes;
    d["live_refs"] = r.live_refs;
    d["idle_mappings"] = r.idle_mappings;
    d["refcount_underflows"] = r.refcount_underflows;
    return d;
  });
  m.def("release_all",
        [] { guarded("released its blocks", [] { Registry::instance().release_all(); }); },
        R"pbdoc(Drops every block reference this process holds (interpreter exit).)pbdoc");
  m.def(
      "set_anonymous_backend",
      [](const std::string& name) {
        if (name == "memfd") {
          set_anonymous_backend(AnonymousBackend::Memfd);
        } else if (name == "shm") {
          set_anonymous_backend(AnonymousBackend::ShmUnlinked);
        } else {
          throw py::value_error("anonymous backend must be 'memfd' or 'shm', got '" + name +
                                "'");
        }
      },
      py::arg("name"));
  m.def("anonymous_backend", [] {
    return anonymous_backend() == AnonymousBackend::Memfd ? "memfd" : "shm";
  });
  m.def(
      "reap_dead_segments",
      [](const std::string& directory, const std::string& prefix, bool dry_run,
         bool include_inflight) {
        ReapOptions o;
        o.directory = directory;
        o.prefix = prefix;
        o.dry_run = dry_run;
        o.include_inflight = include_inflight;
        py::gil_scoped_release nogil;
        return reap_dead_segments(o);
      },
      py::arg("directory") = "/dev/shm", py::arg("prefix") = "torch_",
      py::arg("dry_run") = false, py::arg("include_inflight") = false,
      R"pbdoc(Unlinks our named segments whose holders are all dead; returns their names.)pbdoc");
}

}  // namespace torch_mp_ext::python
