"""Crash-safe shared-memory queues with the API of ``multiprocessing``'s.

::

    producer                       shared memory: one arena block              consumer
    put(obj): pickled here  ──▶  ┌ ring: [len tag payload][len tag ...] ┐ ──▶ get(): unpickled
    put_many(items): one lock ─▶ │ robust mutex, journaled commits,     │ ──▶ get_many(n)
                                 └ futex waits on CLOCK_MONOTONIC       ┘
    tensors and arrays inside items travel as block handles of a few dozen bytes

:class:`Queue`, :class:`JoinableQueue` and :class:`SimpleQueue` keep the signatures,
blocking rules and exceptions of ``multiprocessing``'s (``queue.Full``, ``queue.Empty``,
``ValueError`` once closed; ``timeout=None`` blocks for ever) and add ``put_many`` /
``get_many``. There is no feeder thread: ``put`` pickles in the caller's thread, so an
unpicklable item raises there and the queue stays usable. A process killed at any point,
even holding the queue's lock, never wedges the queue or delivers a torn item (Note [Ring
commit] in ``csrc/queue/ring.h``). Without ``max_bytes`` a queue is unbounded: its ring grows
in place in shared memory (Note [Ring growth] in ``csrc/queue/ring.h``); with it, the ring
holds that many bytes of frames and ``put`` waits while it is full. Items over 256 KiB go out
of line into an arena block (Note [Large items out of line] in ``_pickling.py``); tensors and
numpy arrays count for a few dozen bytes each, whatever their size.

Note [Queue lifetime]
Each queue object, in each process, is one *holder* of the ring (``Ring.holders``, a count in
shared memory): the creator, every unpickled copy (the pickle carries the holder it will
become) and every copy a fork inherits (counted in the parent before the fork: Note [Fork
children hold before they run] in ``csrc/python/bind_queue.cpp``). A holder stops holding
when the object is garbage collected, closed, or its process exits normally (an exit
finalizer, which forked multiprocessing children re-register). The holder that takes the
count to zero, in whichever process, drains what is left and drops the references those
frames hold (Note [Releasing dropped frames] in ``sharing/pickling.py``), then the ring's
block goes back to the arena with its last block reference. A SIGKILLed process stays a
holder: as with any block it held (Note [Process exit] in ``sharing/memory.py``), its queues
are reclaimed when the segment's owner exits.

Note [Failed puts]
Each block handle in a pickled item holds a counted reference (an array copied into a block
for the message has no other owner). A put that does not happen (``queue.Full``, a timeout,
Ctrl-C) drops them with the frame (Note [Releasing dropped frames] in ``sharing/pickling.py``).

Note [Rings are anonymous]
A queue's ring is an anonymous arena block whatever the sharing strategy: the strategy is
about what each *tensor* costs (an fd or a ``/dev/shm`` name), while a ring is one segment
that every process maps once and whose fd no receiver keeps (Note [fd budget] in
``csrc/shm/registry.h``). Anonymous, it can leave no name behind after a SIGKILL, and
``file_system`` users' ``/dev/shm`` holds only their tensors. The one cost: a process that
first receives a queue after its creator exited cannot map it (the creator's fd server is
gone), so give queues to processes while their creator lives (the usual parent → child).
"""

from __future__ import annotations

import errno
import multiprocessing.util
import os
import pickle
import queue
import threading
import warnings
from typing import Any, Iterable, List, NoReturn, Optional

import numpy as np
import torch

from .. import _C
from ..errors import PeerDiedError, QueueClosedError
from ..sharing.pickling import (
    DROPPERS,
    OOL_BYTES,
    PLAIN_TYPES,
    PROTOCOL,
    TAG_BLOCK,
    TAG_BYTES,
    TAG_RECORD,
    decode,
    dump_item,
    loads,
    release_frame,
    to_block,
)
from ..sharing.records import rebuild as rebuild_record
from ..sharing.records import remember_sent, share_array, share_tensor, share_tensor_deferred
from ..sharing.strategy import get_all_sharing_strategies
from ..timeouts import ring_seconds
from . import holders as _holders
from .compat import SimpleQueueCompat

__all__ = ["Queue", "JoinableQueue", "SimpleQueue", "DEFAULT_MAX_BYTES", "MAX_GROW_BYTES"]

