"""Sharing strategies: ``file_descriptor`` and ``file_system``, with torch's names.

The strategy lives in ``torch.multiprocessing`` (torch's own ``share_memory_()`` reads it
there), so torch_mp_ext reads and writes that one value instead of keeping a copy that could
disagree. Unlike torch, children started through torch_mp_ext's ``Process`` (spawn and
forkserver included) inherit the parent's strategy: see Note [Strategy inheritance] in
``processes/context.py``.
"""

from __future__ import annotations

import sys

import torch.multiprocessing as _torch_mp

from ..errors import InvalidSharingStrategyError

__all__ = ["get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy"]

if sys.platform == "darwin" or sys.platform == "win32":
    _all_sharing_strategies = {"file_system"}
else:
    _all_sharing_strategies = {"file_descriptor", "file_system"}


def set_sharing_strategy(new_strategy: str) -> None:
    """Sets the strategy for sharing CPU tensors.

    Args:
        new_strategy: a name from :func:`get_all_sharing_strategies`.

    Raises:
        InvalidSharingStrategyError: (a ``ValueError`` and an ``AssertionError``) for an
            unknown name.

    Example:
        ```python
        import torch_mp_ext as mp

        mp.set_sharing_strategy("file_system")   # named segments instead of fds
        assert mp.get_sharing_strategy() == "file_system"
        ```
    """
    if new_strategy not in _all_sharing_strategies:
        raise InvalidSharingStrategyError(
            f"invalid sharing strategy {new_strategy!r}: expected one of "
            f"{sorted(_all_sharing_strategies)}"
        )
    _torch_mp.set_sharing_strategy(new_strategy)


def get_sharing_strategy() -> str:
    """Returns the current strategy for sharing CPU tensors.

    Example:
        ```python
        import torch_mp_ext as mp

        assert mp.get_sharing_strategy() == "file_descriptor"   # the default on Linux
        ```
    """
    return _torch_mp.get_sharing_strategy()


def get_all_sharing_strategies() -> set[str]:
    """Returns the set of sharing strategies supported on this platform.

    Example:
        ```python
        import torch_mp_ext as mp

        assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
        ```
    """
    return set(_all_sharing_strategies)
