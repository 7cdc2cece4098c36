"""The loss over the global batch as a step of the plan: the count's all-reduce.

Under `loss_mean="global"` (`capture.loss`) the loss region returns the microbatch's loss
*sum* and what it counts (the labels other than -100). Every backward then seeds the sum's
gradient with 1 (`Plan.loss_scale`), and `with_global_loss` adds `count:AR` before the
updates of every device (`compiler.scalar_reduce`): the all-reduce over the world of the
counts of the loss forwards each device ran. Each device scales its reduced gradients (or
shards) by 1 / that total before clipping and the update, so every plan minimises the sum
over the whole batch divided by the count over the whole batch, as one process on the
whole batch does, and as the Trainer's `num_items_in_batch` with
`average_tokens_across_devices` does. The step's loss is the world's sums over the count.
"""

from __future__ import annotations

import dataclasses

from piper_nb.compiler.scalar_reduce import before_updates
from piper_nb.ir.kinds import Purpose
from piper_nb.plan.plan import Plan

__all__ = ["with_global_loss"]


def with_global_loss(plan: Plan) -> Plan:
    """`plan` with the count step, its loss seeded with 1 and `loss_mean="global"`."""
    return dataclasses.replace(plan, devices=before_updates(plan, Purpose.COUNT),
                               loss_scale=1.0, loss_mean="global")
