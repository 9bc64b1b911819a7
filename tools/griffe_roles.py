"""A griffe extension for the docs site: Sphinx roles in docstrings become code spans.

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


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring once the object tree is built."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader,
                  **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_shown, obj.docstring.value)
