"""Checking the ``timeout`` arguments of every blocking call (issue 13).

Note [Timeout values]
A timeout crosses into the C++ core as seconds in a double, turned there into a deadline on
CLOCK_MONOTONIC in nanoseconds. So before it goes down, every public blocking call passes its
timeout through :func:`seconds`:

- ``None``, ``math.inf`` and anything longer than ``threading.TIMEOUT_MAX`` (about 292 years)
  wait for ever. (The standard library raises ``OverflowError`` for those instead, on some
  calls; a wait nobody will see end is what such a timeout asks for.)
- NaN raises ``ValueError``: it compares false with everything, so no wait could honour it.
- A negative number raises ``ValueError("'timeout' must be a non-negative number")``, the
  wording of ``queue.Queue``, except where the call it replaces accepts it:
  ``multiprocessing.Queue.get/put`` treat a negative timeout as 0 (don't wait), and so do ours
  (``negative_ok=True``).
- Anything but a real number (``bool`` included) raises ``TypeError``.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Optional

__all__ = ["seconds", "FOREVER"]

#: What :func:`seconds` returns for "wait for ever" (the C++ core's spelling is negative).
FOREVER = None
_TIMEOUT_MAX = threading.TIMEOUT_MAX


def seconds(timeout: Any, *, negative_ok: bool = False, name: str = "timeout") -> Optional[float]:
    """``timeout`` as seconds to wait (>= 0), or None for ever (Note [Timeout values]).

    Args:
        timeout: what the caller passed.
        negative_ok: a negative timeout means 0 (``multiprocessing.Queue``) instead of an error.
        name: the argument's name, for the messages.

    Raises:
        TypeError: not a real number or None.
        ValueError: NaN, or negative unless ``negative_ok``.
    """
    tp = type(timeout)
    if (tp is float or tp is int) and 0 <= timeout <= _TIMEOUT_MAX:
        return float(timeout)  # the usual case first: isinstance(x, numbers.Real) is slow
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"'{name}' must be a number or None, got {type(timeout).__name__}")
    value = float(timeout)
    if math.isnan(value):
        raise ValueError(f"'{name}' must be a non-negative number, got nan")
    if value < 0:
        if negative_ok:
            return 0.0
        raise ValueError(f"'{name}' must be a non-negative number")
    if value > threading.TIMEOUT_MAX:
        return None
    return value


def ring_seconds(timeout: Any, *, negative_ok: bool = True) -> float:
    """:func:`seconds` in the C++ core's convention: -1.0 waits for ever."""
    value = seconds(timeout, negative_ok=negative_ok)
    return -1.0 if value is None else value
