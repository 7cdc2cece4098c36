"""The TrainingDAG: the one IR every strategy is a transformation of (Piper's global DAG).

Its nodes and edges are `ir.node`'s `Node` and `Edge`. Nodes are compute passes (F, B, BI,
BW per region and microbatch; U, the optimizer update) and communication (SEND, RECV,
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL). Each node has tags, a device set and a
logical stream. Edges are `data` or `temporal`. Everything is immutable: passes return new
DAGs (`dag.replace(...)`), and `dag.history` names the passes applied (`compiler.passes`),
so tools can show the DAG after each one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from piper_nb.ir.filters import SEG
from piper_nb.ir.kinds import Op
from piper_nb.ir.node import Edge, Node
from piper_nb.ir.text import dag_lines, dag_meta_json, parse_dag_lines

__all__ = ["TrainingDAG"]


@dataclass(frozen=True)
class TrainingDAG:
    """Immutable global training DAG; `meta` holds program-level facts (microbatches, ...)."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    meta: tuple[tuple[str, Any], ...] = ()
    history: tuple[str, ...] = ()
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    # ---- look-ups (cached; the DAG never changes) ---------------------------------
    def _idx(self) -> dict:
        if self._index is None:
            by_id = {n.id: n for n in self.nodes}
            succ: dict[str, list[Edge]] = defaultdict(list)
            pred: dict[str, list[Edge]] = defaultdict(list)
            for e in self.edges:
                succ[e.src].append(e)
                pred[e.dst].append(e)
            object.__setattr__(self, "_index", {"id": by_id, "succ": succ, "pred": pred})
        return self._index

    def __getitem__(self, nid: str) -> Node:
        return self._idx()["id"][nid]

    def __contains__(self, nid: str) -> bool:
        return nid in self._idx()["id"]

    def __len__(self) -> int:
        return len(self.nodes)

    def out_edges(self, nid: str) -> list[Edge]:
        return self._idx()["succ"].get(nid, [])

    def in_edges(self, nid: str) -> list[Edge]:
        return self._idx()["pred"].get(nid, [])

    def select(self, filt: Mapping[str, Any], ops: Iterable[Op] | None = None) -> list[Node]:
        """Nodes matching a filter, in DAG order (an index by tag keeps this fast)."""
        idx = self._idx()
        if "tags" not in idx:
            by_tag: dict[tuple, list[int]] = defaultdict(list)
            for i, n in enumerate(self.nodes):
                for k, v in n.tags:
                    by_tag[(k, v)].append(i)
                    by_tag[(k, "*")].append(i)
                if n.tag(SEG) is None:   # a stage's first segment: SEG 0
                    by_tag[(SEG, 0)].append(i)
                    by_tag[(SEG, "*")].append(i)
            idx["tags"] = {k: frozenset(v) for k, v in by_tag.items()}
        hits: frozenset[int] | None = None
        for k, v in filt.items():
            found = idx["tags"].get((k, v), frozenset())
            hits = found if hits is None else hits & found
            if not hits:
                return []
        positions = range(len(self.nodes)) if hits is None else sorted(hits)
        ops = set(ops) if ops is not None else None
        return [self.nodes[i] for i in positions if ops is None or self.nodes[i].op in ops]

    def get_meta(self, key: str, default: Any = None) -> Any:
        for k, v in self.meta:
            if k == key:
                return v
        return default

    # ---- rewriting ----------------------------------------------------------------
    def replace(self, *, nodes: Iterable[Node] | None = None, edges: Iterable[Edge] | None = None,
                meta: Mapping[str, Any] | None = None, step: str | None = None) -> TrainingDAG:
        merged = dict(self.meta)
        if meta:
            merged.update(meta)
        return TrainingDAG(
            nodes=tuple(nodes) if nodes is not None else self.nodes,
            edges=tuple(edges) if edges is not None else self.edges,
            meta=tuple(merged.items()),
            history=self.history + ((step,) if step else ()),
        )

    def with_history(self, history: tuple[str, ...]) -> TrainingDAG:
        """The same DAG with another history (its look-up index kept: nodes and edges are
        the same)."""
        out = TrainingDAG(self.nodes, self.edges, self.meta, tuple(history))
        object.__setattr__(out, "_index", self._index)
        return out

    def devices(self) -> tuple[int, ...]:
        return tuple(sorted({d for n in self.nodes for d in n.devices}))

    def regions(self) -> tuple:
        return self.get_meta("regions", ())

    def text(self) -> str:
        """One line per node then one per edge: the compact text form (see ir/text.py)."""
        return dag_lines(self)

    @classmethod
    def from_text(cls, text: str, meta: tuple = ()) -> TrainingDAG:
        """The DAG `text()` wrote (its meta is not in the text: pass it, or use JSON)."""
        nodes, edges, history = parse_dag_lines(text)
        return cls(tuple(nodes), tuple(edges), meta, history)

    def to_json(self) -> str:
        """The text form and the meta (JSON-able parts, dataclasses as objects)."""
        return json.dumps({"text": self.text(), "meta": dag_meta_json(self.meta)})

    @classmethod
    def from_json(cls, text: str) -> TrainingDAG:
        obj = json.loads(text)
        return cls.from_text(obj["text"], tuple(obj.get("meta", {}).items()))

    def __repr__(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            counts[n.op.value] += 1
        body = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        return f"TrainingDAG({len(self.nodes)} nodes, {len(self.edges)} edges: {body})"
