"""The layout of a StateDictChannel's buffer: one aligned span per state_dict entry.

Fixed by the template when the channel is made, pickled with the channel, and checked on
every publish and read (keys, shapes, dtypes) and once when a pickled channel is rebuilt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Union

import torch

from ..errors import CorruptSegmentError

__all__ = ["Entry", "StateLike", "check_entries", "layout", "match_state", "state_of"]

_ALIGN = 64  # every tensor starts on a cache line (and so on any dtype's alignment)

StateLike = Union[torch.nn.Module, Mapping]


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def state_of(obj: StateLike, what: str) -> Mapping:
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return obj
    raise TypeError(f"{what} must be an nn.Module or a state_dict (a mapping of names to "
                    f"tensors), got {type(obj).__name__}")


def layout(template: Mapping) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for key, value in template.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(  # noqa: TRY004  (a mismatch with what a channel carries)
                f"template[{key!r}] is a {type(value).__name__}, not a tensor: a "
                "StateDictChannel carries tensors only (send other state another way)")
        if value.layout != torch.strided or value.is_nested:
            raise ValueError(f"template[{key!r}] is a {value.layout} tensor: only dense "
                             "(strided) tensors can be published")
        nbytes = value.numel() * value.element_size()
        entries.append(Entry(str(key), value.dtype, tuple(value.shape), offset, nbytes))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return entries, offset


def match_state(entries: list[Entry], index: Mapping[str, Entry], state: Mapping, verb: str,
                name: str) -> list[torch.Tensor]:
    """The tensors of ``state`` in template order, checked against the template."""
    missing = [e.key for e in entries if e.key not in state]
    unexpected = [k for k in state if k not in index]
    if missing or unexpected:
        raise ValueError(
            f"{verb}: the state_dict does not match the template of {name}: missing keys "
            f"{missing}, unexpected keys {unexpected} (the keys are fixed when the channel is "
            "made; make a new channel for a new model)")
    out = []
    for e in entries:
        t = state[e.key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(  # noqa: TRY004  (a mismatch with the template)
                f"{verb}: state_dict[{e.key!r}] is a {type(t).__name__}, not a tensor")
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise ValueError(
                f"{verb}: state_dict[{e.key!r}] is {t.dtype} of shape {tuple(t.shape)}, but "
                f"{name} holds {e.dtype} of shape {e.shape} for it (shapes and dtypes are "
                "fixed by the template when the channel is made)")
        out.append(t.detach())
    return out


def check_entries(entries: object, buffer_bytes: object) -> None:
    """A pickled channel's layout must describe tensors inside one buffer: every copy in and
    out of the channel trusts it (a forged nbytes would copy past the caller's tensor)."""
    if not isinstance(buffer_bytes, int) or not isinstance(entries, list):
        raise CorruptSegmentError("a pickled StateDictChannel has no valid layout")
    for e in entries:
        ok = (isinstance(e, Entry) and isinstance(e.dtype, torch.dtype)
              and isinstance(e.shape, tuple)
              and all(isinstance(d, int) and d >= 0 for d in e.shape)
              and isinstance(e.offset, int) and isinstance(e.nbytes, int) and e.offset >= 0)
        if ok:
            numel = 1
            for d in e.shape:
                numel *= d
            itemsize = torch.empty((), dtype=e.dtype).element_size()
            ok = e.nbytes == numel * itemsize and e.offset + e.nbytes <= buffer_bytes
        if not ok:
            raise CorruptSegmentError(
                f"a pickled StateDictChannel describes entry {e!r}, which is not a tensor "
                f"inside its {buffer_bytes}-byte buffers: the pickle was forged or corrupted")
