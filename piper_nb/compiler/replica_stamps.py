"""Replicas stamped from a template: how the lowering emits one instruction list per class.

Devices that hold exactly the same DAG nodes (the data-parallel replicas of one stage) get
the same schedule: `lower` orders and emits it once, for the class's first device, and each
other replica's list differs only in its replica index, its peers and its message tags, the
values of its own position in each node's device list. `classes_of` finds the classes and
`Stamper` stamps a template's list out for a replica, on demand (`StampedDevicePlan`), so a
plan of 16,384 devices holds one list per stage until a device's own is asked for.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import P2P, Op
from piper_nb.ir.node import Node
from piper_nb.plan.instr import Instr

__all__ = ["Stamper", "classes_of"]


def classes_of(dag: TrainingDAG, world: int) -> tuple[dict, dict[int, list[Node]]]:
    """Devices grouped by the nodes they hold (key -> devices, ascending) and the nodes of
    each group's first device. Two devices hold the same nodes exactly when they belong to
    the same distinct device tuples, so the nodes are scanned once per tuple, not once per
    device and node (a 16,384-device plan has millions of those pairs)."""
    sets: dict[tuple[int, ...], int] = {}
    of_node = [sets.setdefault(n.devices, len(sets)) for n in dag.nodes]
    member: list[list[int]] = [[] for _ in range(world)]
    for devs, k in sets.items():
        for d in devs:
            member[d].append(k)
    classes: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for d in range(world):
        classes[tuple(member[d])].append(d)
    local = {}
    for key, devs in classes.items():
        mine = set(key)
        local[devs[0]] = [n for n, k in zip(dag.nodes, of_node, strict=True) if k in mine]
    return classes, local




class Stamper:
    """Stamps a device's template instructions out for another replica of the same nodes:
    only the replica index, peers and tags change (plain tuples: this is the hot path). The
    rows are read off the template at the first stamp: a plan whose replicas are never
    asked for their own lists never pays for them."""

    def __init__(self, dag: TrainingDAG, template: tuple[Instr, ...], partner, tags):
        self.template = template
        self.rows: list | None = None
        self._from = (dag._idx()["id"], partner, tags)

    def _rows(self) -> list:
        by_id, partner, tags = self._from
        rows = []
        for ins in self.template:
            if ins.kind in (Op.WAIT, Op.FREE):
                rows.append(None)
                continue
            n = by_id[ins.node]
            other = partner[n.id].devices if ins.kind in P2P else None
            rows.append((n.devices, other, tags.get(n.id, -1)))
        return rows

    def __call__(self, d: int) -> tuple[Instr, ...]:
        if self.rows is None:
            self.rows = self._rows()
        out = []
        for ins, row in zip(self.template, self.rows, strict=True):
            if row is None:
                out.append(ins)
                continue
            devices, other, tag = row
            pos = devices.index(d)
            data = ins.data
            if other is not None:
                data = replace(data, peer=other[pos], tag=tag + pos)
            out.append(Instr(ins.kind, ins.node, ins.stream, ins.region, ins.mb, pos,
                             ins.replicas, data))
        return tuple(out)
