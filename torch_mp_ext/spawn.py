"""``torch_mp_ext.spawn``: torch's path (``torch.multiprocessing.spawn``) for the names of
:mod:`torch_mp_ext.processes.spawn`, where they are implemented."""

from .processes.spawn import *  # noqa: F403  (exactly the implementation's public names)
from .processes.spawn import __all__  # noqa: F401
