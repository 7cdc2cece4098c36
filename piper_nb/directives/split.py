"""`split`: copy the matched sub-DAG N times, copy i tagged `dim=i` (Piper's split).

The optimizer update U is never copied: every copy's backward feeds the one U. Splitting
along `MB` makes microbatches; the batch is cut into N equal chunks along dim 0.
"""

from __future__ import annotations

import dataclasses

from piper_nb.errors import PlanError
from piper_nb.ir.dag import Edge, Node, Op, TrainingDAG, node_id
from piper_nb.ir.filters import freeze_tags

__all__ = ["apply_split"]


def apply_split(dag: TrainingDAG, directive) -> TrainingDAG:
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
                       step=f"split {dim}={num}")
