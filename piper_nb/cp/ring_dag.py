"""The point-to-point ring's exchanges as DAG nodes: per context group, microbatch and
step, a SEND of the keys and values a device holds to the next member of its group and a
RECV of the previous member's (`pn.context_parallel(..., rotate="p2p")`; the parts they
run between are `cp.ring`'s).

A delivered value `d` (`CPLayout.rotations`: `d` -> the value `s` it comes from) is
received under its own name: the SEND, on the group `(g0, ..., gn-1)`, carries `s`, and
its RECV, on the group turned one place `(g1, ..., gn-1, g0)`, writes `d` (replica `i` of
the SEND sends to replica `i` of the RECV: `gi` to `gi+1`). In the backward the gradient
of `d` goes back the other way, into the gradient of `s`, which so sums what the step
reading `s` made and what the later steps made of the same keys.

When they are issued (`compiler.lower`: a SEND as soon as it can go, a RECV one compute
step before its reader): the exchange delivering step `j + 1`'s keys runs beside step
`j`'s part, in the forward (the SEND waits for the RECV that delivered what it sends, and
comes after the part before step `j`) and in the backward (the gradient's SEND after the
backward of step `j + 1`, its RECV beside the backward of step `j`). Each SEND is waited
for before the compute after the one it runs beside, so what it sends is freed there.
"""

from __future__ import annotations

from piper_nb.directives.base import Context, Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import EdgeKind, Op
from piper_nb.ir.node import Edge, Node, node_id

__all__ = ["insert_cp_ring"]

_T = EdgeKind.TEMPORAL


def insert_cp_ring(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    """The ring's SEND/RECV pairs (see the module docstring)."""
    capture = ctx.capture
    layout = capture.cp
    if not directives or layout is None or not layout.rotations:
        return dag
    rot = layout.rotations
    # the part whose step reads a value: its first reader (the keys a region made may be
    # read later too, by an output that returns them)
    reader = {v: min(rs) for v, rs in capture.consumers.items() if rs}
    steps: dict[int, list[str]] = {}   # the region reading delivered values -> them
    for d in rot:
        steps.setdefault(reader[d], []).append(d)
    depth = {}
    for d in rot:   # hops from the values a part made
        s, depth[d] = rot[d], 1
        while s in rot:
            s, depth[d] = rot[s], depth[d] + 1
    order = sorted(steps, key=lambda r: depth[steps[r][0]])
    passes = {(Op.F if n.op == Op.F else Op.B, n.region, n.mb): n for n in dag.nodes
              if n.op in (Op.F, Op.B, Op.BI)}
    forwards: dict[int, list[Node]] = {}
    for (op, r, _), f in passes.items():
        if op == Op.F and r in steps:
            forwards.setdefault(r, []).append(f)
    ring = _Ring(capture.producer, rot, reader, passes)
    nodes, edges = list(dag.nodes), list(dag.edges)
    for grad, regions in ((False, order), (True, order[::-1])):
        for region in regions:
            delivered = tuple(steps[region])
            for f in forwards[region]:
                mb, n = f.mb, layout.degree
                for k in range(0, len(f.devices), n):
                    made = ring.exchange(delivered, mb, f.devices[k:k + n], k // n, grad)
                    nodes += made[0]
                    edges += made[1]
    return dag.replace(nodes=nodes, edges=edges,
                       step=f"{len(nodes) - len(dag.nodes)} point-to-point ring nodes")


class _Ring:
    """Makes the exchanges; `recvs` maps (values, mb, group, grad) to the RECV that
    delivered them (or their gradients)."""

    def __init__(self, producer, rot, reader, passes):
        self.producer, self.rot, self.reader, self.passes = producer, rot, reader, passes
        self.recvs: dict[tuple, Node] = {}

    def _pass(self, op: Op, region: int, mb) -> Node | None:
        return self.passes.get((op, region, mb))

    def exchange(self, delivered: tuple, mb, group: tuple, index: int, grad: bool
                 ) -> tuple[list, list]:
        """The SEND/RECV pair delivering `delivered` (or their gradients back) to `group`
        in microbatch `mb`, and its edges (the module docstring)."""
        sources = tuple(self.rot[d] for d in delivered)
        chained = sources[0] in self.rot
        op = Op.B if grad else Op.F
        reading = self._pass(op, self.reader[delivered[0]], mb)
        # the part before the one reading the sources (none: the maker's, backward)
        before = (self._pass(op, self.reader[self.rot[sources[0]]], mb) if chained
                  else self._pass(Op.B, self.producer[sources[0]], mb) if grad else None)
        tags = {k: v for k, v in reading.tags if k != "PASS"}
        word = "B" if grad else "F"
        turned = group[-1:] + group[:-1] if grad else group[1:] + group[:1]
        sent, got = (delivered, sources) if grad else (sources, delivered)
        send, recv = (Node(node_id(kind, tags, f"#cp{word}{index}"), kind, reading.tags,
                           reading.region, devs, "cp",
                           (("grad", grad), ("values", vals), ("ring", True),
                            ("dst_region", reading.region), ("src_region", reading.region)))
                      for kind, devs, vals in ((Op.SEND, group, sent), (Op.RECV, turned, got)))
        edges = [Edge(send.id, recv.id, EdgeKind.DATA, sent)]
        self.recvs[(got, mb, group, grad)] = recv
        if not grad:
            edges += [Edge(recv.id, reading.id, EdgeKind.DATA, got),
                      Edge(send.id, reading.id, _T)]    # waited for before the next step
            if chained:   # delivered itself: after its RECV, and after the part before
                edges.append(Edge(self.recvs[(sources, mb, group, False)].id, send.id,
                                  EdgeKind.DATA, sources))
                if before is not None:
                    edges.append(Edge(before.id, send.id, _T))
            else:
                edges.append(Edge(self._pass(Op.F, self.producer[sources[0]], mb).id,
                                  send.id, EdgeKind.DATA, sources))
            return [send, recv], edges
        edges.append(Edge(reading.id, send.id, EdgeKind.DATA, delivered))
        later = self.recvs.get((delivered, mb, group, True))
        if later is not None:   # what the later steps sent back, summed in first
            edges.append(Edge(later.id, send.id, EdgeKind.DATA, delivered))
        if before is not None:   # received beside the backward of the step reading the
            edges += [Edge(recv.id, before.id, _T if chained else EdgeKind.DATA,  # sources
                           () if chained else sources),
                      Edge(send.id, before.id, _T)]
        return [send, recv], edges
