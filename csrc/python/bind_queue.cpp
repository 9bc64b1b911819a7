// The shared-memory ring behind torch_mp_ext.queues (Note [Ring layout], Note [Ring commit]).
//
// Note [GIL and the ring mutex]
// A thread never takes the GIL while holding a ring mutex (frames are copied into a C++
// buffer under the mutex and become Python bytes after it is released), so holding the GIL
// while taking the mutex cannot deadlock. Each operation first tries once with the GIL held
// and without waiting for anything (try_lock, no wait for items or room): the common case
// costs no GIL hand-off. Only when it would wait does it release the GIL and block, returning
// every wait slice (or EINTR) to run Python's signal handlers, so Ctrl-C interrupts a get()
// (Note [Waiting without the GIL] in bindings.h).
//
// Note [Ring holders are not block references]
// A process holds at most one counted reference to any block, however many BlockRefs (queue
// objects) it has on it (Note [Dead holders] in layout.h), and that reference is marked by
// the process's bit in the block's holder mask. The ring's holder table counts queue objects
// per process, to find the last holder. The two must never both drop a dead process's
// reference: once dropped per queue object by the ring reaper (N objects: N drops for one
// reference) and once more by the segment's reclaimer, a ring's block went back to the free
// stack while live processes still used it, and the next queue created got the same ring:
// two live queues delivering each other's items (issue 12). So a dead holder found by the
// ring only triggers the segment's reclaim, which drops each dead process's bit exactly once.
//
// Note [Fork children hold before they run]
// A fork child's copy of a queue object is a holder (Note [Ring holders]), but its at-fork
// hook runs only once the child is scheduled, while the parent goes on at once: a parent that
// put an item, started a fork child and closed its queue (`q.put(x); p.start(); q.close()`)
// found itself the last holder and drained the item meant for the child (issue 35, D0). So,
// as with block references (Note [Mappings and fork] in shm/registry.h), the parent counts
// the child's holder before the fork, in flight (count_fork_child, from os.register_at_fork's
// `before` hook), and the child adopts it (attach_inherited). A fork that fails, or a child
// killed before its hook ran, leaves that holder in flight: the ring then lives until its
// segment's owner exits (a leak, never an early drain).
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <vector>

#include "common/check.h"
#include "python/bindings.h"
#include "queue/doorbell.h"
#include "queue/ring.h"
#include "shm/registry.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

namespace {

/// Payloads up to this size are copied with the GIL held on the fast path; larger ones
/// release it for the copy.
constexpr size_t GIL_COPY_LIMIT = 64 * 1024;

/// Frames taken from a ring before they become Python objects (reused per thread).
struct Scratch {
  FrameBuffer bytes;
  std::vector<FrameOut> frames;
};
thread_local Scratch t_scratch;

/// Borrows the thread's scratch; a reentrant call (a finalizer run by the GC during a get)
/// finds it empty and makes its own, so nothing is overwritten while in use.
class ScratchLease {
 public:
  ScratchLease() : scratch_(std::move(t_scratch)) {
    scratch_.bytes.clear();
    scratch_.frames.clear();
  }
  ~ScratchLease() { t_scratch = std::move(scratch_); }
  Scratch* operator->() { return &scratch_; }

