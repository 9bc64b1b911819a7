"""Sharing memory between processes: strategies, tensors and arrays born in shared memory.

- :mod:`.strategy`: ``file_descriptor`` / ``file_system``, with torch's names.
- :mod:`.memory`: storages and arrays over arena blocks (the torch/numpy side of ``_C``).
- :mod:`.arena`: the public allocation API (:func:`empty`, :func:`share_`, ...).
- :mod:`.pickling`: items as frames whose tensors travel as block handles.
- :mod:`.byvalue`: what cannot be pickled by reference, pickled by value (cloudpickle).

Pickling of tensors and storages (``reduce_*``/``rebuild_*``) lives in
:mod:`torch_mp_ext.reductions`, at torch's path, because pickles name it.
"""

from .arena import (
    empty,
    empty_array,
    empty_cache,
    empty_like,
    is_shared,
    memory_stats,
    share_,
    zeros,
    zeros_array,
)
from .byvalue import get_pickle_by_value, set_pickle_by_value
from .strategy import get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy

__all__ = [
    "empty",
    "empty_array",
    "empty_cache",
    "empty_like",
    "get_all_sharing_strategies",
    "get_pickle_by_value",
    "get_sharing_strategy",
    "is_shared",
    "memory_stats",
    "set_sharing_strategy",
    "set_pickle_by_value",
    "share_",
    "zeros",
    "zeros_array",
]
