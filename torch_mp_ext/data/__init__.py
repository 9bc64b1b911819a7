"""Datasets without copy-on-read: Python objects stored once in shared memory.

A ``Dataset`` that keeps its samples as Python objects (a list of dicts, of paths, of labels)
is copied page by page into every DataLoader worker, because merely reading a Python object
writes its reference count. :class:`SharedList` and :class:`SharedDict` keep the items
serialized once in one shared-memory block and deserialize only the item read;
:func:`share_dataset` converts a dataset's attributes in place. Guide: docs/datasets.md.
"""

from __future__ import annotations

from .containers import SharedDict, SharedList
from .share import share_dataset

__all__ = ["SharedList", "SharedDict", "share_dataset"]