 private:
  Scratch scratch_;
};

/// The bytes of a bytes-like object, without copying; holds the buffer until destroyed.
class BytesView {
 public:
  explicit BytesView(py::handle obj) {
    if (PyBytes_CheckExact(obj.ptr())) {
      data_ = PyBytes_AS_STRING(obj.ptr());
      size_ = static_cast<size_t>(PyBytes_GET_SIZE(obj.ptr()));
      return;
    }
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
    held_ = true;
    data_ = static_cast<const char*>(view_.buf);
    size_ = static_cast<size_t>(view_.len);
  }
  BytesView(const BytesView&) = delete;
  BytesView& operator=(const BytesView&) = delete;
  ~BytesView() {
    if (held_) PyBuffer_Release(&view_);
  }
  FrameIn frame(uint32_t tag) const {
    TMX_CHECK_VALUE(size_ <= std::numeric_limits<uint32_t>::max(), "an item of ", size_,
                    " bytes is larger than a queue frame can be (4 GiB)");
    return FrameIn{data_, static_cast<uint32_t>(size_), tag};
  }
  size_t size() const { return size_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
  const char* data_ = nullptr;
  size_t size_ = 0;
};

/// Runs a blocking ring operation without the GIL; the ring answers Interrupted at each
/// slice's end and on EINTR (Note [Waiting without the GIL]).
template <typename Op>
Status blocking(double timeout, Op&& op) {
  Deadline deadline(timeout);
  return wait_without_gil([&] { return op(deadline); },
                          [](Status s) { return s == Status::Interrupted; });
}

/// One queue object's hold on a ring: the block (which keeps the memory mapped), the view,
/// this object's closed flag, and whether it still counts as a holder (Note [Ring holders]).
///
/// Once it stops holding, release() drops its block reference at once, so that a process
/// killed later in its exit path does not keep the ring alive; calls still running in other
/// threads (counted in busy_) defer that to the object's destruction, and any later call
/// raises ValueError instead of touching memory that may be reused.
class RingHandle {
  /// Marks a call that uses the ring's memory (possibly without the GIL).
  class Use {
   public:
    explicit Use(RingHandle& h) : h_(h) {
      TMX_CHECK_VALUE(!h.released_, "this queue object was closed: its shared memory is gone");
      ++h_.busy_;
    }
    ~Use() { --h_.busy_; }

   private:
    RingHandle& h_;
  };

 public:
  RingHandle(py::object block, Ring ring) : block_(std::move(block)), ring_(ring) {}

  static std::unique_ptr<RingHandle> create(py::object block, uint64_t capacity,
                                            uint64_t maxsize, bool joinable, int64_t spin_ns,
                                            uint64_t max_capacity, bool in_dev_shm) {
    auto& ref = block.cast<BlockRef&>();
    RingOptions options;
    options.capacity = capacity;
    options.max_capacity = max_capacity;
    options.in_dev_shm = in_dev_shm;
    options.maxsize = maxsize;
    options.joinable = joinable;
    options.spin_ns = spin_ns;
    Ring ring = Ring::create(ref.data(), ref.capacity(), options);
    return std::make_unique<RingHandle>(std::move(block), ring);
  }

  static std::unique_ptr<RingHandle> open(py::object block) {
    auto& ref = block.cast<BlockRef&>();
    Ring ring = Ring::open(ref.data(), ref.capacity());
    ring.adopt_shared_holder();
    return std::make_unique<RingHandle>(std::move(block), ring);
  }

  py::object share() {
    Use use(*this);
    TMX_CHECK_VALUE(attached_, "this queue object was closed");
    py::object handle = block_.attr("share")();
    ring_.share_holder();
    return handle;
  }

  int put(py::handle data, uint32_t tag, double timeout) {
    Use use(*this);
    BytesView view(data);
    FrameIn frame = view.frame(tag);
    Status s = Status::Busy;
    if (view.size() <= GIL_COPY_LIMIT) s = ring_.put(&frame, 1, Deadline(0), &closed_, true);
    if (s == Status::Busy || (s == Status::Full && timeout != 0)) {
      s = blocking(timeout, [&](const Deadline& d) {
        return ring_.put(&frame, 1, d, &closed_, false);
      });
    }
    return after_put(s);
  }