#: Largest fixed ring (``max_bytes=``) a queue can have.
MAX_QUEUE_BYTES = 2**31
DEFAULT_MAX_BYTES = int(os.environ.get("TORCH_MP_EXT_QUEUE_BYTES", 4 * 1024 * 1024 - 4096))
"""Bytes of frames a queue's ring holds at first (``TORCH_MP_EXT_QUEUE_BYTES``; reserved at
creation; tensors and arrays count only for their handles). It grows unless ``max_bytes`` was
given (Note [Ring growth] in ``csrc/queue/ring.h``).

Example:
    ```python
    import torch_mp_ext as mp
    from torch_mp_ext.queues import DEFAULT_MAX_BYTES

    q = mp.Queue()
    assert q.max_bytes >= DEFAULT_MAX_BYTES   # grows on demand: unbounded like the stdlib's
    ```
"""
MAX_GROW_BYTES = int(os.environ.get("TORCH_MP_EXT_QUEUE_MAX_BYTES", 64 << 30))
"""Bytes of frames a queue made without ``max_bytes`` may grow to
(``TORCH_MP_EXT_QUEUE_MAX_BYTES``): address space mapped in each holder, pages only as used."""

#: Busy-wait before a blocked get/put sleeps (Note [Why not pthread_cond_t]).
SPIN_NS = int(os.environ.get("TORCH_MP_EXT_QUEUE_SPIN_NS", 50_000))

#: Note [Rings are anonymous]: only where there is no file_descriptor strategy is a ring named.
_Tensor = torch.Tensor
_ndarray = np.ndarray
_plain_dumps = pickle.dumps
_TIMEOUT_MAX = threading.TIMEOUT_MAX  # beyond it: for ever (Note [Timeout values])
_RING_NAMED = "file_descriptor" not in get_all_sharing_strategies()

_OK, _EMPTY, _FULL, _TIMEOUT, _CLOSED = (int(s) for s in (
    _C.Status.Ok, _C.Status.Empty, _C.Status.Full, _C.Status.Timeout, _C.Status.Closed))

def _record_of(obj: Any) -> Optional[bytes]:
    """Note [Lean tensor records]: the record of a plain tensor or array, else None."""
    tp = type(obj)
    if tp is _Tensor:
        return share_tensor(obj)
    if tp is _ndarray:
        return share_array(obj)
    return None


def _timeout(block: bool, timeout: Any) -> float:
    """Seconds for the ring: negative waits for ever, 0 never waits (negative user timeouts
    mean "do not wait", as in ``multiprocessing``; Note [Timeout values] for inf and NaN)."""
    if not block:
        return 0.0
    tp = type(timeout)
    if (tp is float or tp is int) and 0 <= timeout <= _TIMEOUT_MAX:
        return timeout  # type: ignore[no-any-return]  # the usual case, without 0.5 us of checks
    return ring_seconds(timeout, negative_ok=True)


def _rebuild(cls: Any, handle: tuple, maxsize: int) -> _RingQueue:
    self = cls.__new__(cls)
    self._maxsize = maxsize
    self._setup(_C.Ring.open(_C.attach(handle)))
    return self


def _rebuild_simple(cls: type, handle: tuple, read_fd: Any, write_fd: Any) -> Any:
    q: Any = _rebuild(cls, handle, 0)
    q._set_doorbell(read_fd.detach(), write_fd.detach())
    return q


def _drop_rebuild(cls: Any, handle: tuple, *rest: Any) -> None:
    """A queue in a pickle nobody will load (Note [Releasing dropped frames]): the holder it
    carried is taken and let go at once, which drains the ring if it was the last."""
    _holders.let_go(_C.Ring.open(_C.attach(handle)))


DROPPERS[(__name__, "_rebuild")] = DROPPERS[(__name__, "_rebuild_simple")] = _drop_rebuild


