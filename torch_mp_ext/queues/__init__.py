"""Crash-safe shared-memory queues with the API of ``multiprocessing``'s.

- :mod:`.ring_queue`: :class:`Queue`, :class:`JoinableQueue`, :class:`SimpleQueue` over the
  C++ ring (``_C.Ring``).
- :mod:`.compat`: what ``multiprocessing.pool.Pool`` and ``ProcessPoolExecutor`` need of a
  SimpleQueue beyond its public API.
- :mod:`.array_queue`: :class:`ArrayQueue`, a queue over a fixed pool of same-shaped arrays.
"""

from .array_queue import ArrayQueue
from .ring_queue import DEFAULT_MAX_BYTES, JoinableQueue, Queue, SimpleQueue

__all__ = ["DEFAULT_MAX_BYTES", "ArrayQueue", "JoinableQueue", "Queue", "SimpleQueue"]