  int put_many(const py::list& payloads, const py::object& tags, double timeout) {
    Use use(*this);
    size_t n = payloads.size();
    std::vector<std::unique_ptr<BytesView>> views;
    std::vector<FrameIn> frames;
    views.reserve(n);
    frames.reserve(n);
    py::list tag_list = tags.is_none() ? py::list() : py::list(tags);
    TMX_CHECK_VALUE(tags.is_none() || tag_list.size() == n, "put_many: ", n, " payloads but ",
                    tag_list.size(), " tags");
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      views.push_back(std::make_unique<BytesView>(payloads[i]));
      uint32_t tag = tags.is_none() ? 0 : tag_list[i].cast<uint32_t>();
      frames.push_back(views.back()->frame(tag));
      total += views.back()->size();
    }
    Status s = Status::Busy;
    if (total <= GIL_COPY_LIMIT) s = ring_.put(frames.data(), n, Deadline(0), &closed_, true);
    if (s == Status::Busy || (s == Status::Full && timeout != 0)) {
      s = blocking(timeout, [&](const Deadline& d) {
        return ring_.put(frames.data(), n, d, &closed_, false);
      });
    }
    return after_put(s);
  }

  /// The payload (bytes) of a tag-0 frame, (tag, payload) of another, or the status (int).
  py::object get(double timeout) {
    Use use(*this);
    ScratchLease scratch;
    Status s = ring_.get(scratch->bytes, scratch->frames, 1, Deadline(0), &closed_, true);
    if (s == Status::Busy || (s == Status::Empty && timeout != 0)) {
      s = blocking(timeout, [&](const Deadline& d) {
        return ring_.get(scratch->bytes, scratch->frames, 1, d, &closed_, false);
      });
    }
    if (s != Status::Ok) return py::int_(static_cast<int>(s));
    after_get();
    const FrameOut& f = scratch->frames[0];
    py::bytes payload(scratch->bytes.data() + f.offset, f.size);
    if (f.tag == 0) return std::move(payload);
    return py::make_tuple(f.tag, std::move(payload));
  }

  py::tuple get_many(size_t max_items, double timeout) {
    Use use(*this);
    TMX_CHECK_VALUE(max_items > 0, "get_many: max_items must be at least 1, got ", max_items);
    ScratchLease scratch;
    Status s =
        ring_.get(scratch->bytes, scratch->frames, max_items, Deadline(0), &closed_, true);
    if (s == Status::Busy || (s == Status::Empty && timeout != 0)) {
      s = blocking(timeout, [&](const Deadline& d) {
        return ring_.get(scratch->bytes, scratch->frames, max_items, d, &closed_, false);
      });
    }
    if (s != Status::Ok) return py::make_tuple(static_cast<int>(s), py::list(), py::none());
    after_get();
    return py::make_tuple(0, to_list(scratch->bytes, scratch->frames), tags_of(scratch->frames));
  }

  /// Every frame left, ignoring this object's closed flag (the last holder's clean-up).
  py::list drain(size_t max_items) {
    Use use(*this);
    ScratchLease scratch;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = ring_.get(scratch->bytes, scratch->frames, max_items, Deadline(0), nullptr, false);
    }
    py::list out;
    if (s != Status::Ok) return out;
    for (const FrameOut& f : scratch->frames) {
      out.append(py::make_tuple(f.tag, py::bytes(scratch->bytes.data() + f.offset, f.size)));
    }
    return out;
  }

  int task_done() {
    Use use(*this);
    py::gil_scoped_release nogil;
    return static_cast<int>(ring_.task_done());
  }

  int wait_room(size_t payload, double timeout) {
    Use use(*this);
    return static_cast<int>(blocking(timeout, [&](const Deadline& d) {
      return ring_.wait_room(payload, d, &closed_);
    }));
  }

  int join(double timeout) {
    Use use(*this);
    return static_cast<int>(
        blocking(timeout, [&](const Deadline& d) { return ring_.join(d, &closed_); }));
  }

  void close() {
    closed_.store(true, std::memory_order_release);
    bell_.reset();  // the Python object closes the pipe next
    if (!released_) ring_.wake_all();  // our blocked callers return Closed; others re-wait
  }

