"""Starting, watching and joining processes.

- :mod:`.context`: start-method contexts (``get_context``) whose processes carry the sharing
  strategy and whose queues are :mod:`torch_mp_ext.queues`'.
- :mod:`.forkserver`: the fast forkserver (torch preloaded), behind ``"forkserver"``.
- :mod:`.dataloader`: DataLoader workers started by our contexts collate into arena blocks.
- :mod:`.loader`: ``torch_mp_ext.DataLoader``, which says why a worker died and may
  replace it (``max_worker_restarts``); :mod:`.worker_reports`: those reports.
- :mod:`.worker`: what runs in each worker before ``fn``; error and result files; dying with
  the parent.
- :mod:`.popen_spawn`: starting a spawn child (also from a script read from stdin).
- :mod:`.forkcheck`: the warning when a fork leaves other threads behind.
- :mod:`.exits`: why a process ended, explained.
- :mod:`.spawn`: ``spawn``/``start_processes``/``ProcessContext`` (torch's algorithm).
- :mod:`.launch`: workers of a ``torch.distributed`` job on torch.distributed.elastic.
- :mod:`.netif`: ``GLOO_SOCKET_IFNAME`` from the route to the master.
"""

from . import spawn as _spawn
from .context import default_context
from .forkserver import start_forkserver
from .launch import launch
from .netif import set_gloo_socket_ifname
from .spawn import *  # noqa: F403  (torch's spawn names: _spawn.__all__)

__all__ = [*_spawn.__all__, "default_context", "launch", "set_gloo_socket_ifname",
           "start_forkserver"]
