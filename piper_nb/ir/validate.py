"""Invariants of a TrainingDAG, runnable after every pass (`validate(dag)`)."""

from __future__ import annotations

from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import COMM, COMPUTE, EdgeKind, Op, Purpose

__all__ = ["validate"]


def validate(dag: TrainingDAG, *, placed: bool = False) -> TrainingDAG:
    ids = set()
    for n in dag.nodes:
        if n.id in ids:
            raise PlanError(f"two DAG nodes share the id {n.id}")
        ids.add(n.id)
        if n.op in COMPUTE and n.tag("PASS") != n.op.value:
            raise PlanError(f"{n.id}: its PASS tag {n.tag('PASS')} disagrees with its op {n.op}")
        if placed and not n.devices:
            raise PlanError(f"{n.id} is not placed on any device")
        # a tensor-parallel all-reduce runs over the group its devices lead (`tp.widen`)
        if (n.op in COMM and placed and n.op not in (Op.SEND, Op.RECV) and len(n.devices) < 2
                and n.attr("purpose") != Purpose.TP):
            raise PlanError(f"collective {n.id} needs at least two devices, has {list(n.devices)}")
    for e in dag.edges:
        if e.src not in ids or e.dst not in ids:
            raise PlanError(f"edge {e} names a node that is not in the DAG")
        if e.kind not in (EdgeKind.DATA, EdgeKind.TEMPORAL):
            raise PlanError(f"edge {e} has unknown kind {e.kind!r}")
    return dag
