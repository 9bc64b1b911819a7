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
GIL). Shapes and dtypes are fixed when the channel is made, from a template model or
state_dict. The layout, and why a writer or reader SIGKILLed at any instruction disturbs
nobody, is Note [Latest-value channel] in ``csrc/exchange/latest.h``.

Example::

    ch = mp.StateDictChannel(model)                 # in the parent: the template
    # learner                                       # collector (got ch as an argument)
    ch.publish(model.state_dict())                  v = ch.read_into(model, newer_than=v,
                                                                     timeout=60)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Union

import torch

from .. import _C
from ..errors import ChannelClosedError, CorruptSegmentError, PeerDiedError
from ..sharing import memory as _memory
from ..timeouts import seconds
from .publisher import PublisherWatch

__all__ = ["StateDictChannel"]

_OK, _TIMEOUT, _CLOSED, _STALE, _BUSY = range(5)
_serial = itertools.count()
_ALIGN = 64  # every tensor starts on a cache line (and so on any dtype's alignment)

StateLike = Union[torch.nn.Module, Mapping]


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def state_of(obj: StateLike, what: str) -> Mapping:
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return obj
    raise TypeError(f"{what} must be an nn.Module or a state_dict (a mapping of names to "
                    f"tensors), got {type(obj).__name__}")


def layout(template: Mapping) -> tuple[list[_Entry], int]:
    entries, offset = [], 0
    for key, value in template.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(  # noqa: TRY004  (a mismatch with what a channel carries)
                f"template[{key!r}] is a {type(value).__name__}, not a tensor: a "
                "StateDictChannel carries tensors only (send other state another way)")
        if value.layout != torch.strided or value.is_nested:
            raise ValueError(f"template[{key!r}] is a {value.layout} tensor: only dense "
                             "(strided) tensors can be published")
        nbytes = value.numel() * value.element_size()
        entries.append(_Entry(str(key), value.dtype, tuple(value.shape), offset, nbytes))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return entries, offset


def match_state(entries: list[_Entry], index: Mapping[str, _Entry], state: Mapping, verb: str,
                name: str) -> list[torch.Tensor]:
    """The tensors of ``state`` in template order, checked against the template."""
    missing = [e.key for e in entries if e.key not in state]
    unexpected = [k for k in state if k not in index]
    if missing or unexpected:
        raise ValueError(
            f"{verb}: the state_dict does not match the template of {name}: missing keys "
            f"{missing}, unexpected keys {unexpected} (the keys are fixed when the channel is "
            "made; make a new channel for a new model)")
    out = []
    for e in entries:
        t = state[e.key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(  # noqa: TRY004  (a mismatch with the template)
                f"{verb}: state_dict[{e.key!r}] is a {type(t).__name__}, not a tensor")
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise ValueError(
                f"{verb}: state_dict[{e.key!r}] is {t.dtype} of shape {tuple(t.shape)}, but "
                f"{name} holds {e.dtype} of shape {e.shape} for it (shapes and dtypes are "
                "fixed by the template when the channel is made)")
        out.append(t.detach())
    return out


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
        buffers: versions kept in memory (2 to 16). With the default 3 the writer never waits
            for a reader that holds the previous version; each buffer costs one state_dict
            of shared memory.
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
        if isinstance(buffers, bool) or not isinstance(buffers, int) or not 2 <= buffers <= 16:
            raise ValueError(f"buffers must be an integer from 2 to 16, got {buffers!r}")
        block = _memory.allocate(_C.LatestChannel.required_bytes(buffers, nbytes))
        channel = _C.LatestChannel(block, buffers, nbytes, True)
        self._setup(channel, entries, name or f"state_dict-{os.getpid()}-{next(_serial)}")

    def _setup(self, channel: _C.LatestChannel, entries: list[_Entry], name: str) -> None:
        self._channel = channel
        self._entries = entries
        self._index = {e.key: e for e in entries}
        self.name = name
        self._label = f"channel {name!r}"
        self._publish_lock = threading.Lock()
        self._views: dict[int, dict[str, torch.Tensor]] = {}
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
            timeout: how long to wait when every back buffer is being read (each read holds
                one only for its copy); ``None`` waits forever.

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
        return self._read(state_of(target, "target"), newer_than, multiple_of, timeout)[0]

    def read(self, newer_than: int = -1, *, multiple_of: int = 1,
             timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)``: the newest complete version, in fresh CPU tensors.

        Same arguments and errors as :meth:`read_into`.
        """
        out = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in self._entries}
        version, _ = self._read(out, newer_than, multiple_of, timeout)
        return version, out

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
                _bump_versions(dests)
                return version, published_ns

    # ---- helpers -----------------------------------------------------------------------

    def _match(self, state: Mapping, verb: str) -> list[torch.Tensor]:
        return match_state(self._entries, self._index, state, verb, self._label)

    def _view(self, index: int, entry: _Entry) -> torch.Tensor:
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
                        storage, e.offset // itemsize, e.shape, _contiguous_strides(e.shape))
            self._views[index] = views
        return views[entry.key]

    def _check(self, status: int, newer_than: int, timeout: float | None) -> None:
        if status == _OK:
            return
        if self._channel.check_publisher():  # a timeout too: no watch thread may have run
            raise PeerDiedError(self._died_message())
        if status == _TIMEOUT:
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
            f"{readers}) for {timeout} s; a reader stopped in the middle of a read? Make the "
            "channel with more buffers, or find the stopped reader")

    def _debug_state(self) -> dict:
        return self._channel.state()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _bump_versions(tensors: list[torch.Tensor]) -> None:
    # Autograd tracks in-place writes by version counters; memcpy bypasses them, so a graph
    # that saved the old weights would otherwise compute its backward with the new ones.
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        for t in tensors:
            if not t.is_inference():  # inference tensors have no version counter
                bump(t)


def _check_entries(entries: object, buffer_bytes: object) -> None:
    """A pickled channel's layout must describe tensors inside one buffer: every copy in and
    out of the channel trusts it (a forged nbytes would copy past the caller's tensor)."""
    if not isinstance(buffer_bytes, int) or not isinstance(entries, list):
        raise CorruptSegmentError("a pickled StateDictChannel has no valid layout")
    for e in entries:
        ok = (isinstance(e, _Entry) and isinstance(e.dtype, torch.dtype)
              and isinstance(e.shape, tuple)
              and all(isinstance(d, int) and d >= 0 for d in e.shape)
              and isinstance(e.offset, int) and isinstance(e.nbytes, int) and e.offset >= 0)
        if ok:
            numel = 1
            for d in e.shape:
                numel *= d
            itemsize = torch.empty((), dtype=e.dtype).element_size()
            ok = e.nbytes == numel * itemsize and e.offset + e.nbytes <= buffer_bytes
        if not ok:
            raise CorruptSegmentError(
                f"a pickled StateDictChannel describes entry {e!r}, which is not a tensor "
                f"inside its {buffer_bytes}-byte buffers: the pickle was forged or corrupted")


def _rebuild(handle: tuple, nbuffers: int, buffer_bytes: int, entries: list[_Entry],
             name: str) -> StateDictChannel:
    _check_entries(entries, buffer_bytes)
    self = StateDictChannel.__new__(StateDictChannel)
    self._setup(_C.LatestChannel(_C.attach(handle), nbuffers, buffer_bytes, False), entries, name)
    return self
