"""Model and context exchange between a learner and its collectors, DI-engine style.

- :mod:`.channel`: :class:`StateDictChannel`, a versioned latest-value channel in shared memory
  (its buffer layout in :mod:`.layout`).
- :mod:`.borrow`: reading its versions in place (``borrow_into``, ``copy=False``), no copy.
- :mod:`.model`: :class:`ModelExchanger`, :class:`PeriodicalModelExchanger`.
- :mod:`.context`: :class:`ContextChannel`, :class:`ContextExchanger`.
- :mod:`.dist`: the same exchangers across hosts over ``torch.distributed``.
- :mod:`.relay`: :class:`HostRelay`, one network copy per host, shared memory on it.
"""

from .channel import StateDictChannel
from .context import ContextChannel, ContextExchanger
from .model import Context, ModelExchanger, PeriodicalModelExchanger, run_step
from .relay import HostChannel, HostContextChannel, HostRelay

__all__ = [
    "Context",
    "ContextChannel",
    "ContextExchanger",
    "HostChannel",
    "HostContextChannel",
    "HostRelay",
    "ModelExchanger",
    "PeriodicalModelExchanger",
    "StateDictChannel",
    "run_step",
]
