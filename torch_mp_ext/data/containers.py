"""``SharedList`` and ``SharedDict``: read-only stand-ins for a dataset's list and dict, kept
once in shared memory (Note [Store layout] in ``store.py``).

Example::

    from torch_mp_ext.data import SharedList, SharedDict
    samples = SharedList({"path": p, "label": y} for p, y in records)   # built once
    samples[3], samples[-1], samples[10:20], len(samples)               # like the list
    class_to_idx = SharedDict({"cat": 0, "dog": 1})

Note [Pickling a shared collection]
``multiprocessing``'s ``ForkingPickler`` (what spawn and forkserver use to send a worker its
target and arguments, and what torch_mp_ext's queues use) pickles a ``SharedList`` or
``SharedDict`` as its block handle: a few dozen bytes, however many items it holds, carrying
one counted reference that the receiver takes over (``rebuild_shared``), as a tensor's
handle does (Note [Block lifetime] in ``csrc/shm/layout.h``). A fork child inherits it with
the rest of its parent's memory. A plain ``pickle.dumps`` (``torch.save``, a file) writes the
items themselves, and loading that builds a new store: a handle means nothing outside the
processes of this run. ``copy.copy`` and ``copy.deepcopy`` return the object itself, as
for a tuple: it cannot change.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from multiprocessing import reduction
from typing import Any, Iterable, Optional, Union, cast, overload

from . import store as _store

__all__ = ["SharedList", "SharedDict", "rebuild_shared"]


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} bytes"
    value, unit = nbytes / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _read_only(obj: Any, *args: Any) -> None:
    name = type(obj).__name__
    raise TypeError(f"'{name}' object does not support item assignment or deletion: its "
                    f"items live once in shared memory, read-only. Build a new {name} from a "
                    "modified copy (list(...) or dict(...)) instead")


class _Stored:
    """What both collections are: a read-only view of one store, shared, never copied."""

    _store: _store.Store

    @classmethod
    def _from_store(cls, store: _store.Store) -> Any:
        out = cls.__new__(cls)
        out._store = store
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory holding the contents (the store's block)."""
        return self._store.nbytes

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        return self


