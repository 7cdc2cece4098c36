"""Placing the passes an order leaves out: one global list schedule over all devices.

An order directive names each stage's passes; a later segment of a stage (a module called
again after another stage, see `directives.order`) is left out and marked `floating`. Each
device's other nodes keep the order the lowering gave them; the floating ones are put in
by running every device's order together, step by step, and appending a floating node to
its device's order as soon as everything it depends on, on any device, has run. Every
device's order is then a part of one global order of the whole DAG, so the floating
passes cannot make two devices wait for each other.
"""

from __future__ import annotations

from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import COLLECTIVES, Op
from piper_nb.ir.node import Node

__all__ = ["merge_floating"]


def _pulled(n: Node) -> bool:
    return n.op == Op.RECV or (n.op == Op.ALL_GATHER and n.attr("before") is not None)


def merge_floating(dag: TrainingDAG, seqs: list[list[Node]], floating: list[list[Node]],
                   key) -> list[list[Node]]:
    """Per device: `seqs[d]` with the floating nodes of `floating[d]` put in (best `key`
    first among the ready ones). If the fixed orders alone get stuck, the rest is appended
    as it is: the deadlock check reports it with the grid."""
    world = len(seqs)
    done: dict[str, set[int]] = {}
    resolved: set[str] = set()

    def finished(nid: str, d: int) -> bool:
        n = dag[nid]
        if d in n.devices:
            if d in done.get(nid, ()):
                return True
            return _pulled(n) and ready(nid, d)
        if nid in resolved:
            return True
        ok = (all(x in done.get(nid, ()) for x in n.devices) if not _pulled(n)
              else all(ready(nid, x) for x in n.devices))
        if ok:
            resolved.add(nid)
        return ok

    def ready(nid: str, d: int) -> bool:
        """All inputs done. A collective waits for its inputs on this device only: the
        other members' reach it with their own copy of the node."""
        group = dag[nid].op in COLLECTIVES
        return all(finished(e.src, d) for e in dag.in_edges(nid)
                   if not group or d in dag[e.src].devices)

    pos = [0] * world
    left = [sorted(f, key=key) for f in floating]
    out: list[list[Node]] = [[] for _ in range(world)]

    def put(d: int, n: Node) -> None:
        out[d].append(n)
        done.setdefault(n.id, set()).add(d)

    while any(pos[d] < len(seqs[d]) or left[d] for d in range(world)):
        progress = False
        for d in range(world):
            while True:
                cand = next((n for n in left[d] if ready(n.id, d)), None)
                if cand is not None:
                    left[d].remove(cand)
                elif pos[d] < len(seqs[d]) and ready(seqs[d][pos[d]].id, d):
                    cand = seqs[d][pos[d]]
                    pos[d] += 1
                else:
                    break
                put(d, cand)
                progress = True
        if not progress:
            for d in range(world):
                for n in [*seqs[d][pos[d]:], *left[d]]:
                    put(d, n)
            break
    return out
