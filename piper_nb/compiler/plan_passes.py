"""The plan phase of the compile: the placed, ordered DAG lowered into a checked `Plan`.

Each pass has the runner's signature, `apply(plan, directives, ctx) -> plan`, over the
`PlanContext` of one compile; the first, `lower`, is handed no plan and makes it, as the
DAG phase's `build` makes the DAG. In order (`compiler.passes.PLAN_PASSES`): lower the DAG
to one instruction list per device (`compiler.lower`), widen them over the tensor-parallel
groups (`tp.widen`), the global loss's count step (`compiler.global_loss`), the
gradient-norm step (`compiler.clip`), the check of buffers changed in place, and the static
checks (`compiler.checks`), which so see every step the plan has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.capture.sequence_ops import SEQ_DIM
from piper_nb.compiler.buffers import check_buffer_order
from piper_nb.compiler.checks import check_plan
from piper_nb.compiler.clip import add_grad_clipping
from piper_nb.compiler.global_loss import with_global_loss
from piper_nb.compiler.lower import lower
from piper_nb.directives.base import Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import Op
from piper_nb.plan.instr import slice_name
from piper_nb.plan.plan import Plan
from piper_nb.plan.sizes import ValueInfo
from piper_nb.tp import tp_groups, widen_plan

__all__ = ["PlanContext", "lower_plan", "widen_tensor_parallel", "add_global_loss",
           "add_clipping", "check_buffers_in_order", "check_statically"]


@dataclass(frozen=True)
class PlanContext:
    """What a plan pass reads besides the plan and its directives: the captured model, the
    placed DAG, the shapes pass's output, the batch's size and microbatches, the world,
    the options of `pn.compile`, and the program (kept on the plan, for a rebatch)."""

    capture: Any
    dag: TrainingDAG
    shapes: Mapping[str, Any]        # values, saved, kept, changed, rows, saved_rows
    batch_size: int
    microbatches: int
    world: int
    program: Directives
    check: bool = True
    precision: tuple[str, str | None] = ("fp32", None)   # (precision, reduce_dtype)
    clip_grad_norm: float | None = None
    samples: tuple = ()
    spec: Any = None


def lower_plan(plan: None, directives: Directives, ctx: PlanContext) -> Plan:
    """The `Plan`: each device's instruction list (`compiler.lower`) and what the runtime
    and simulator read beside it."""
    dag, capture, shapes = ctx.dag, ctx.capture, ctx.shapes
    buckets = dag.get_meta("buckets", ())
    loss_region = next(r.index for r in capture.regions if r.has_loss)
    loss_width = next(len(n.devices) for n in dag.nodes
                      if n.region == loss_region and n.op == Op.F)
    return Plan(
        world=ctx.world, devices=lower(dag, buckets, ctx.world), microbatches=ctx.microbatches,
        batch_size=ctx.batch_size, loss_scale=1.0 / (ctx.microbatches * loss_width),
        regions=capture.regions, buckets=buckets, values=_with_slices(shapes["values"], dag),
        saved=shapes["saved"], kept=shapes["kept"], aliases=shapes["aliases"],
        rows=shapes["rows"],
        saved_rows=shapes["saved_rows"],
        params={k: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for k, p in capture.named_parameters()},
        frozen=tuple(sorted(dag.get_meta("frozen", frozenset()))), batch_names=capture.batch,
        samples=ctx.samples, spec=ctx.spec, precision=ctx.precision[0],
        reduce_dtype=ctx.precision[1],
        pieces={p: tuple(v[:3]) for p, v in capture.pieces.items()},
        dag=dag, program=ctx.program, capture=capture)


def _with_slices(values: Mapping[str, ValueInfo], dag: TrainingDAG) -> dict:
    """`values` and the sequence slices forwards keep of their inputs (`compiler.regather`):
    each input's shape with the sequence over the tensor-parallel degree."""
    out = dict(values)
    for v, degree in dag.get_meta("slices", ()):
        info = values[v]
        shape = list(info.shape)
        shape[SEQ_DIM] //= degree
        out[slice_name(v)] = ValueInfo(slice_name(v), tuple(shape), info.dtype, False)
    return out


def widen_tensor_parallel(plan: Plan, directives: Directives, ctx: PlanContext) -> Plan:
    """Every member of a tensor-parallel group runs its first device's list, with its own
    peers and buckets (`tp.widen`); the groups and sharded parameters recorded."""
    return widen_plan(plan, tp_groups(directives), ctx.capture.tp)


def add_global_loss(plan: Plan, directives: Directives, ctx: PlanContext) -> Plan:
    """Under `loss_mean="global"`, the count's all-reduce before the updates."""
    return with_global_loss(plan) if ctx.capture.loss_mean == "global" else plan


def add_clipping(plan: Plan, directives: Directives, ctx: PlanContext) -> Plan:
    """With `clip_grad_norm`, the norm's all-reduce before the updates."""
    return add_grad_clipping(plan, ctx.clip_grad_norm)


def check_buffers_in_order(plan: Plan, directives: Directives, ctx: PlanContext) -> Plan:
    """Buffers changed in place are changed in the order one process changes them."""
    check_buffer_order(plan, ctx.shapes["changed"])
    return plan


def check_statically(plan: Plan, directives: Directives, ctx: PlanContext) -> Plan:
    """The static checks (`compiler.checks`), unless the compile was asked not to."""
    if ctx.check:
        check_plan(plan)
    return plan
