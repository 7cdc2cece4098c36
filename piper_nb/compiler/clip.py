"""Global gradient-norm clipping as a step of the plan: one small all-reduce before the updates.

`with_grad_clipping(plan, max_norm)` rewrites every device's instruction list: the updates
(U) and what depends on them (the ZeRO-1/2 gathers of updated shards, and their WAITs) move
after everything else the device does in the step, and right before them the device issues
`AR(norm)`, an ALL_REDUCE over the whole world of its share of the squared gradient norm,
then waits for it. Each device's share counts every parameter it updates once, divided by
how many places update that parameter (`norm_weights`): data-parallel replicas holding the
same reduced gradient, both ends of a tied weight, DualPipe's two copies of a stage, and the
ZeRO groups whose shards together make one full gradient. So the sum over the world is the
squared norm of the single model's gradient, what `torch.nn.utils.clip_grad_norm_` computes,
and every device then scales its gradients by `min(1, max_norm / (norm + 1e-6))`.

The rewritten plan goes through the same static checks as any other; the simulator times the
all-reduce (8 bytes) and the memory model holds its buffer from issue to WAIT.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from piper_nb.compiler.checks import check_plan
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op, Purpose
from piper_nb.plan.clipping import has_norm_step
from piper_nb.plan.instr import Instr
from piper_nb.plan.plan import DevicePlan, Plan, StampedDevicePlan

__all__ = ["with_grad_clipping"]


def with_grad_clipping(plan: Plan, max_norm: float | None) -> Plan:
    """`plan` with the norm step (or without it, for None); the same plan when it already is."""
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(
            max_norm, (int, float)) or math.isnan(max_norm) or max_norm <= 0):
        raise PlanError(f"clip_grad_norm must be a positive number (math.inf: report the norm, "
                        f"clip nothing), got {max_norm!r}")
    has = has_norm_step(plan)
    if max_norm is None:
        if not has:
            return plan
        raise PlanError("this plan was compiled with clip_grad_norm; compile it again without "
                        "it to train unclipped")
    if has:
        return plan if plan.clip_grad_norm == max_norm else \
            dataclasses.replace(plan, clip_grad_norm=float(max_norm))
    out = dataclasses.replace(plan, devices=_rewrite_all(plan), clip_grad_norm=float(max_norm))
    check_plan(out)
    return out


def _rewrite_all(plan: Plan) -> tuple[DevicePlan, ...]:
    """Every device rewritten; a replica stamped from a template stays stamped (from the
    rewritten template, by the rewrite of what its stamper makes), so a plan of thousands
    of replicas still holds one list per class."""
    group = tuple(range(plan.world))
    made = {id(dp.instrs): _rewrite(dp.instrs, group) for dp in plan.devices if dp.stamp is None}
    out = []
    for dp in plan.devices:
        if dp.stamp is None:
            out.append(DevicePlan(dp.device, made[id(dp.instrs)]))
        elif id(dp.stamp[0]) in made:
            out.append(StampedDevicePlan(dp.device, made[id(dp.stamp[0])],
                                         functools.partial(_restamp, dp.stamp[1], group)))
        else:
            out.append(DevicePlan(dp.device, _rewrite(dp.instrs, group)))
    return tuple(out)


def _restamp(stamper, group: tuple[int, ...], device: int) -> tuple[Instr, ...]:
    return _rewrite(stamper(device), group)


def _rewrite(instrs: tuple[Instr, ...], group: tuple[int, ...]) -> tuple[Instr, ...]:
    """Updates and their dependents after everything else, the norm all-reduce before them."""
    late: set[int] = set()
    updated: set[int] = set()
    for k, ins in enumerate(instrs):
        if ins.kind == Op.U:
            late.add(k)
            updated.update(ins.buckets)
        elif ins.kind == Op.ALL_GATHER and ins.purpose == Purpose.PARAM and ins.bucket in updated \
                and ins.mb < 0:
            late.add(k)   # a ZeRO-1/2 gather of the shards just updated
        elif ins.kind == Op.WAIT and ins.target in late:
            late.add(k)
    early = [k for k in range(len(instrs)) if k not in late]
    order = early + [-1, -2] + sorted(late)
    where = {old: new for new, old in enumerate(order)}
    norm = Instr(Op.ALL_REDUCE, node="norm", stream="dp", group=group, purpose=Purpose.NORM)
    out = []
    for old in order:
        if old == -1:
            out.append(norm)
        elif old == -2:
            out.append(Instr(Op.WAIT, node="norm", stream="dp", target=where[-1]))
        else:
            ins = instrs[old]
            if ins.kind == Op.WAIT:
                ins = dataclasses.replace(ins, target=where[ins.target])
            out.append(ins)
    return tuple(out)