  bool detach() {
    if (!attached_ || released_) return false;
    attached_ = false;
    uint32_t reaped = 0;
    bool last;
    {
      py::gil_scoped_release nogil;
      last = ring_.remove_holder(&reaped);
    }
    // Note [Ring holders are not block references]: the ring's table only counts queue
    // objects. What a dead holder process held of the ring's block is one counted reference
    // marked by its bit in the segment's holder masks; reclaiming the segment drops it exactly
    // once, here, now, instead of when the owner's pool runs dry. Ours keeps the block alive.
    if (reaped > 0) {
      auto& ref = block_.cast<BlockRef&>();
      auto& registry = Registry::instance();
      std::lock_guard<std::mutex> lock(registry.mutex());
      registry.reclaim_locked(*ref.mapping());
    }
    return last;
  }

  /// Note [Fork children hold before they run]: before fork, counts the child's copy of this
  /// object as a holder in flight; False if this object holds nothing to inherit.
  bool count_fork_child() {
    fork_counted_ = attached_ && !released_;
    if (fork_counted_) ring_.share_holder();
    return fork_counted_;
  }

  /// In the parent after fork: the child (or a failed fork) owns what was counted.
  void fork_parent_done() { fork_counted_ = false; }

  /// After fork, in the child: its copy of this object becomes a holder, adopting the one
  /// the parent counted before the fork (or counting one now if the fork ran no hook).
  void attach_inherited() {
    bool counted = fork_counted_;
    fork_counted_ = false;
    if (!attached_ || released_) return;
    if (counted) {
      ring_.adopt_shared_holder();
    } else {
      ring_.add_holders(1);
    }
  }

  /// Drops the block reference now, unless a call in another thread still uses the ring.
  bool release() {
    if (released_ || attached_ || busy_ > 0) return false;
    released_ = true;
    block_.cast<BlockRef&>().release();
    // The BlockRef keeps its segment mapped (and, for a pooled memfd, its fd open) while it
    // lives: a closed queue object that is still referenced must not hold either.
    block_ = py::none();
    return true;
  }

  Ring::Counts counts() {
    Use use(*this);
    return *locked_read([&](const Deadline& d) { return ring_.counts(d); });
  }

  /// Runs a read of the ring under its mutex without the GIL, a slice at a time, running
  /// signal handlers between slices: a peer stopped (SIGSTOP) while holding the mutex keeps
  /// this call waiting, but never freezes the interpreter or deafens it to Ctrl-C.
  template <typename Read>
  static auto locked_read(Read&& read) -> decltype(read(std::declval<const Deadline&>())) {
    return wait_without_gil([&] { return read(Deadline(LOCKED_READ_SLICE_S)); },
                            [](const auto& answer) { return !answer.has_value(); });
  }
  static constexpr double LOCKED_READ_SLICE_S = 0.2;

  /// SimpleQueue: keep the wake-up pipe with these (non-blocking) ends from now on.
  void set_doorbell(int read_fd, int write_fd) { bell_.emplace(read_fd, write_fd); }

  /// SimpleQueue's fileno() is about to be waited on (Note [Doorbell]).
  void watch_doorbell() {
    Use use(*this);
    TMX_CHECK_VALUE(bell_.has_value(), "this queue has no wake-up pipe (only SimpleQueue has)");
    bell_->watch(ring_, [this] { return counts().count; });
  }

  bool closed() const { return closed_.load(std::memory_order_acquire); }
  const py::object& block() const { return block_; }
  bool attached() const { return attached_; }
  Ring& ring() {
    TMX_CHECK_VALUE(!released_, "this queue object was closed: its shared memory is gone");
    return ring_;
  }

 private:
  // The pipe's ends are copied first: close() may forget them meanwhile (the GIL is let go
  // while the count is read).
  int after_put(Status s) {
    if (s == Status::Ok && bell_) Doorbell(*bell_).after_put(ring_);
    return static_cast<int>(s);
  }
  void after_get() {
    if (bell_) Doorbell(*bell_).after_get(ring_, [this] { return counts().count; });
  }

