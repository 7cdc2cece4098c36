"""`split`: copy the matched sub-DAG N times, copy i tagged `dim=i` (Piper's split).

The value `Split` (Python `dim`, `num`; Piper's JSON `dim_name`, `num_microbatches`), its
constructor `pn.split`, and the rewrite. The optimizer update U is never copied: every
copy's backward feeds the one U. Splitting along `MB` makes microbatches; the batch is cut
into N equal chunks along dim 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.directives.base import Context, Directive, Directives, each, py_literal
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter, freeze_tags
from piper_nb.ir.kinds import Op
from piper_nb.ir.node import Edge, Node, node_id

__all__ = ["Split", "split", "apply_splits", "microbatches"]


@dataclass(frozen=True)
class Split(Directive):
    """Copy the matched sub-DAG `num` times, copy i tagged `dim=i` (microbatches)."""

    filter: Mapping[str, Any]
    dim: str = "MB"
    num: int = 1
    op = "split"
    json_names = {"dim": "dim_name", "num": "num_microbatches"}

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="split filter"))
        if not isinstance(self.dim, str) or not self.dim or self.dim == "PASS":
            raise PlanError(f"split: dim (JSON dim_name) must be a tag name such as 'MB', "
                            f"got {self.dim!r}")
        if isinstance(self.num, bool) or not isinstance(self.num, int) or self.num < 1:
            raise PlanError(f"split: num (JSON num_microbatches) must be a positive integer, "
                            f"got {self.num!r}")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Split:
        """`filter` defaults to {} (the whole model) and `dim_name` to MB; the count is needed."""
        if "num_microbatches" not in obj:
            raise PlanError("split: missing field 'num_microbatches'")
        return cls(obj.get("filter", {}), obj.get("dim_name", "MB"), obj["num_microbatches"])

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": microbatches}

    def code(self) -> str:
        return (f"pn.split({py_literal(self.filter)}, dim={py_literal(self.dim)}, "
                f"num={self.num!r})")


def split(filter: Mapping[str, Any], dim: str = "MB", num: int = 4) -> Split:
    """Split the sub-DAG `filter` matches into `num` copies along tag `dim` (microbatches)."""
    return Split(filter, dim, num)


def apply_splits(dag: TrainingDAG, splits: Directives, ctx: Context) -> TrainingDAG:
    """Every split in turn: the DAG copied along each one's tag (microbatches)."""
    return each(dag, splits, _split)


def _split(dag: TrainingDAG, directive: Split) -> TrainingDAG:
    dim, num = directive.dim, directive.num
    chosen = {n.id for n in dag.nodes if n.op != Op.U and n.selected_by(directive.filter)}
    if not chosen:
        raise PlanError(f"split filter {dict(directive.filter)} matches no F/B node; use {{}} "
                        "to split the whole model")
    if any(n.tag(dim) is not None for n in dag.nodes if n.id in chosen):
        raise PlanError(f"the DAG is already split along {dim}; give one split per dimension")
    compute = {n.id for n in dag.nodes if n.op != Op.U}
    if chosen != compute:
        missing = sorted({dag[n].tag("PP", "?") for n in compute - chosen}, key=str)
        raise PlanError(f"split filter {dict(directive.filter)} leaves regions (PP={missing}) "
                        "unsplit; every region must see the same microbatches: use filter {}")
    copies: dict[str, list[str]] = {}
    nodes: list[Node] = []
    for n in dag.nodes:
        if n.id not in chosen:
            nodes.append(n)
            continue
        ids = []
        for i in range(num):
            tags = freeze_tags({**dict(n.tags), dim: i})
            c = dataclasses.replace(n, id=node_id(n.op, tags), tags=tags)
            nodes.append(c)
            ids.append(c.id)
        copies[n.id] = ids
    edges: list[Edge] = []
    for e in dag.edges:
        s, d = copies.get(e.src), copies.get(e.dst)
        if s and d:
            edges += [dataclasses.replace(e, src=s[i], dst=d[i]) for i in range(num)]
        elif s:
            edges += [dataclasses.replace(e, src=x) for x in s]
        elif d:
            edges += [dataclasses.replace(e, dst=x) for x in d]
        else:
            edges.append(e)
    splits = (*dag.get_meta("splits", ()), (dim, num))
    return dag.replace(nodes=nodes, edges=edges, meta={"splits": splits},
                       step=f"{dim}={num}")


def microbatches(directives: Directives, bsz: int) -> int:
    """How many microbatches the program's splits cut a batch of `bsz` into (checked to
    divide it)."""
    splits = [(i, d) for i, d in directives if isinstance(d, Split)]
    micro = 1
    for _, d in splits:
        micro *= d.num
    if bsz % micro:
        raise PlanError(f"{micro} microbatches do not divide the batch of {bsz}; use a divisor "
                        f"of {bsz}", directive=splits[-1][0], op="split")
    return micro
