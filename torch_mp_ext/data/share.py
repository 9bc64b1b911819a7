"""``share_dataset``: the one-line fix for DataLoader's copy-on-read memory growth.

Note [What share_dataset converts]
The attributes of the dataset (its ``__dict__``), in place:

- a ``list`` of at least ``min_items`` items becomes a :class:`SharedList`, a ``dict`` of at
  least ``min_items`` entries a :class:`SharedDict` (exact types: a subclass may add
  behaviour a read-only copy would lose); smaller ones stay, their copies cost nothing;
- a CPU tensor moves into shared memory in place (``share_``), a numpy array of 64 KiB or
  more is replaced by a copy in shared memory: both then cross to spawn and forkserver
  workers as handles, instead of a copy per worker;
- a nested ``Dataset`` (``Subset.dataset``, the items of ``ConcatDataset.datasets``) is
  converted the same way, recursively;
- an attribute that names the same object as another (torchvision's ``ImageFolder.imgs`` is
  its ``samples``) becomes the same shared object.

A list or dict the dataset still appends to after this cannot be converted: name the ones to
convert with ``attrs``. Everything else is left as it is.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

from ..sharing import arena as _arena
from ..sharing import memory as _memory
from .containers import SharedDict, SharedList

__all__ = ["share_dataset"]

T = TypeVar("T")


def share_dataset(dataset: T, *, attrs: Optional[Iterable[str]] = None, min_items: int = 1000,
                  progress: Optional[bool] = None) -> T:
    """Moves a dataset's lists, dicts, tensors and arrays into shared memory, in place.

    After this, DataLoader workers read the dataset's samples without copying them (no
    copy-on-read under fork) and receive it as a few handles (no pickled copy per worker
    under spawn and forkserver) (Note [What share_dataset converts] says what changes).

    Args:
        dataset: any object with a ``__dict__``, usually a ``torch.utils.data.Dataset``.
        attrs: the names of the attributes to convert; by default every attribute of a
            convertible type (with ``min_items`` applied to lists and dicts).
        min_items: lists and dicts with fewer items are left alone unless named in
            ``attrs``.
        progress: print progress while building big stores (default: on a terminal).

    Returns:
        ``dataset`` itself.

    Raises:
        TypeError: ``dataset`` has no ``__dict__``, or an item cannot be stored (the message
            names the attribute, the item's index and its type).
        AttributeError: a name in ``attrs`` is not an attribute of ``dataset``.

    Example:
        ```python
        import torch
        import torch_mp_ext as mp

        class Records(torch.utils.data.Dataset):
            def __init__(self, n):
                self.items = [{"path": f"{i}.jpg", "label": i % 10} for i in range(n)]
            def __len__(self):
                return len(self.items)
            def __getitem__(self, i):
                return self.items[i]["label"]

        if __name__ == "__main__":
            dataset = mp.share_dataset(Records(5000))   # its list is now a SharedList
            assert isinstance(dataset.items, mp.SharedList)
            loader = torch.utils.data.DataLoader(dataset, batch_size=500, num_workers=2)
            assert sum(len(b) for b in loader) == 5000
        ```
    """
    _share(dataset, None if attrs is None else list(attrs), min_items, progress, {})
    return dataset


def _share(dataset: Any, attrs: Optional[list], min_items: int, progress: Optional[bool],
           done: dict) -> None:
    try:
        fields = vars(dataset)
    except TypeError:
        raise TypeError(f"share_dataset() needs an object with attributes (a __dict__), got "
                        f"{type(dataset).__name__}") from None
    names = list(fields) if attrs is None else attrs
    for name in names:
        if name not in fields:
            raise AttributeError(f"{type(dataset).__name__} has no attribute {name!r} to share")
        value = fields[name]
        if id(value) in done:  # an alias of one converted already (ImageFolder.imgs)
            fields[name] = done[id(value)][1]
            continue
        try:
            shared = _convert(value, attrs is not None, min_items, progress, done)
        except TypeError as exc:
            raise TypeError(f"{type(dataset).__name__}.{name}: {exc}") from exc
        if shared is not value:
            done[id(value)] = (value, shared)  # keeps value alive: ids stay unique
            fields[name] = shared


def _convert(value: Any, named: bool, min_items: int, progress: Optional[bool],
             done: dict) -> Any:
    t = type(value)
    if t is list:
        if value and all(isinstance(v, Dataset) for v in value[:1]):
            for sub in value:  # ConcatDataset.datasets: convert each, keep the list
                if id(sub) not in done:
                    done[id(sub)] = (sub, sub)
                    _share(sub, None, min_items, progress, done)
            return value
        return SharedList(value, progress=progress) if named or len(value) >= min_items \
            else value
    if t is dict:
        return SharedDict(value, progress=progress) if named or len(value) >= min_items \
            else value
    if isinstance(value, torch.Tensor):
        return _arena.share_(value) if value.device.type == "cpu" else value
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or (not named and value.nbytes < _memory.NUMPY_MIN_SHARED_BYTES):
            return value
        if value.size == 0 or _arena.is_shared(value):
            return value
        copy = _arena.empty_array(value.shape, value.dtype)
        copy[...] = value
        copy.flags.writeable = value.flags.writeable
        return copy
    if isinstance(value, Dataset) and id(value) not in done:
        done[id(value)] = (value, value)
        _share(value, None, min_items, progress, done)
    return value
