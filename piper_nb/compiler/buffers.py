"""Buffers a forward changes (BatchNorm's running statistics, step counters).

One process updates such a buffer once per forward, microbatch after microbatch. A plan
reproduces that when every forward that updates it runs on one device, in microbatch
order (every pipeline schedule does): that device's copy is the trained buffer, and
`pn.train` returns it. Data-parallel replicas of a BatchNorm normalize over the whole
microbatch (`runtime.syncbn`), so every replica's copy moves as one process's. A
stage held twice (full DualPipe's two copies) or a module with such buffers called from
regions on different devices would split the sequence of updates between processes: that
is a PlanError here, before anything runs, and so is an order that runs such a region's
forwards out of microbatch order (the buffer would be updated in another order).
"""

from __future__ import annotations

from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import Op

__all__ = ["check_buffers", "check_buffer_order"]


def check_buffers(dag: TrainingDAG, changed: dict[int, tuple[str, ...]]) -> None:
    """`changed`: region -> buffers its forward changes (from `shapes.propagate`)."""
    if not changed:
        return
    regions = dag.regions()
    firsts: dict[int, set[int]] = {}   # region -> first device of each group running its F
    for n in dag.nodes:
        if n.op == Op.F and n.region in changed:
            firsts.setdefault(n.region, set()).add(n.devices[0])
    holder: dict[str, tuple[int, int]] = {}   # buffer -> (region, device)
    fix = ("keep those forwards on one device group, or make the buffer constant (for "
           "BatchNorm: track_running_stats=False, or model.eval() for those layers)")
    for r, names in sorted(changed.items()):
        where = sorted(firsts.get(r, ()))
        if len(where) > 1:
            raise PlanError(f"region {{{regions[r].name}}} changes buffers {', '.join(names)} in "
                            f"its forward, and its forwards run on devices {where} (a stage held "
                            "twice): one process updates these buffers microbatch after "
                            f"microbatch, which copies on several devices cannot; {fix}")
        for name in names:
            other = holder.setdefault(name, (r, where[0]))
            if other[1] != where[0]:
                raise PlanError(f"buffer {name} changes in the forwards of regions "
                                f"{{{regions[other[0]].name}}} on device {other[1]} and "
                                f"{{{regions[r].name}}} on device {where[0]} (a module called "
                                f"from two stages): its updates would split between devices; "
                                f"{fix}")


def check_buffer_order(plan, changed: dict[int, tuple[str, ...]]) -> None:
    """Each region that changes buffers runs its forwards in microbatch order."""
    if not changed:
        return
    stamped = plan.stamps()   # a replica runs its forwards in its template's order
    for dp in plan.devices:
        if dp.device in stamped:
            continue
        last: dict[int, int] = {}
        for ins in dp.instrs:
            if ins.kind == Op.F and ins.region in changed:
                if ins.mb < last.get(ins.region, -1):
                    name = plan.regions[ins.region].name
                    raise PlanError(
                        f"device {dp.device} runs the forward of region {{{name}}} for "
                        f"microbatch {ins.mb} after microbatch {last[ins.region]}, and that "
                        f"forward changes buffers {', '.join(changed[ins.region])}: one process "
                        "updates them microbatch after microbatch; order the stage's forwards "
                        "by microbatch, or make the buffers constant")
                last[ins.region] = ins.mb
