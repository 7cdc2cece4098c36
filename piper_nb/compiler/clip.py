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
import math

from piper_nb.compiler.checks import check_plan
from piper_nb.compiler.scalar_reduce import before_updates
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Purpose
from piper_nb.plan.clipping import has_norm_step
from piper_nb.plan.plan import Plan

__all__ = ["with_grad_clipping", "add_grad_clipping"]


def with_grad_clipping(plan: Plan, max_norm: float | None) -> Plan:
    """`plan` with the norm step (or without it, for None), checked; the same plan when it
    already is: what `pn.train(clip_grad_norm=)` asks of a compiled plan."""
    out = add_grad_clipping(plan, max_norm)
    if out.devices is not plan.devices:
        check_plan(out)
    return out


def add_grad_clipping(plan: Plan, max_norm: float | None) -> Plan:
    """`plan` with the norm step (or without it, for None), unchecked: the compile's plan
    pass, whose static checks follow."""
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
    return dataclasses.replace(plan, devices=before_updates(plan, Purpose.NORM),
                               clip_grad_norm=float(max_norm))


