"""Insert SEND/RECV pairs on data edges whose ends run on different devices.

Device groups pair up by position: replica i of the producer sends to replica i of the
consumer, so both ends must be groups of one size. Edges into or out of expert (sharded)
regions are left to `shard`, which turns them into all-to-all.

One message per (pass, other device group), not one per edge:

- a forward's output read by several regions of one device group (a skip connection to
  a later chunk of the same rank, an encoder output read by every decoder stage) is sent
  there once, and that one RECV feeds every reader;
- the gradient contributions a device group makes to one producer's outputs are summed
  there and sent once, after the last contributing backward. A device keeps one gradient
  buffer per value and microbatch, so two messages cut from it would both carry the
  running sum (the first contribution would arrive twice): the bug that interleaved 1F1B
  and DualPipeV had with skip edges across stages.
"""

from __future__ import annotations

from piper_nb.directives.base import Context, Directives
from piper_nb.directives.shard import experts_of
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import COMPUTE, EdgeKind, Op
from piper_nb.ir.node import Edge, Node

__all__ = ["insert_send_recv"]


def _crosses(dag: TrainingDAG, e: Edge, skip_regions: frozenset[int]) -> bool:
    a, b = dag[e.src], dag[e.dst]
    return not (e.kind != EdgeKind.DATA or a.op not in COMPUTE or b.op not in COMPUTE or b.op == Op.U
                or a.devices == b.devices or a.region in skip_regions
                or b.region in skip_regions)


def insert_send_recv(dag: TrainingDAG, _: Directives, ctx: Context) -> TrainingDAG:
    """A SEND/RECV pair per (pass, other device group) whose data edges cross devices."""
    skip_regions = experts_of(dag)
    nodes = list(dag.nodes)
    edges: list[Edge] = []
    groups: dict[tuple, list[Edge]] = {}
    for e in dag.edges:
        if not _crosses(dag, e, skip_regions):
            edges.append(e)
            continue
        a, b = dag[e.src], dag[e.dst]
        if len(a.devices) != len(b.devices):
            raise PlanError(f"{a.id} runs on {list(a.devices)} and {b.id} on {list(b.devices)}: "
                            "data can only flow between groups of the same size (replica i sends "
                            "to replica i); place both sides on the same number of devices")
        # activations: one producer to a device group; gradients: a device group to one producer
        key = (False, a.id, b.devices) if a.op == Op.F else (True, b.id, a.devices)
        groups.setdefault(key, []).append(e)
    for (grad, _, _), group in groups.items():
        send, recv, new_edges = _pair(dag, group, grad=grad)
        nodes += [send, recv]
        edges += new_edges
    return dag.replace(nodes=nodes, edges=edges)


def _pair(dag: TrainingDAG, group: list[Edge], grad: bool) -> tuple[Node, Node, list[Edge]]:
    """One SEND/RECV pair for edges sharing a producer pass (activations) or a consumer
    pass (gradients); the message carries the union of their values."""
    if len(group) == 1:   # the common case: one edge, one message
        (e,) = group
        srcs, dsts, values = [e.src], [e.dst], e.values
    else:
        srcs = list(dict.fromkeys(e.src for e in group))
        dsts = list(dict.fromkeys(e.dst for e in group))
        values = tuple(dict.fromkeys(v for e in group for v in e.values))
    a, b = dag[srcs[0]], dag[dsts[0]]
    stream = a.attr("comm_stream") or "pp"
    common = dict(stream=stream,
                  attrs=(("grad", grad), ("values", values), ("dst_region", b.region),
                         ("src_region", a.region)))
    name = f"{'+'.join(srcs)}->{'+'.join(dsts)}"
    send = Node(id=f"SEND({name})", op=Op.SEND, tags=a.tags, devices=a.devices,
                region=a.region, **common)
    recv = Node(id=f"RECV({name})", op=Op.RECV, tags=b.tags, devices=b.devices,
                region=b.region, **common)
    if len(group) == 1:
        return send, recv, [Edge(srcs[0], send.id, EdgeKind.DATA, values),
                            Edge(send.id, recv.id, EdgeKind.DATA, values),
                            Edge(recv.id, dsts[0], EdgeKind.DATA, values)]
    out = [Edge(s, send.id, EdgeKind.DATA, _values(group, src=s)) for s in srcs]
    out.append(Edge(send.id, recv.id, EdgeKind.DATA, values))
    out += [Edge(recv.id, d, EdgeKind.DATA, _values(group, dst=d)) for d in dsts]
    return send, recv, out


def _values(group: list[Edge], src: str | None = None, dst: str | None = None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v for e in group if e.src == (src or e.src)
                               and e.dst == (dst or e.dst) for v in e.values))