  static py::list to_list(const FrameBuffer& bytes, const std::vector<FrameOut>& frames) {
    // Every bytes object first: the list's allocation may run the GC.
    std::vector<py::bytes> items;
    items.reserve(frames.size());
    for (const FrameOut& f : frames) items.emplace_back(bytes.data() + f.offset, f.size);
    py::list out(frames.size());
    for (size_t i = 0; i < items.size(); ++i) out[i] = std::move(items[i]);
    return out;
  }

  static py::object tags_of(const std::vector<FrameOut>& frames) {
    bool any = false;
    for (const FrameOut& f : frames) any |= f.tag != 0;
    if (!any) return py::none();
    py::list tags(frames.size());
    for (size_t i = 0; i < frames.size(); ++i) tags[i] = py::int_(frames[i].tag);
    return tags;
  }

  py::object block_;
  Ring ring_;
  std::optional<Doorbell> bell_;  ///< SimpleQueue only (Note [Doorbell])
  std::atomic<bool> closed_{false};
  bool attached_ = true;
  bool released_ = false;
  bool fork_counted_ = false;  ///< Note [Fork children hold before they run]
  int busy_ = 0;  ///< calls using the ring now (changed with the GIL held)
};

}  // namespace

void init_queue(py::module_& m) {
  py::enum_<Status>(m, "Status", "Outcome of a ring operation (the hot methods return its int).")
      .value("Ok", Status::Ok)
      .value("Empty", Status::Empty)
      .value("Full", Status::Full)
      .value("Timeout", Status::Timeout)
      .value("Closed", Status::Closed);

  py::class_<RingHandle>(m, "Ring", R"pbdoc(
    One queue object's hold on a shared-memory ring of frames (Note [Ring layout]).

    Timeouts are seconds; negative waits forever, 0 never waits. put/get return a Status as
    an int instead of raising for expected outcomes; a frame that can never fit raises
    ValueError; a ring found corrupt after a crash raises PeerDiedError.
  )pbdoc")
      .def_static("create", &RingHandle::create, py::arg("block"), py::arg("capacity"),
                  py::arg("maxsize") = 0, py::arg("joinable") = false,
                  py::arg("spin_ns") = DEFAULT_SPIN_NS, py::arg("max_capacity") = 0,
                  py::arg("in_dev_shm") = true,
                  "Constructs a new ring in `block`; this object is its first holder.")
      .def_static("open", &RingHandle::open, py::arg("block"),
                  "Views the ring in `block`, adopting the holder its handle carried.")
      .def_static("layout", &ring_layout,
                  "(field, offset, size) of the ring's shared header (fuzz tests only).")
      .def_static("footprint", &Ring::footprint, py::arg("capacity"),
                  "Bytes of memory a ring of `capacity` bytes needs.")
      .def_static("frame_bytes", &Ring::frame_bytes, py::arg("payload"),
                  "Bytes a frame of `payload` bytes takes in a ring.")
      .def_static(
          "set_crash_point", [](int point) { set_crash_point(static_cast<CrashPoint>(point)); },
          py::arg("point"), "Test hook: SIGKILL this process when an operation reaches it.")
      .def("share", &RingHandle::share,
           "A block handle carrying one block reference and one holder of the ring.")
      .def("wait_room", &RingHandle::wait_room, py::arg("payload"), py::arg("timeout") = -1.0,
           R"pbdoc(Waits until an item of `payload` bytes would fit, putting nothing: a Status
           (Ok, Full at the timeout, Closed). For producers that make an item only once there
           is room for it (Note [Produce into room]).)pbdoc")
      .def("put", &RingHandle::put, py::arg("data"), py::arg("tag") = 0,
           py::arg("timeout") = -1.0)
      .def("put_many", &RingHandle::put_many, py::arg("payloads"), py::arg("tags") = py::none(),
           py::arg("timeout") = -1.0)
      .def("get", &RingHandle::get, py::arg("timeout") = -1.0,
           "A tag-0 frame's payload (bytes), (tag, payload) for other tags, or a Status int.")
      .def("get_many", &RingHandle::get_many, py::arg("max_items"), py::arg("timeout") = -1.0,
           "(status, payloads, tags or None when every tag is 0).")
      .def("drain", &RingHandle::drain, py::arg("max_items") = 1 << 20,
           "Takes every frame left, as [(tag, payload)], ignoring this object's close().")
      .def("task_done", &RingHandle::task_done)
      .def("join", &RingHandle::join, py::arg("timeout") = -1.0)
      .def("close", &RingHandle::close, "Closes this object: its blocked calls return Closed.")
      .def("detach", &RingHandle::detach,
           "Stops holding the ring (reaping dead holders); True if no holder is left.")
      .def("release", &RingHandle::release,
           "After detach(): drops the block reference now (False if a call still runs).")
      .def("count_fork_child", &RingHandle::count_fork_child,
           "Before fork: counts the child's copy as a holder in flight (True if it holds).")
      .def("fork_parent_done", &RingHandle::fork_parent_done,
           "After fork, in the parent: forgets the count made for the child.")
      .def("attach_inherited", &RingHandle::attach_inherited,
           "After fork, in the child: this copy becomes a holder (adopting the parent's count).")
      .def("qsize", [](RingHandle& r) { return r.counts().count; })
      .def(
          "counts",
          [](RingHandle& r) {
            Ring::Counts c = r.counts();
            return py::make_tuple(c.count, c.used_bytes, c.unfinished);
          },
          "(items, bytes of frames, unfinished tasks), read together under the lock.")
      .def("set_doorbell", &RingHandle::set_doorbell, py::arg("read_fd"), py::arg("write_fd"),
           "SimpleQueue: every put and get keeps this wake-up pipe (Note [Doorbell]).")
      .def("watch_doorbell", &RingHandle::watch_doorbell,
           "Arms the doorbell and rings it if items are queued with no live ringer.")
      .def_property_readonly(
          "spin_state",
          [](RingHandle& r) {
            SpinPolicy::State st = r.ring().spin_state();
            return py::make_tuple(st.max_ns, st.misses, st.skip, st.off);
          },
          "(most ns a wait spins here, misses in a row, waits left without spinning, the next "
          "back-off): Note [Adaptive spinning].")
      .def_property_readonly("doorbell_owner",
                             [](RingHandle& r) { return r.ring().doorbell_owner(); })
      .def_property_readonly("capacity", [](RingHandle& r) { return r.ring().capacity(); },
                             "Bytes of frames it holds now (it may grow: Note [Ring growth]).")
      .def_property_readonly("max_capacity",
                             [](RingHandle& r) { return r.ring().max_capacity(); })
      .def_property_readonly("maxsize", [](RingHandle& r) { return r.ring().maxsize(); })
      .def_property_readonly("joinable", [](RingHandle& r) { return r.ring().joinable(); })
      .def_property_readonly("recoveries", [](RingHandle& r) { return r.ring().recoveries(); })
      .def_property_readonly("broken", [](RingHandle& r) { return r.ring().broken(); })
      .def_property_readonly("holders",
                             [](RingHandle& r) {
                               return *RingHandle::locked_read(
                                   [&](const Deadline& d) { return r.ring().holders(d); });
                             })
      .def(
          "holder_table",
          [](RingHandle& r) {
            py::list out;
            auto table = *RingHandle::locked_read(
                [&](const Deadline& d) { return r.ring().holder_table(d); });
            for (const auto& h : table) {
              out.append(py::make_tuple(h.pid, h.refs, h.alive));
            }
            return out;
          },
          "[(pid, queue objects, alive)] of the processes holding the ring.")
      .def_property_readonly("closed", &RingHandle::closed)
      .def_property_readonly("block", &RingHandle::block, "The arena block the ring lives in (None once released).")
      .def_property_readonly("attached", &RingHandle::attached);
}

}  // namespace torch_mp_ext::python
