"""Insert SEND/RECV pairs on data edges whose ends run on different devices.

Device groups pair up by position: replica i of the producer sends to replica i of the
consumer, so both ends must be groups of one size. Edges into or out of expert (sharded)
regions are left to `shard`, which turns them into all-to-all.
"""

from __future__ import annotations

from piper_nb.errors import PlanError
from piper_nb.ir.dag import COMPUTE, Edge, Node, Op, TrainingDAG

__all__ = ["insert_send_recv"]


def insert_send_recv(dag: TrainingDAG, skip_regions: frozenset[int] = frozenset()) -> TrainingDAG:
    nodes = list(dag.nodes)
    edges: list[Edge] = []
    for e in dag.edges:
        a, b = dag[e.src], dag[e.dst]
        if (e.kind != "data" or a.op not in COMPUTE or b.op not in COMPUTE or b.op == Op.U
                or a.devices == b.devices or a.region in skip_regions or b.region in skip_regions):
            edges.append(e)
            continue
        if len(a.devices) != len(b.devices):
            raise PlanError(f"{a.id} runs on {list(a.devices)} and {b.id} on {list(b.devices)}: "
                            "data can only flow between groups of the same size (replica i sends "
                            "to replica i); place both sides on the same number of devices")
        grad = a.op != Op.F
        stream = a.attr("comm_stream") or "pp"
        common = dict(stream=stream,
                      attrs=(("grad", grad), ("values", e.values), ("dst_region", b.region),
                             ("src_region", a.region)))
        send = Node(id=f"SEND({a.id}->{b.id})", op=Op.SEND, tags=a.tags, devices=a.devices,
                    region=a.region, **common)
        recv = Node(id=f"RECV({a.id}->{b.id})", op=Op.RECV, tags=b.tags, devices=b.devices,
                    region=b.region, **common)
        nodes += [send, recv]
        edges += [Edge(a.id, send.id, "data", e.values), Edge(send.id, recv.id, "data", e.values),
                  Edge(recv.id, b.id, "data", e.values)]
    return dag.replace(nodes=nodes, edges=edges, step="send/recv")