class SharedList(_Stored, Sequence):
    """A read-only list whose items are stored once in shared memory.

    Indexing, slicing, iteration, ``len``, ``in``, ``index`` and ``count`` behave as for the
    list it was built from; reading item ``i`` deserializes that item only, into new objects
    of the reading process, and writes no shared page (Note [Reading touches no shared page]
    in ``store.py``), so DataLoader workers no longer copy the dataset page by page.

    Items may be anything picklable. ``None``, numbers, ``str``, ``bytes`` and
    tuples/lists/dicts/sets of those are stored compactly; numpy arrays and CPU tensors come
    back as zero-copy views of the shared bytes (arrays read-only; do not write to tensors in
    place, ``clone()`` them first); anything else is pickled.

    Args:
        items: an iterable of items, read once (a generator is fine: nothing but the store
            is kept).
        progress: print progress on stderr while building; by default only on a terminal
            and for 200,000 items or more.

    Raises:
        TypeError: an item cannot be pickled; the message names its index and type.
        SharedMemoryError: shared memory is full (an ``OSError``).

    Example:
        ```python
        import torch_mp_ext as mp

        records = mp.SharedList([{"id": i, "tags": ["a", "b"]} for i in range(1000)])
        assert len(records) == 1000 and records[7] == {"id": 7, "tags": ["a", "b"]}
        ```
    """

    __slots__ = ("_store",)
    __hash__ = None  # type: ignore[assignment]  # as a list's
    __setitem__ = __delitem__ = _read_only

    def __init__(self, items: Iterable = (), *, progress: Optional[bool] = None) -> None:
        if isinstance(items, SharedList):
            self._store = items._store
        else:
            self._store = _store.build_list(items, progress)

    def __len__(self) -> int:
        return self._store.records

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list: ...

    def __getitem__(self, index: Union[int, slice]) -> Any:
        """Item ``index``; a slice gives a ``list`` of the items it selects."""
        store = self._store
        n = store.records
        if type(index) is int:  # what samplers hand out: the hot path
            i = index
        elif isinstance(index, slice):
            record = store.record
            return [record(r) for r in range(*index.indices(n))]
        else:
            try:
                i = index.__index__()
            except AttributeError:
                raise TypeError(f"SharedList indices must be integers or slices, not "
                                f"{type(index).__name__}") from None
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("SharedList index out of range")
        return store.record(i)

    def __iter__(self) -> Iterator[Any]:
        return self._store.records_from(0, self._store.records)

    def __reversed__(self) -> Iterator[Any]:
        record = self._store.record
        return (record(r) for r in range(self._store.records - 1, -1, -1))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedList) and other._store is self._store:
            return True
        if not isinstance(other, (list, SharedList)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return (f"SharedList(<{len(self):,} items in {_size(self.nbytes)} of shared "
                "memory>)")

    def __reduce__(self) -> tuple:
        return (type(self), (list(self),))  # Note [Pickling a shared collection]


class _Items(ItemsView):
    def __iter__(self) -> Iterator[tuple]:
        store = cast(SharedDict, self._mapping)._store
        n = store.records // 2
        record = store.record
        return ((record(j), record(n + j)) for j in range(n))


class _Values(ValuesView):
    def __iter__(self) -> Iterator[Any]:
        store = cast(SharedDict, self._mapping)._store
        n = store.records // 2
        return store.records_from(n, 2 * n)


class SharedDict(_Stored, Mapping):
    """A read-only dict whose keys and values are stored once in shared memory.

    Lookup, ``in``, ``len``, iteration (in the original order), ``keys``, ``values``,
    ``items`` and ``get`` behave as for the dict it was built from, and read only the entries
    they touch (Note [Store layout] in ``store.py``: a hash table in the shared block, with a
    hash every process computes alike).

    Args:
        mapping: a mapping, or an iterable of ``(key, value)`` pairs. Keys must be ``str``,
            ``bytes``, ``int``, ``float``, ``None`` or tuples of those; values anything
            picklable, as for :class:`SharedList`.
        progress: as for :class:`SharedList`.

    Raises:
        TypeError: a key of another type, or an unpicklable key or value (the message
            names its index and type).
        SharedMemoryError: shared memory is full (an ``OSError``).

    Example:
        ```python
        import torch_mp_ext as mp

        vocab = mp.SharedDict({f"word{i}": i for i in range(1000)})
        assert vocab["word42"] == 42 and "word1000" not in vocab
        ```
    """

    __slots__ = ("_store",)
    __hash__ = None  # type: ignore[assignment]  # as a dict's
    __setitem__ = __delitem__ = _read_only

    def __init__(self, mapping: Union[Mapping, Iterable[tuple]] = (), *,
                 progress: Optional[bool] = None) -> None:
        if isinstance(mapping, SharedDict):
            self._store = mapping._store
            return
        if not isinstance(mapping, Mapping):
            mapping = dict(mapping)
        self._store = _store.build_dict(mapping, progress)

    def __len__(self) -> int:
        return self._store.records // 2

    def __getitem__(self, key: Any) -> Any:
        j = self._store.find(key)
        if j < 0:
            raise KeyError(key)
        return self._store.record(self._store.records // 2 + j)

    def __contains__(self, key: object) -> bool:
        return self._store.find(key) >= 0

    def __iter__(self) -> Iterator[Any]:
        return self._store.records_from(0, self._store.records // 2)

    def items(self) -> ItemsView:
        """A view of the ``(key, value)`` pairs, in the order of the dict it was built from;
        each value is read from shared memory as it is reached."""
        return _Items(self)

    def values(self) -> ValuesView:
        """A view of the values, in key order; each is read from shared memory when reached."""
        return _Values(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedDict) and other._store is self._store:
            return True
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return (f"SharedDict(<{len(self):,} entries in {_size(self.nbytes)} of shared "
                "memory>)")

    def __reduce__(self) -> tuple:
        return (type(self), (dict(self.items()),))  # Note [Pickling a shared collection]


def rebuild_shared(handle: tuple, kind: int) -> Union[SharedList, SharedDict]:
    """Rebuilds a shared collection from its handle, taking over the handle's reference
    (Note [Pickling a shared collection])."""
    store = _store.attach(handle)
    if kind == _store.KIND_DICT:
        return SharedDict._from_store(store)
    return SharedList._from_store(store)


def _reduce_shared(obj: Union[SharedList, SharedDict]) -> tuple:
    return (rebuild_shared, (obj._store.share(), obj._store.kind))


reduction.register(SharedList, _reduce_shared)
reduction.register(SharedDict, _reduce_shared)
