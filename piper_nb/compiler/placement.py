"""Placement passes the user does not write: the placement a `replicate` implies, and the
check that closes placement (every pass placed, each update where its parameters are).

`place` (the directive) puts compute on device groups; `replicate` runs its regions on its
devices, so the regions' passes not placed yet go there (`place_replicas`); `shard` places
each expert region itself (`directives.shard.place_experts`). `check_placement` then checks
every pass is placed and places each region's update U on every device that runs the region.
"""

from __future__ import annotations

import dataclasses

from piper_nb.directives.base import Context, Directives
from piper_nb.directives.replicate import replica_configs
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import Op

__all__ = ["place_replicas", "check_placement"]


def place_replicas(dag: TrainingDAG, replicates: Directives, ctx: Context) -> TrainingDAG:
    """Place the passes of replicated regions on their replica groups (one rewrite). Passes
    already placed on part of the group keep their place (the copies of a stage that full
    DualPipe places per microbatch): the group then spans the copies, which sum, and under
    ZeRO shard, the region's gradients and optimizer state."""
    if not replicates:
        return dag
    replica_configs(dag, replicates)   # every filter matches a region
    where: dict[str, tuple[int, object]] = {}
    for idx, d in replicates:
        for n in dag.select(d.filter, (Op.F, Op.B, Op.BI, Op.BW)):
            where[n.id] = (idx, d)
    nodes = []
    for n in dag.nodes:
        if n.id in where:
            idx, d = where[n.id]
            if not n.devices:
                n = dataclasses.replace(n, devices=d.devices)
            elif not set(n.devices) <= set(d.devices):
                raise PlanError(f"{n.id} is placed on {list(n.devices)} but replicated over "
                                f"{list(d.devices)}; place it on the replicate devices",
                                directive=idx, op="replicate")
        nodes.append(n)
    return dag.replace(nodes=nodes, step=f"{len(replicates)} directives")


def check_placement(dag: TrainingDAG, _: Directives, ctx: Context) -> TrainingDAG:
    """Check every pass is placed; place U on the devices running its region."""
    unplaced = [n.id for n in dag.nodes if n.op != Op.U and not n.devices]
    if unplaced:
        shown = ", ".join(unplaced[:4]) + (f" and {len(unplaced) - 4} more" if len(unplaced) > 4 else "")
        raise PlanError(f"compute never placed: {shown}; add a place directive for "
                        f"{dict((k, v) for k, v in dag[unplaced[0]].tags if k not in ('PASS', 'MB'))}")
    holders: dict[int, set[int]] = {}
    widths: dict[int, set[int]] = {}
    for n in dag.nodes:
        if n.op != Op.U:
            holders.setdefault(n.region, set()).update(n.devices)
            widths.setdefault(n.region, set()).add(len(n.devices))
    nodes = []
    for n in dag.nodes:
        if n.op == Op.U:
            want = tuple(sorted(holders.get(n.region, ())))
            if n.devices and set(n.devices) != set(want):
                raise PlanError(f"{n.id} is placed on {list(n.devices)} but its region runs on "
                                f"{list(want)}; the update must run where the parameters are")
            n = dataclasses.replace(n, devices=want)
        nodes.append(n)
    for r, w in widths.items():
        if len(w) > 1:
            raise PlanError(f"region {dag.regions()[r].name} runs on groups of different sizes "
                            f"{sorted(w)}; place every pass of a region on groups of one size")
    return dag.replace(nodes=nodes)
