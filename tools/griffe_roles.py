"""A griffe extension for the docs site: Sphinx roles in docstrings become code spans, and
pointers to the source's design notes are left out.

The docstrings are Google style with Sphinx cross-reference roles (``:class:`Queue```,
``:func:`~torch_mp_ext.empty```), which mkdocstrings would print literally. This rewrites each
to a code span of the name as Sphinx would show it (``~`` keeps the last component only).
Loaded by mkdocs.yml (``extensions:`` of the python handler).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`(?P<target>[^`]+)`")


def _shown(match: re.Match) -> str:
    target = match.group("target")
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


# Note [Notes stay in the source]: docstrings point contributors at design notes
# ("(Note [Ring commit] in ``csrc/queue/ring.h``)"), which a reader of the site cannot
# follow. The site drops such a parenthetical, and shows a note's own heading as a bold
# title; the source keeps both.
_NOTE_ASIDE = re.compile(r"\s*\((?:see )?Note \[[^\]]+\][^()]*(?:\([^()]*\)[^()]*)*\)")
_NOTE_HEADING = re.compile(r"^(?P<indent>[ \t]*)Note \[(?P<title>[^\]]+)\]:?", re.MULTILINE)


def for_readers(text: str) -> str:
    """A docstring as the site shows it: roles as code spans, no pointers to source notes."""
    text = _ROLE.sub(_shown, text)
    text = _NOTE_ASIDE.sub("", text)
    return _NOTE_HEADING.sub(lambda m: f"{m.group('indent')}**{m.group('title')}.**", text)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring for readers (:func:`for_readers`) once the tree is built."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader,
                  **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = for_readers(obj.docstring.value)