def _sparse_block(capacity: int) -> tuple[Any, int]:
    """(block, bytes the ring may grow to) for a growable ring: MAX_GROW_BYTES of address
    space, or less where the address space (``ulimit -v``) or the file size (``ulimit -f``:
    Note [File size limit] in ``csrc/shm/file_limit.h``) is limited: each try refused with
    ENOMEM or EFBIG asks for a quarter, down to a fixed ring of ``capacity``."""
    grow_to = MAX_GROW_BYTES
    while True:
        try:
            block = _C.allocate_sparse(_C.Ring.footprint(grow_to),
                                       _C.Ring.footprint(capacity), _RING_NAMED)
            return block, grow_to
        except OSError as e:
            if e.errno not in (errno.ENOMEM, errno.EFBIG) or grow_to <= capacity:
                raise
            grow_to = max(grow_to // 4, capacity)


class _RingQueue:
    """What the three queues share: a ring, pickling, closing, pickling the queue itself."""

    _joinable = False

    def __init__(self, maxsize: int = 0, *, max_bytes: Optional[int] = None,
                 ctx: Any = None) -> None:
        capacity = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        if (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 16
                or capacity > MAX_QUEUE_BYTES):
            raise ValueError(f"max_bytes must be an integer from 16 to {MAX_QUEUE_BYTES} "
                             f"(2 GiB), got {max_bytes!r}")
        if isinstance(maxsize, bool) or not isinstance(maxsize, int):
            raise TypeError(f"maxsize must be an integer, got {type(maxsize).__name__}")
        self._maxsize = maxsize if maxsize > 0 else 0
        if max_bytes is not None or MAX_GROW_BYTES <= capacity:
            block = _C.allocate(_C.Ring.footprint(capacity), _RING_NAMED)
            ring = _C.Ring.create(block, capacity, self._maxsize, self._joinable, SPIN_NS)
        else:  # Note [Ring growth]: one sparse segment, grown in place
            block, grow_to = _sparse_block(capacity)
            ring = _C.Ring.create(block, capacity, self._maxsize, self._joinable, SPIN_NS,
                                  grow_to, _RING_NAMED or _C.anonymous_backend() == "shm")
        self._setup(ring)

    def _setup(self, ring: _C.Ring) -> None:
        self._ring = ring
        self._closed = False
        self._max_payload = ring.max_capacity - _C.Ring.frame_bytes(0)
        # Note [Large items out of line]: larger frames go to an arena block.
        self._ool = min(OOL_BYTES, ring.capacity // 4)
        _holders.hold(ring)
        self._finalizer = multiprocessing.util.Finalize(self, _holders.let_go, args=(ring,))

    # -- pickling the queue itself: Queue objects cross to children (any start method) and
    #    may also be sent through other queues.
    def __reduce__(self) -> tuple:
        self._check_closed()
        return (_rebuild, (type(self), self._ring.share(), self._maxsize))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"capacity={self._ring.capacity}"
        return f"<{type(self).__module__}.{type(self).__qualname__} {state} at {id(self):#x}>"

    def _check_closed(self) -> None:
        if self._closed:
            raise QueueClosedError(f"Queue {self!r} is closed")

    def _raise(self, status: int) -> NoReturn:
        if status == _EMPTY:
            raise queue.Empty
        if status == _FULL:
            raise queue.Full
        if status == _CLOSED:
            raise QueueClosedError(f"Queue {self!r} is closed")
        raise RuntimeError(f"unexpected queue status {status}")

    def _note(self, exc: BaseException, obj: Any) -> None:
        if hasattr(exc, "add_note"):  # Python >= 3.11: the type shows in the traceback
            exc.add_note(f"while putting an item of type {type(obj).__qualname__} on "
                         f"{self!r}; nothing was put")

    def _oversize(self, obj: Any, nbytes: int) -> ValueError:
        return ValueError(
            f"an item of type {type(obj).__qualname__} pickles to {nbytes} bytes, more than "
            f"{self!r} can ever hold ({self._max_payload} bytes of payload): create the queue "
            f"with a larger max_bytes=, or send large data as tensors or numpy arrays (they "
            f"travel as shared-memory handles of a few dozen bytes)")

    def _unusual(self, result: Any) -> Any:
        if type(result) is int:
            self._raise(result)
        if result[0] == TAG_RECORD:  # the common unusual frame: one call less
            return rebuild_record(result[1])
        return decode(*result)

    # -- the multiprocessing API -----------------------------------------------------------
    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """Puts ``obj``, waiting for room unless ``block`` is false (then ``queue.Full``).

        Args:
            obj: any picklable object; tensors and arrays inside travel by handle.
            block: wait while the queue is full.
            timeout: most seconds to wait (``None``: for ever), then ``queue.Full``.

        Raises:
            queue.Full: no room in time.
            ValueError: the queue is closed (``QueueClosedError``), or ``obj`` can never fit.
            Exception: whatever pickling ``obj`` raised (nothing is put).
        """
        if self._closed:
            self._check_closed()
        tp = type(obj)
        sent = None  # a tensor's (record, key, storage): Note [Sent storages later]
        if tp is bytes:
            tag, data = TAG_BYTES, obj
            if len(obj) > self._ool:
                tag, data = TAG_BLOCK, to_block(TAG_BYTES, (obj,))
        elif tp is _Tensor and (sent := share_tensor_deferred(obj)) is not None:
            tag, data = TAG_RECORD, sent[0]  # Note [Lean tensor records]
        elif tp is _ndarray and (record := share_array(obj)) is not None:
            tag, data = TAG_RECORD, record
        else:
            tag = 0
            try:
                data = dump_item(obj, self._ool)
            except Exception as exc:
                self._note(exc, obj)
                raise
            if type(data) is not bytes:  # the chunks of a large pickle
                tag, data = TAG_BLOCK, to_block(0, data)
            elif len(data) > self._ool:
                tag, data = TAG_BLOCK, to_block(0, (data,))
        if len(data) > self._max_payload:
            release_frame(tag, data)  # a record's or an out-of-line block's reference
            raise self._oversize(obj, len(data))
        try:
            status = self._ring.put(data, tag, -1.0 if block and timeout is None
                                    else _timeout(block, timeout))
        except BaseException:  # Ctrl-C while waiting: nothing was put
            release_frame(tag, data)
            # Note [Puts after exit] (holders.py)
            if _holders.has_exited() and not self._ring.attached:
                return
            raise
        if status:
            release_frame(tag, data)  # Note [Failed puts]
            self._raise(status)
        if sent is not None:
            remember_sent(sent[1], sent[2])  # Note [Sent storages later]

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """Removes and returns the oldest item, waiting for one unless ``block`` is false.

        Raises:
            queue.Empty: nothing arrived in time.
            ValueError: the queue is closed (``QueueClosedError``).
        """
        if self._closed:
            self._check_closed()
        result = self._ring.get(-1.0 if block and timeout is None else _timeout(block, timeout))
        if type(result) is bytes:
            return loads(result)
        return self._unusual(result)

    def put_nowait(self, obj: Any) -> None:
        """``put(obj, False)``."""
        self.put(obj, False)

    def get_nowait(self) -> Any:
        """``get(False)``."""
        return self.get(False)

    def put_many(self, items: Iterable[Any], block: bool = True,
                 timeout: Optional[float] = None) -> None:
        """Puts every item, in order, under one lock: all of them or none.

        Raises:
            queue.Full: the batch did not fit in time (nothing was put).
            ValueError: closed, or the batch is larger than the queue could ever hold.
        """
        self._check_closed()
        payloads: List[bytes] = []
        tags: Optional[List[int]] = None
        append = payloads.append
        limit = self._ool
        obj: Any = None
        try:
            for obj in items:  # bytes items are pickled too here: one tag for the batch
                tp = type(obj)
                if tp in PLAIN_TYPES:  # dump_item's plain cases inline: a call per item
                    data = _plain_dumps(obj, PROTOCOL)  # was a tenth of put_many's time
                elif tp is tuple and len(obj) <= 8:
                    for x in obj:
                        if type(x) not in PLAIN_TYPES:
                            data = dump_item(obj, limit)
                            break
                    else:
                        data = _plain_dumps(obj, PROTOCOL)
                elif (tp is _Tensor or tp is _ndarray) and (record := _record_of(obj)):
                    if tags is None:
                        tags = [0] * len(payloads)
                    tags.append(TAG_RECORD)  # Note [Lean tensor records]
                    append(record)
                    continue
                else:
                    data = dump_item(obj, limit)
                if type(data) is bytes and len(data) <= limit:  # the usual item
                    append(data)
                    if tags is not None:
                        tags.append(0)
                    continue
                if tags is None:
                    tags = [0] * len(payloads)
                tags.append(TAG_BLOCK)  # Note [Large items out of line]
                append(to_block(0, data if type(data) is list else (data,)))
        except Exception as exc:
            self._note(exc, obj)
            for i, data in enumerate(payloads):
                release_frame(tags[i] if tags else 0, data)
            raise
        if not payloads:
            return
        status = -1
        try:
            status = self._ring.put_many(payloads, tags, _timeout(block, timeout))
        finally:
            if status:  # Note [Failed puts]
                for i, data in enumerate(payloads):
                    release_frame(tags[i] if tags else 0, data)
        if status:
            self._raise(status)

    def get_many(self, max_items: int, block: bool = True,
                 timeout: Optional[float] = None) -> List[Any]:
        """Removes up to ``max_items`` of the oldest items under one lock (at least one).

        Raises:
            queue.Empty: nothing arrived in time.
            TypeError: ``max_items`` is not an integer.
            ValueError: the queue is closed, or ``max_items`` < 1.
        """
        self._check_closed()
        if isinstance(max_items, bool) or not isinstance(max_items, int):
            raise TypeError(f"max_items must be an integer, got {type(max_items).__name__}")
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        status, payloads, tags = self._ring.get_many(max_items, _timeout(block, timeout))
        if status:
            self._raise(status)
        if tags is None:
            return [loads(p) for p in payloads]
        out, lost = [], None
        for tag, p in zip(tags, payloads):
            try:
                out.append(decode(tag, p))
            except PeerDiedError as exc:  # Note [Large items out of line]: the rest stands
                lost = exc
        if lost is not None:
            if not out:
                raise lost
            warnings.warn(f"get_many: {len(payloads) - len(out)} item(s) lost: {lost}",
                          RuntimeWarning, stacklevel=2)
        return out

    def _put_frame(self, data: bytes, timeout: float) -> bool:
        """Puts an item pickled by ``_pickling.dumps`` (at most ``max_bytes - 8`` bytes),
        waiting at most ``timeout`` s; False if there was no room, the frame and its
        references staying the caller's (pipelines pickle once, retry in slices)."""
        if self._closed:
            self._check_closed()
        status = self._ring.put(data, 0, timeout)
        if status in (_FULL, _TIMEOUT):
            return False
        if status:
            self._raise(status)
        return True

    def _wait_room(self, timeout: float) -> bool:
        """Waits at most ``timeout`` s until one more item of any size up to a small frame
        would fit, putting nothing; False at the timeout. It sleeps on the ring's
        ``not_full`` condition like a blocked put (Note [Produce into room] in
        ``pipeline/links.py``)."""
        if self._closed:
            self._check_closed()
        status = self._ring.wait_room(1, timeout)
        if status in (_FULL, _TIMEOUT):
            return False
        if status:
            self._raise(status)
        return True

    def _drain_frames(self) -> list:
        """Takes every frame left, as ``(tag, data)`` pairs, without unpickling them (the
        caller releases their references: ``release_frame``); [] on a closed object."""
        return [] if self._closed else self._ring.drain()

    def qsize(self) -> int:
        """Items in the queue now (exact at the moment it was read)."""
        self._check_closed()
        return self._ring.qsize()

    def empty(self) -> bool:
        """True if the queue held no item when checked."""
        return self.qsize() == 0

    def full(self) -> bool:
        """True if ``maxsize`` items are queued or no further item would fit."""
        self._check_closed()
        count, used, _ = self._ring.counts()
        if self._maxsize and count >= self._maxsize:
            return True
        return used + _C.Ring.frame_bytes(1) > self._ring.max_capacity

    def close(self) -> None:
        """Closes this queue object in this process: later calls on it raise ``ValueError``
        and its blocked calls return with it. Other processes' objects are not affected."""
        if self._closed:
            return
        self._closed = True
        self._ring.close()
        self._finalizer()  # stop holding the ring (Note [Queue lifetime])

    def join_thread(self) -> None:
        """No feeder thread to join; valid after :meth:`close`, as in ``multiprocessing``."""
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")

    def cancel_join_thread(self) -> None:
        """Nothing to cancel: items are in shared memory as soon as ``put`` returns."""

    @property
    def max_bytes(self) -> int:
        """Bytes of frames (pickled items plus 8 bytes each) the queue holds at most."""
        return self._ring.max_capacity

    @property
    def maxsize(self) -> int:
        """Items the queue holds at most (0: only ``max_bytes`` limits it)."""
        return self._maxsize


class Queue(_RingQueue):
    """``multiprocessing.Queue`` over a crash-safe shared-memory ring.

    Args:
        maxsize: most items queued at once; ``<= 0`` means no item limit.
        max_bytes: most bytes of frames queued at once, a fixed ring reserved at creation.
            Default: none; the ring starts at :data:`DEFAULT_MAX_BYTES` and grows (up to
            :data:`MAX_GROW_BYTES`) as items arrive.
        ctx: accepted for compatibility with ``multiprocessing.queues.Queue``; unused.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        def consumer(q):
            for batch in q.get_many(4, timeout=60):   # one lock for the lot
                assert batch.shape == (32, 3)

        if __name__ == "__main__":
            q = mp.Queue()
            p = mp.Process(target=consumer, args=(q,))
            p.start()
            q.put_many([torch.randn(32, 3) for _ in range(4)])
            p.join(60)
            assert p.exitcode == 0
        ```
    """


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``: a :class:`Queue` that counts unfinished tasks.

    Note [Unfinished tasks of a killed consumer]
    The unfinished count lives in the ring's state and changes in the same commit as the
    frames (Note [Ring commit]): a put that committed counted its items, one that did not
    counted nothing, whatever instruction its process died at. A get does not change it. So
    an item taken by a consumer that was killed before calling ``task_done()`` stays
    unfinished, exactly as with ``multiprocessing``: ``join()`` waits for it (and returns
    False after ``timeout``). A supervisor that restarts consumers calls ``task_done()`` once
    for each item a dead consumer took and never finished, if it wants ``join()`` to return.
    The kill-anywhere harness (tests/_kill_anywhere.py) checks the count after every kill.

    Example:
        ```python
        import torch_mp_ext as mp

        def worker(q):
            while (item := q.get(timeout=60)) is not None:
                q.task_done()
            q.task_done()

        if __name__ == "__main__":
            q = mp.JoinableQueue()
            p = mp.Process(target=worker, args=(q,))
            p.start()
            for item in [1, 2, 3, None]:
                q.put(item)
            assert q.join(timeout=60)   # True: every item was marked done
            p.join(60)
        ```
    """

    _joinable = True

    def task_done(self) -> None:
        """Marks one item taken by ``get`` as processed.

        Raises:
            ValueError: called more times than items were put.
        """
        if self._ring.task_done() == _EMPTY:
            raise ValueError("task_done() called too many times")

    def join(self, timeout: Optional[float] = None) -> Optional[bool]:
        """Blocks until every item put has been marked done by :meth:`task_done`.

        Args:
            timeout: most seconds to wait (``None``: for ever; a timeout is an extension).

        Returns:
            None without a timeout, as ``multiprocessing``'s; with one, True when no task is
            unfinished, False if ``timeout`` passed first.
        """
        self._check_closed()
        status = self._ring.join(ring_seconds(timeout, negative_ok=False))
        if status == _CLOSED:
            self._raise(status)
        return None if timeout is None else status == _OK


class SimpleQueue(SimpleQueueCompat, _RingQueue):
    """``multiprocessing.SimpleQueue``: unbounded in items, ``get``/``put`` block for ever.

    Args:
        max_bytes: most bytes of pickled items queued at once (see :class:`Queue`).
        ctx: accepted for compatibility; unused.

    Example:
        ```python
        import torch_mp_ext as mp

        def echo(q_in, q_out):
            q_out.put(q_in.get() * 2)

        if __name__ == "__main__":
            q_in, q_out = mp.SimpleQueue(), mp.SimpleQueue()
            p = mp.Process(target=echo, args=(q_in, q_out))
            p.start()
            q_in.put(21)
            assert q_out.get(timeout=60) == 42   # a timeout is an extension
            p.join(60)
        ```
    """

    def __init__(self, *, max_bytes: Optional[int] = None, ctx: Any = None) -> None:
        super().__init__(0, max_bytes=max_bytes)
        self._new_doorbell()

    def __reduce__(self) -> tuple:
        self._check_closed()
        return (_rebuild_simple, (type(self), self._ring.share(), *self._doorbell_fds()))

    # The stdlib's get() and put(obj) are the defaults of these (block for ever); the core
    # keeps the doorbell in both (Note [Doorbell]). Not wrappers: a Python frame per call
    # was a seventh of a small item's round trip.
    get = _RingQueue.get
    """Removes and returns the oldest item, waiting for one (same arguments as
    :meth:`Queue.get`; the standard library's ``SimpleQueue.get()`` takes none)."""
    put = _RingQueue.put
    """Adds ``obj`` at the end (same arguments as :meth:`Queue.put`; the standard
    library's ``SimpleQueue.put(obj)`` takes only the item)."""
