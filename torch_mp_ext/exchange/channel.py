"""A versioned latest-value channel for state_dicts in shared memory: :class:`StateDictChannel`.

One process publishes, any number read, each getting the newest *complete* version -- never
a mix of two -- without pickling anything::

            learner                       shared memory (one block)                 collectors
  ch.publish(model.state_dict()) ──copy──▶ ┌────────┬──────────┬──────────┬──────────┐
                                           │ header │ buffer 0 │ buffer 1 │ buffer 2 │
                                           │ v=7    │ v=7      │ v=6      │ writing  │
                                           └────────┴────┬─────┴──────────┴──────────┘
                                                         └──copy──▶ ch.read_into(model)  (v=7)

Publishing copies the state into a back buffer, then makes it the newest version with one
atomic store; reading copies the newest buffer out (one ``memcpy`` per tensor, without the
GIL), or ``borrow_into`` makes a model's tensors views of it with no copy at all
(:mod:`.borrow`). Shapes and dtypes are fixed when the channel is made, from a template model or
state_dict. The layout, and why a writer or reader SIGKILLed at any instruction disturbs
nobody, is Note [Latest-value channel] in ``csrc/exchange/latest.h``.

Example::

    ch = mp.StateDictChannel(model)                 # in the parent: the template
    # learner                                       # collector (got ch as an argument)
    ch.publish(model.state_dict())                  v = ch.read_into(model, newer_than=v,
                                                                     timeout=60)
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Mapping

import torch

from .. import _C
from ..errors import ChannelClosedError, PeerDiedError
from ..sharing import memory as _memory
from ..timeouts import seconds
from . import borrow as _borrow
from .borrow import bump_versions, contiguous_strides
from .layout import Entry, StateLike, check_entries, layout, match_state, state_of
from .publisher import PublisherWatch

__all__ = ["StateDictChannel", "StateLike", "layout", "match_state", "state_of"]

_OK, _TIMEOUT, _CLOSED, _STALE, _BUSY = range(5)
_check_entries = check_entries  # the name tests/test_hostile.py knows
_READER_SLOTS = 128  # LATEST_READER_SLOTS in csrc/exchange/latest.h
_serial = itertools.count()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class StateDictChannel:
    """A versioned latest-value channel of state_dicts in shared memory.

    One writer at a time publishes versions (strictly increasing integers); readers copy
    the newest complete one into their model or a fresh state_dict. The channel pickles to
    children under every start method (a handle of a few dozen bytes: the memory is shared,
    not copied), and lives while any process holds it.

    Args:
        template: an ``nn.Module`` or state_dict whose keys, shapes and dtypes every
            published version has (its values are not used).
        buffers: versions kept in memory (2 to 64), the bound on the channel's shared memory:
            each buffer costs one state_dict. With the default 3 the writer never waits for
            readers that copy, nor for collectors that all borrow the newest version; with
            ``collectors + 2`` it never waits for borrowers at all (Note [Borrowed versions]
            in ``csrc/exchange/latest.h``).
        name: names the channel in errors and its repr.

    Raises:
        ValueError: a template entry is not a dense tensor, or ``buffers`` is out of range.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        def collector(channel):
            model = torch.nn.Linear(4, 2)
            version = channel.read_into(model, newer_than=-1, timeout=60)
            assert version == 0 and model.bias.eq(1).all()   # versions count from 0

        if __name__ == "__main__":
            learner = torch.nn.Linear(4, 2)
            channel = mp.StateDictChannel(learner)   # shapes and dtypes from the model
            p = mp.Process(target=collector, args=(channel,))
            p.start()
            with torch.no_grad():
                learner.bias.fill_(1)
            channel.publish(learner)   # version 0
            p.join(60)
            assert p.exitcode == 0
        ```
    """

    def __init__(self, template: StateLike, *, buffers: int = 3, name: str | None = None) -> None:
        entries, nbytes = layout(state_of(template, "template"))
        if isinstance(buffers, bool) or not isinstance(buffers, int) or not 2 <= buffers <= 64:
            raise ValueError(f"buffers must be an integer from 2 to 64, got {buffers!r}")
        block = _memory.allocate(_C.LatestChannel.required_bytes(buffers, nbytes))
        channel = _C.LatestChannel(block, buffers, nbytes, True)
        self._setup(channel, entries, name or f"state_dict-{os.getpid()}-{next(_serial)}")

    def _setup(self, channel: _C.LatestChannel, entries: list[Entry], name: str) -> None:
        self._channel = channel
        self._entries = entries
        self._index = {e.key: e for e in entries}
        self.name = name
        self._label = f"channel {name!r}"
        self._publish_lock = threading.Lock()
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        # id(tensor) -> (weakref, its plan's versions, index) of tensors bound to a borrowed
        # version (Note [Borrow plans])
        self._borrowed: dict[int, tuple] = {}
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Note [Borrow plans]
        self._places = _borrow.places(entries)
        self._watch = PublisherWatch(channel, name)
        weakref.finalize(self, self._watch.close)

    def __reduce__(self) -> tuple:
        ch = self._channel
        return (_rebuild,
                (ch.block.share(), ch.nbuffers, ch.buffer_bytes, self._entries, self.name))

    def __repr__(self) -> str:
        mb = self._channel.buffer_bytes / 2**20
        return (f"<StateDictChannel {self.name!r}: {len(self._entries)} tensors, {mb:.1f} MiB, "
                f"{self._channel.nbuffers} buffers, latest version {self.version}"
                f"{', closed' if self.closed else ''}>")

    # ---- queries -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The newest published version, ``-1`` before the first publish."""
        return self._channel.latest

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (in any process); False when the publisher
        died without closing (:attr:`publisher_died`)."""
        return self._channel.closed and not self._channel.publisher_died

    @property
    def publisher_died(self) -> bool:
        """True once the publishing process was found dead without having closed the channel
        (Note [Publisher death] in ``csrc/exchange/latest.h``): no newer version will come,
        and waits raise :class:`~torch_mp_ext.errors.PeerDiedError`."""
        self._watch.ensure()
        return self._channel.publisher_died

    def check_peer(self) -> None:
        """Raises :class:`~torch_mp_ext.errors.PeerDiedError` if the publisher died without
        closing the channel. Cheap: no system call once this process watches the publisher
        (Note [Publisher death] in ``csrc/exchange/latest.h``)."""
        if self.publisher_died:
            raise PeerDiedError(self._died_message())

    def _claim_publisher(self) -> None:
        """Records this process as the publisher before its first publish (a learner's
        exchanger): readers can then tell its death from its finish from the start."""
        self._channel.set_publisher()

    def _died_message(self) -> str:
        pid = (self._channel.publisher >> 32) & 0x3FFFFFFF
        return (f"the publisher of {self._label} (pid {pid}) died without closing it: no "
                f"version newer than {self.version} will come. Restart the publisher (the "
                "learner), or end this process; a learner that finishes calls close()")

    @property
    def nbytes(self) -> int:
        """Bytes of one version (all tensors, aligned)."""
        return self._channel.buffer_bytes

    def keys(self) -> list[str]:
        """The state_dict keys, in the template's order."""
        return [e.key for e in self._entries]

    def peek(self, newer_than: int = -1, *, multiple_of: int = 1) -> tuple[int, float] | None:
        """The newest complete version above ``newer_than`` (and a multiple of
        ``multiple_of``) and its age in seconds on this host's monotonic clock, or None."""
        found = self._channel.peek(newer_than, multiple_of)
        if found is None:
            return None
        version, published_ns = found
        return version, max(0.0, (time.monotonic_ns() - published_ns) / 1e9)

    def wait(self, newer_than: int = -1, *, multiple_of: int = 1,
             timeout: float | None = None) -> int:
        """Waits until a version above ``newer_than`` is complete and returns the newest.

        Args:
            newer_than: the version the caller has (``-1``: none).
            multiple_of: consider only versions that are multiples of this.
            timeout: seconds; ``None`` waits forever.

        Raises:
            TimeoutError: nothing newer within ``timeout``.
            ChannelClosedError: the channel was closed and nothing newer is there.
            PeerDiedError: the publisher died without closing, and nothing newer is there.
        """
        timeout = seconds(timeout)  # Note [Timeout values]
        self._watch.ensure()
        status = self._channel.wait(newer_than, multiple_of, timeout)
        self._check(status, newer_than, timeout)
        found = self._channel.peek(newer_than, multiple_of)
        return self.version if found is None else found[0]

    # ---- writing -----------------------------------------------------------------------

    def publish(self, state: StateLike, version: int | None = None, *,
                timeout: float | None = None) -> int:
        """Copies ``state`` into a back buffer and makes it the newest version.

        Nothing is pickled. CPU contiguous tensors are copied with one ``memcpy`` each,
        without the GIL; CUDA and strided ones through ``Tensor.copy_``.

        Args:
            state: an ``nn.Module`` or state_dict with exactly the template's keys, shapes
                and dtypes.
            version: the new version, above every published one; default: the latest + 1
                (0 first).
            timeout: how long to wait when every back buffer is pinned by readers (a copying
                read pins one for its copy, a borrow for as long as its tensors live);
                ``None`` waits forever.

        Returns:
            The version published.

        Raises:
            ValueError: a key is missing or unexpected, a tensor's shape or dtype differs
                from the template's, or ``version`` is not above the latest.
            RuntimeError: another process is publishing to this channel at this moment.
            TimeoutError: every back buffer stayed pinned by readers for ``timeout``.
            ChannelClosedError: the channel is closed.
        """
        sources = self._match(state_of(state, "state"), "publish")
        self._channel.set_publisher()  # Note [Publisher death]
        with self._publish_lock:
            if version is None:
                version = self._channel.latest + 1
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(f"version must be a non-negative integer, got {version!r}")
            timeout = seconds(timeout)
            status, index, busy = self._channel.begin_write(version, timeout)
            if status != _OK:
                self._check_write(status, version, busy, timeout)
            try:
                spans, slow = [], []
                for entry, src in zip(self._entries, sources):
                    if entry.nbytes == 0:
                        continue
                    if src.device.type == "cpu" and src.is_contiguous():
                        spans.append((entry.offset, src.data_ptr(), entry.nbytes))
                    else:
                        slow.append((entry, src))
                self._channel.copy_in(index, spans)
                with torch.no_grad():
                    for entry, src in slow:
                        self._view(index, entry).copy_(src)
                self._channel.commit(index, version)
            except BaseException:
                self._channel.abort(index)
                raise
        return version

    def close(self) -> None:
        """Marks the channel closed for every process: waiting readers wake up and get
        :class:`~torch_mp_ext.errors.ChannelClosedError` once nothing newer is left."""
        self._channel.close()

    # ---- reading -----------------------------------------------------------------------

    def read_into(self, target: StateLike, newer_than: int = -1, *, multiple_of: int = 1,
                  timeout: float | None = None) -> int:
        """Copies the newest complete version into ``target`` (a model, in place).

        Waits until a version above ``newer_than`` exists. When the call returns, every
        tensor of ``target`` holds that one version; the copy goes straight into the
        model's parameters and buffers (one ``memcpy`` each for CPU contiguous tensors).

        Args:
            target: an ``nn.Module`` (its parameters and buffers) or a state_dict of tensors
                with the template's keys, shapes and dtypes.
            newer_than: the version the caller has (``-1``: none); only newer ones are read.
            multiple_of: read only versions that are multiples of this.
            timeout: seconds to wait for a version; ``None`` waits forever.

        Returns:
            The version read.

        Raises:
            ValueError: ``target`` does not match the template (the message names the key).
            TimeoutError: nothing newer within ``timeout``.
            ChannelClosedError: the channel was closed and nothing newer is there.
            PeerDiedError: the publisher died without closing (Note [Publisher death] in
                ``csrc/exchange/latest.h``), and nothing newer is there.
        """
        _borrow.unbind(self, target)  # never copy into a borrowed version (borrow_into)
        return self._read(state_of(target, "target"), newer_than, multiple_of, timeout)[0]

    def read(self, newer_than: int = -1, *, multiple_of: int = 1,
             timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)``: the newest complete version, in fresh CPU tensors.

        Same arguments and errors as :meth:`read_into`.
        """
        out = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in self._entries}
        version, _ = self._read(out, newer_than, multiple_of, timeout)
        return version, out

    def borrow_into(self, target: StateLike, newer_than: int = -1, *, multiple_of: int = 1,
                    timeout: float | None = None) -> int:
        """Makes ``target``'s tensors views of the newest complete version: no copy.

        Like :meth:`read_into`, but in place: the model's own parameters and buffers (the
        same objects, ``requires_grad`` kept) are rebound to the version's shared memory,
        which stays pinned, never written by the publisher, while any of them views it.
        The next call rebinds them to the newer version and so lets the older one go;
        :meth:`release` gives the model private copies. Costs O(number of tensors).

        Borrowed tensors must not be written (Note [Borrowed versions] in
        ``csrc/exchange/latest.h``; run the model in ``eval()`` mode): a write is found at
        the next call and raises.

        Args:
            target: an ``nn.Module`` or a state_dict of CPU tensors (its own tensors are
                rebound) with the template's keys, shapes and dtypes.
            newer_than: as for :meth:`read_into`.
            multiple_of: as for :meth:`read_into`.
            timeout: as for :meth:`read_into`.

        Returns:
            The version borrowed.

        Raises:
            BorrowedWriteError: a tensor bound by the previous call was written in place
                (nothing new is borrowed then).
            ValueError: ``target`` does not match the template, or holds non-CPU tensors.
            TimeoutError, ChannelClosedError, PeerDiedError: as for :meth:`read_into`.
        """
        return _borrow.borrow_into(self, target, newer_than, multiple_of, seconds(timeout))

    def borrow(self, newer_than: int = -1, *, multiple_of: int = 1,
               timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` like :meth:`read`, but the tensors view the version's
        shared memory (no copy); it stays pinned while any of them lives.

        Same arguments and errors as :meth:`read_into`; the same rules as
        :meth:`borrow_into` (do not write the tensors).
        """
        return _borrow.borrow(self, newer_than, multiple_of, seconds(timeout))

    def release(self, target: StateLike) -> bool:
        """Gives ``target``'s borrowed tensors private copies (one copy), so the version it
        viewed is unpinned once nothing else views it. Returns False when ``target`` held
        nothing borrowed from this channel.

        Raises:
            BorrowedWriteError: a borrowed tensor was written in place.
        """
        return _borrow.release(self, target)

    def _read(self, target: Mapping, newer_than: int, multiple_of: int,
              timeout: float | None) -> tuple[int, int]:
        dests = self._match(target, "read_into")
        spans, slow = [], []
        for entry, dst in zip(self._entries, dests):
            if entry.nbytes == 0:
                continue
            if dst.device.type == "cpu" and dst.is_contiguous():
                spans.append((entry.offset, dst.data_ptr(), entry.nbytes))
            else:
                slow.append((entry, dst))
        timeout = seconds(timeout)
        deadline = _deadline(timeout)
        self._watch.ensure()
        while True:
            status, index, slot, version, published_ns = self._channel.begin_read(
                newer_than, multiple_of, _left(deadline))
            self._check(status, newer_than, timeout)
            try:
                self._channel.copy_out(index, spans)
                with torch.no_grad():
                    for entry, dst in slow:
                        dst.copy_(self._view(index, entry))
            finally:
                intact = self._channel.end_read(index, slot, version)
            if intact:
                bump_versions(dests)
                return version, published_ns

    # ---- helpers -----------------------------------------------------------------------

    def _match(self, state: Mapping, verb: str) -> list[torch.Tensor]:
        return match_state(self._entries, self._index, state, verb, self._label)

    def _view(self, index: int, entry: Entry) -> torch.Tensor:
        views = self._views.get(index)
        if views is None:
            ch = self._channel
            storage = _memory.storage_from_block(ch.block, ch.buffer_offset(index),
                                                 ch.buffer_bytes)
            views = {}
            for e in self._entries:
                if e.nbytes:
                    itemsize = torch.empty((), dtype=e.dtype).element_size()
                    views[e.key] = torch.empty(0, dtype=e.dtype).set_(
                        storage, e.offset // itemsize, e.shape, contiguous_strides(e.shape))
            self._views[index] = views
        return views[entry.key]

    def _check(self, status: int, newer_than: int, timeout: float | None) -> None:
        if status == _OK:
            return
        if self._channel.check_publisher():  # a timeout too: no watch thread may have run
            raise PeerDiedError(self._died_message())
        if status == _TIMEOUT:
            readers = self._channel.state()["readers"]
            if len(readers) >= _READER_SLOTS:
                raise TimeoutError(
                    f"every one of the {_READER_SLOTS} reader slots of {self._label} stayed "
                    f"held for {timeout} s (pids {sorted({pid for pid, _ in readers})}): each "
                    "borrowed version holds one while any of its tensors lives; let borrowed "
                    "state_dicts go, or release() models that are idle")
            raise TimeoutError(
                f"no version newer than {newer_than} was published on {self._label} within "
                f"{timeout} s (latest: {self.version}); is the writer alive and publishing?")
        if status == _CLOSED:
            raise ChannelClosedError(
                f"{self._label} is closed and holds no version newer than {newer_than} "
                f"(latest: {self.version})")

    def _check_write(self, status: int, version: int, busy: int, timeout: float | None) -> None:
        if status == _STALE:
            raise ValueError(f"publish: version {version} is not newer than {self._label}'s "
                             f"latest version {self.version}; versions must increase")
        if status == _BUSY:
            raise RuntimeError(
                f"publish: process {busy >> 32} is publishing to {self._label} right now; a "
                "channel has one writer at a time (publish from one process, or one thread)")
        if status == _CLOSED:
            raise ChannelClosedError(f"publish: {self._label} is closed")
        readers = sorted({pid for pid, pinned in self._channel.state()["readers"] if pinned})
        raise TimeoutError(
            f"publish: every back buffer of {self._label} stayed pinned by readers (pids "
            f"{readers}) for {timeout} s: collectors hold borrowed versions (borrow_into, "
            "copy=False) or a reader stopped in the middle of a read. Make the channel with "
            "more buffers (collectors + 2 never wait), or find the stalled reader")

    def _debug_state(self) -> dict:
        return self._channel.state()


def _rebuild(handle: tuple, nbuffers: int, buffer_bytes: int, entries: list[Entry],
             name: str) -> StateDictChannel:
    check_entries(entries, buffer_bytes)
    self = StateDictChannel.__new__(StateDictChannel)
    self._setup(_C.LatestChannel(_C.attach(handle), nbuffers, buffer_bytes, False), entries, name)
    return self
