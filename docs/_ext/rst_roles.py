"""Griffe extension for the API reference: the Sphinx roles of the package's docstrings become links.

The docstrings name other objects as Sphinx does (``:class:`~lightning_ckpt.core.plan.planner.CheckpointPlan```,
``:func:`plan_checkpointing```), which Markdown would show as they are. This turns each into a cross-reference to the
object's entry in the reference when the reference has one (a public, documented object of the package), and into
code otherwise (torch's functions, private helpers). Docstrings in the source stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(?P<short>~?)(?P<target>[^`]+)`")


def _documented(pkg: griffe.Module, path: str) -> str | None:
    """The canonical path of ``path`` when the reference renders it (an anchor exists), else None."""
    parts = path.split(".")
    if parts[0] != pkg.name or len(parts) == 1:
        return None
    try:
        obj = pkg[".".join(parts[1:])]
        if obj.is_alias:
            obj = obj.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    node: Any = obj
    while node is not None and node is not pkg:
        # Private names are filtered out, and objects without a docstring are not shown (modules always are).
        if node.name.startswith("_") or (not node.is_module and not node.docstring):
            return None
        node = node.parent
    return obj.path


class RstRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        def rewrite(obj: griffe.Object) -> None:
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(lambda m: self._link(m, obj, pkg), obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    rewrite(member)

        rewrite(pkg)

    @staticmethod
    def _link(match: re.Match[str], obj: griffe.Object, pkg: griffe.Module) -> str:
        target = match["target"].lstrip(".")
        text = target.rsplit(".", 1)[-1] if match["short"] else target
        scopes = [node.path for node in (obj, obj.parent, obj.module) if node is not None]
        for candidate in [target, *(f"{scope}.{target}" for scope in scopes), f"{pkg.name}.{target}"]:
            path = _documented(pkg, candidate)
            if path is not None:
                return f"[`{text}`][{path}]"
        return f"`{text}`"
