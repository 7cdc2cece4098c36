"""Split a full backward B into BI (input gradients) and BW (weight gradients).

Applied to every B node that an `order` names as BI or BW (zero-bubble, DualPipe).
BI takes B's incoming edges and sends gradients upstream; BW follows BI and feeds U.
"""

from __future__ import annotations

import dataclasses

from piper_nb.directives.base import Context, Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import freeze_tags
from piper_nb.ir.kinds import Op
from piper_nb.ir.node import Edge, Node, node_id

__all__ = ["split_backwards", "apply_backward_split", "names_split_backward"]


def split_backwards(dag: TrainingDAG, orders: Directives, ctx: Context) -> TrainingDAG:
    """Every B that an order names as BI or BW, split in two (reads the orders; the order
    pass applies them)."""
    return apply_backward_split(dag, names_split_backward([d for _, d in orders]))


def names_split_backward(order_directives) -> list[dict]:
    """Filters (with PASS=B) of every B an order names as BI or BW."""
    out = []
    for d in order_directives:
        for group in d.groups:
            for f in group:
                if f.get("PASS") in (Op.BI, Op.BW):
                    out.append({**f, "PASS": Op.B.value})
    return out


def apply_backward_split(dag: TrainingDAG, filters: list[dict]) -> TrainingDAG:
    if not filters:
        return dag
    targets = {n.id for f in filters for n in dag.select(f, (Op.B,))}
    if not targets:
        return dag
    nodes: list[Node] = []
    first, last = {}, {}
    for n in dag.nodes:
        if n.id not in targets:
            nodes.append(n)
            continue
        pair = []
        for op in (Op.BI, Op.BW):
            tags = freeze_tags({**dict(n.tags), "PASS": op.value})
            pair.append(dataclasses.replace(n, id=node_id(op, tags), op=op, tags=tags))
        nodes += pair
        first[n.id], last[n.id] = pair[0].id, pair[1].id
    edges: list[Edge] = []
    for e in dag.edges:
        src = e.src
        if src in targets:
            # gradients upstream leave from BI; the update waits for BW
            src = last[src] if dag[e.dst].op == Op.U else first[src]
        dst = first.get(e.dst, e.dst)
        edges.append(dataclasses.replace(e, src=src, dst=dst))
    edges += [Edge(first[t], last[t]) for t in targets]
    return dag.replace(nodes=nodes, edges=edges, step=f"{len(targets)} B")
