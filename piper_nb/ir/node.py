"""The atoms of the training DAG: `Node` (one pass or communication, with its tags, devices
and logical stream) and `Edge` (data that flows, or a temporal order), and `node_id`, the
canonical text id (`F[PP=1,MB=0]`) that both the DAG and its text form use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.ir.filters import Tags, matches, tags_text
from piper_nb.ir.kinds import EdgeKind, Op

__all__ = ["Node", "Edge", "node_id"]


def node_id(op: Op | str, tags: Mapping[str, Any] | Tags, suffix: str = "") -> str:
    """Canonical text id: `F[PP=1,MB=0]`, `ALL_REDUCE[PP=0]#grad0`."""
    return f"{Op(op).value}[{tags_text(tags)}]{suffix}"


@dataclass(frozen=True, slots=True)
class Node:
    """One DAG node. `devices` empty means not placed yet; `attrs` carry op details."""

    id: str
    op: Op
    tags: Tags
    region: int = -1
    devices: tuple[int, ...] = ()
    stream: str = "compute"
    attrs: tuple[tuple[str, Any], ...] = ()

    def tag(self, key: str, default: Any = None) -> Any:
        for k, v in self.tags:
            if k == key:
                return v
        return default

    @property
    def mb(self) -> int | None:
        return self.tag("MB")

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def with_attrs(self, **kw: Any) -> Node:
        merged = dict(self.attrs)
        merged.update(kw)
        return dataclasses.replace(self, attrs=tuple(sorted(merged.items())))

    def selected_by(self, filt: Mapping[str, Any]) -> bool:
        return matches(filt, dict(self.tags))

    def __str__(self) -> str:
        where = f"@{','.join(map(str, self.devices))}" if self.devices else ""
        return self.id + where


@dataclass(frozen=True, slots=True)
class Edge:
    src: str
    dst: str
    kind: EdgeKind = EdgeKind.DATA  # data flows, or only an order (temporal)
    values: tuple[str, ...] = ()  # activations (F edges) or their gradients (B edges)
    origin: int = -1  # index of the directive that added it (temporal edges), else -1

    def __str__(self) -> str:
        arrow = "->" if self.kind == EdgeKind.DATA else "~>"
        return f"{self.src} {arrow} {self.dst}"
