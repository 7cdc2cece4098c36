"""A scalar all-reduce over the world before every device's updates: what global gradient
clipping (the squared norm, `compiler.clip`) and the global-batch loss (the count,
`compiler.global_loss`) add to a plan.

`before_updates(plan, purpose)` rewrites every device's instruction list: the updates (U)
and what depends on them (the ZeRO-1/2 gathers of updated shards, and their WAITs) move
after everything else the device does in the step, and right before them the device issues
the all-reduce of one float64, then waits for it. The count (which scales the gradients)
comes before the norm (which reads them), whichever is added first.
"""

from __future__ import annotations

import functools

from piper_nb.ir.kinds import Op, Purpose
from piper_nb.plan.instr import Collective, Instr, Wait
from piper_nb.plan.plan import DevicePlan, Plan, StampedDevicePlan

__all__ = ["before_updates"]

_AFTER = {Purpose.COUNT: (Purpose.NORM,)}   # scalar steps that read what this one sets


def before_updates(plan: Plan, purpose: Purpose) -> tuple[DevicePlan, ...]:
    """Every device with a scalar all-reduce of `purpose` over the world before its updates
    (see the module docstring); a replica stamped from a template stays stamped (from the
    rewritten template, by the rewrite of what its stamper makes), so a plan of thousands
    of replicas still holds one list per class."""
    group = tuple(range(plan.world))
    made = {id(dp.instrs): _rewrite(dp.instrs, group, purpose)
            for dp in plan.devices if dp.stamp is None}
    out = []
    for dp in plan.devices:
        if dp.stamp is None:
            out.append(DevicePlan(dp.device, made[id(dp.instrs)]))
        elif id(dp.stamp[0]) in made:
            out.append(StampedDevicePlan(dp.device, made[id(dp.stamp[0])],
                                         functools.partial(_restamp, dp.stamp[1], group,
                                                           purpose)))
        else:
            out.append(DevicePlan(dp.device, _rewrite(dp.instrs, group, purpose)))
    return tuple(out)


def _restamp(stamper, group: tuple[int, ...], purpose: Purpose, device: int
             ) -> tuple[Instr, ...]:
    return _rewrite(stamper(device), group, purpose)


def _rewrite(instrs: tuple[Instr, ...], group: tuple[int, ...], purpose: Purpose
             ) -> tuple[Instr, ...]:
    """Updates and their dependents after everything else, the scalar all-reduce (and its
    WAIT) before them; a scalar step reading what this one sets moves after it too."""
    late: set[int] = set()
    updated: set[int] = set()
    for k, ins in enumerate(instrs):
        if ins.kind == Op.U or (ins.is_scalar and ins.purpose in _AFTER.get(purpose, ())):
            late.add(k)
            updated.update(ins.data.buckets)
        elif ins.kind == Op.ALL_GATHER and ins.purpose == Purpose.PARAM and ins.data.bucket in updated \
                and ins.mb < 0:
            late.add(k)   # a ZeRO-1/2 gather of the shards just updated
        elif ins.kind == Op.WAIT and ins.data.target in late:
            late.add(k)
    early = [k for k in range(len(instrs)) if k not in late]
    order = early + [-1, -2] + sorted(late)
    where = {old: new for new, old in enumerate(order)}
    scalar = Instr(Op.ALL_REDUCE, str(purpose), "dp", data=Collective(group, purpose))
    out = []
    for old in order:
        if old == -1:
            out.append(scalar)
        elif old == -2:
            out.append(Instr(Op.WAIT, str(purpose), "dp", data=Wait(where[-1])))
        else:
            ins = instrs[old]
            if ins.kind == Op.WAIT:
                ins = ins.with_data(target=where[ins.data.target])
            out.append(ins)
    return tuple(out)
