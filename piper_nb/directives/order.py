"""`order`: temporal edges from each slot to the next (Piper's order).

A slot is a list of filters; all nodes it selects share the slot and may overlap (how
DualPipe's F&B pairs are said): they get one `overlap` id. Temporal edges order the work
of one device; an edge between passes on different devices is an error.
"""

from __future__ import annotations

from piper_nb.errors import PlanError
from piper_nb.ir.dag import COMPUTE, Edge, TrainingDAG

__all__ = ["apply_orders"]


def apply_orders(dag: TrainingDAG, orders: list[tuple[int, object]]) -> TrainingDAG:
    """All order directives at once (one rewrite: selections see the same DAG)."""
    if not orders:
        return dag
    edges: list[Edge] = []
    patched: dict = {}
    overlap = 0
    for index, directive in orders:
        new_edges, new_nodes, overlap = _order_edges(dag, directive, index, overlap)
        edges += new_edges
        patched.update(new_nodes)
    nodes = [patched.get(n.id, n) for n in dag.nodes] if patched else dag.nodes
    return dag.replace(nodes=nodes, edges=(*dag.edges, *edges),
                       step=f"order ({len(orders)} directives)")


def _order_edges(dag: TrainingDAG, directive, index: int, first_overlap: int):
    slots: list[list[str]] = []
    for i, group in enumerate(directive.groups):
        ids: list[str] = []
        for f in group:
            hit = [n.id for n in dag.select(f, COMPUTE)]
            if not hit:
                raise PlanError(f"order slot {i}: filter {dict(f)} matches no pass; check the "
                                "stage, microbatch and PASS (F, B, BI, BW)", directive=index,
                                op="order")
            ids += [h for h in hit if h not in ids]
        slots.append(ids)
    overlap = first_overlap
    patched = {}
    for ids in slots:
        if len(ids) > 1 and len(directive.groups[slots.index(ids)]) > 1:
            for nid in ids:
                patched[nid] = dag[nid].with_attrs(overlap=overlap)
            overlap += 1
    edges = []
    for i in range(len(slots) - 1):
        pairs = [(a, b) for a in slots[i] for b in slots[i + 1]
                 if set(dag[a].devices) & set(dag[b].devices)]
        if not pairs:
            a, b = slots[i][0], slots[i + 1][0]
            raise PlanError(
                f"order slot {i} ({a} on {list(dag[a].devices)}) and slot {i + 1} ({b} on "
                f"{list(dag[b].devices)}) run on different devices; an order sequences "
                "one device's work: write one order per device", directive=index, op="order")
        edges += [Edge(a, b, "temporal", origin=index) for a, b in pairs]
    return edges, patched, overlap
