"""The base TrainingDAG of a captured model: F, B and U per region, before any directive.

F[r] -> F[c] carries the activations region c reads from region r; B[c] -> B[r] carries
their gradients (only for floating-point values); F[r] -> B[r] stands for the saved
activations; B[r] -> U[r] for the accumulated gradients.
"""

from __future__ import annotations

from piper_nb.directives.base import Context, Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import freeze_tags
from piper_nb.ir.kinds import EdgeKind, Op
from piper_nb.ir.node import Edge, Node, node_id

__all__ = ["base_dag", "build_dag"]


def _node(op: Op, region) -> Node:
    tags = freeze_tags({**dict(region.tags), "PASS": op.value})
    return Node(id=node_id(op, tags), op=op, tags=tags, region=region.index)


def base_dag(_: TrainingDAG | None, __: Directives, ctx: Context) -> TrainingDAG:
    """The first pass: the captured model's base DAG, its frozen parameters in the meta."""
    return build_dag(ctx.capture, ctx.values).replace(meta={"frozen": ctx.frozen})


def build_dag(capture, values: dict) -> TrainingDAG:
    """`values`: value name -> ValueInfo (from shape propagation); decides grad edges."""
    nodes: list[Node] = []
    edges: list[Edge] = []
    f, b = {}, {}
    for info in capture.regions:
        f[info.index], b[info.index], u = (_node(Op.F, info), _node(Op.B, info), _node(Op.U, info))
        nodes += [f[info.index], b[info.index], u]
        edges += [Edge(f[info.index].id, b[info.index].id), Edge(b[info.index].id, u.id)]
    flows: dict[tuple[int, int], list[str]] = {}
    for value, src in capture.producer.items():
        if src < 0:
            continue
        for dst in capture.consumers.get(value, ()):
            flows.setdefault((src, dst), []).append(value)
    for (src, dst), names in sorted(flows.items()):
        edges.append(Edge(f[src].id, f[dst].id, EdgeKind.DATA, tuple(names)))
        grads = tuple(v for v in names if values[v].requires_grad)
        if grads:
            edges.append(Edge(b[dst].id, b[src].id, EdgeKind.DATA, grads))
    meta = {"regions": capture.regions, "tied": dict(capture.tied), "splits": ()}
    return TrainingDAG(nodes=tuple(nodes), edges=tuple(edges), meta=tuple(meta.items()),
                       history=())
