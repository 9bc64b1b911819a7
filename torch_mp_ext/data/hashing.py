"""The hash and table a SharedDict looks its keys up with (Note [Store layout] in
``store.py``): the same in every process, consistent with ``==`` for the keys it accepts."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np

__all__ = ["stable_hash", "open_table"]


def stable_hash(key: Any) -> int:
    """A 32-bit hash of ``key`` that every process computes alike (Note [Store layout]).

    Raises:
        TypeError: ``key`` is not a ``str``, ``bytes``, number, ``None`` or tuple of those.
    """
    t = type(key)
    if t is str:
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if t is int or t is bool:
        return _int_hash(int(key))
    if t is bytes:
        return zlib.crc32(key, 0x5BD1E995)
    if key is None:
        return 0x9E3779B9
    if t is tuple:
        h = 0x345678
        for x in key:
            h = zlib.crc32(stable_hash(x).to_bytes(4, "little"), h)
        return h
    if isinstance(key, (int, np.integer)):
        return _int_hash(int(key))
    if isinstance(key, (float, np.floating)):
        value = float(key)
        if value.is_integer():
            return _int_hash(int(value))
        return zlib.crc32(struct.pack("<d", value), 0x27D4EB2F)
    if isinstance(key, complex) and key.imag == 0:
        return stable_hash(key.real)
    raise TypeError(f"a SharedDict key must be a str, bytes, int, float, None or a tuple of "
                    f"those, got {t.__name__}: {key!r}")


def _int_hash(value: int) -> int:
    return zlib.crc32(value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True),
                      0x165667B1)


def open_table(hashes: np.ndarray) -> np.ndarray:
    """The open-addressing table of Note [Store layout] for ``hashes``."""
    n = len(hashes)
    slots = 1 << max(3, (2 * n).bit_length())
    table = [0] * slots  # a list: item access costs a third of a numpy array's
    mask = slots - 1
    for j, h in enumerate(hashes.tolist(), 1):
        pos = h & mask
        while table[pos]:
            pos = (pos + 1) & mask
        table[pos] = j
    return np.array(table, dtype=np.uint32 if n < (1 << 32) - 1 else np.uint64)
