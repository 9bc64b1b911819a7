"""Ray-style task pools whose generator tasks stream their values as they are yielded.

- :mod:`.pool`: :class:`TaskPool` and its collector thread.
- :mod:`.refs`: :class:`Ref`, :class:`RefGenerator`, :func:`get`, :func:`wait`.
- :mod:`.values`: task values in the arena, held by every Ref copy.
- :mod:`.streams`: the caller's side of a streaming task.
- :mod:`.state`: the pool's bookkeeping of tasks and workers.
- :mod:`.worker`: what a worker process runs.
"""

from .pool import TaskPool
from .refs import Ref, RefGenerator, get, wait

__all__ = ["Ref", "RefGenerator", "TaskPool", "get", "wait"]
