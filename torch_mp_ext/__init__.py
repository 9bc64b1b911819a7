"""torch_mp_ext: a faster, safer drop-in replacement for ``torch.multiprocessing``.

``import torch_mp_ext as mp`` offers every name ``torch.multiprocessing`` offers (and so the
standard library's ``multiprocessing``), with CPU tensors and numpy arrays shared through a
pooled shared-memory arena instead of one fd or one ``/dev/shm`` file per storage. Beyond the
drop-in surface: tensors born in shared memory (:func:`empty`, :func:`empty_array`,
:func:`share_`); see the docs for queues, pipelines, tasks and model exchange.
"""

from __future__ import annotations

import multiprocessing as _stdlib_mp

import torch

from . import _C, cuda, reductions
from ._version import __version__
from .exchange.channel import StateDictChannel
from .exchange.context import ContextChannel, ContextExchanger
from .exchange.model import ModelExchanger, PeriodicalModelExchanger
from .exchange.relay import HostRelay
from .pipeline.api import Pipeline, Stage, pipeline, stage
from .processes.context import default_context as _default_context
from .processes.forkserver import start_forkserver
from .processes.launch import launch
from .processes.netif import set_gloo_socket_ifname
from .queues.array_queue import ArrayQueue
from .reductions import init_reductions
from .sharing.arena import (
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
from .sharing.byvalue import get_pickle_by_value, set_pickle_by_value
from .sharing.strategy import (
    _all_sharing_strategies,
    get_all_sharing_strategies,
    get_sharing_strategy,
    set_sharing_strategy,
)
from .spawn import (
    ENV_VAR_PARALLEL_START,
    ProcessContext,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    spawn,
    start_processes,
)

# Private names torch.multiprocessing exports too (Note [Torch internals]).
from .torch_internals import get_thread_name as _get_thread_name
from .torch_internals import prctl_pr_set_pdeathsig as _prctl_pr_set_pdeathsig
from .torch_internals import set_thread_name as _set_thread_name

# The standard library's names, bound to torch_mp_ext's default context (as multiprocessing
# binds them to its own): mp.Process, mp.Queue, mp.get_context(...), ...
globals().update((name, getattr(_default_context, name)) for name in _stdlib_mp.__all__)

# Tasks (docs/tasks.md), the DataLoader that replaces dead workers (docs/dataloader.md) and
# datasets without copy-on-read (docs/datasets.md): attributes, not in __all__, which stays
# torch.multiprocessing's.
from .data import SharedDict, SharedList, share_dataset
from .processes.loader import DataLoader
from .tasks.pool import TaskPool
from .tasks.refs import Ref, RefGenerator, get, wait

__all__ = [
    "set_sharing_strategy",
    "get_sharing_strategy",
    "get_all_sharing_strategies",
] + list(_stdlib_mp.__all__)

init_reductions()
