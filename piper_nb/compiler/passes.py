"""The compile's passes, in three declared phases run by one runner.

- **Capture passes** rewrite the captured regions: the stage-order check, tensor
  parallelism's cut of sharded regions into parts, and selective recompute's attention
  cores.
- **DAG passes** (`DAG_PASSES`, also `PIPELINE`) make the placed, ordered training DAG in
  Piper's fixed order, whatever the order of the program: build, split, BI/BW split, place
  (and the placement replicate, shard and tensor_parallel imply), send/recv, the
  tensor-parallel collectives, gradient sync (replicate, tied and doubled parameters),
  shard (all-to-all), order, recompute (tensor-parallel layers as one unit), the inputs
  sequence parallelism keeps as slices, and the checks of the result.
- **Plan passes** (`compiler.plan_passes`) lower it to a checked `Plan`: lowering,
  tensor-parallel widening, the global loss, clipping, the static checks.

Every pass has one signature, `apply(value, directives, ctx) -> value`: the phase's value
so far (the capture, the DAG, the plan; `None` before a phase's first pass makes it), the
directives of the kinds it takes (index in the user's program, directive) and the phase's
context (`CaptureContext`, `Context`, `PlanContext`). `consumes` are the directive kinds a
pass applies; `reads` the kinds it only looks at. The runner hands each pass its
directives, records DAG passes' names in the DAG's history (so a tool can show the DAG
after each one), and checks, once all three phases ran, that every directive of the
program was consumed by some pass: a directive kind that is registered but that no pass
applies is an `InternalError`, never a plan that silently ignores it.
Adding a directive is its module (value, JSON, rewrite) and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from piper_nb.compiler.backward_split import split_backwards
from piper_nb.compiler.base_dag import base_dag
from piper_nb.compiler.buffers import check_buffers
from piper_nb.compiler.layer_recompute import recompute_layers
from piper_nb.compiler.placement import check_placement, place_replicas
from piper_nb.compiler.plan_passes import (
    add_clipping,
    add_global_loss,
    check_buffers_in_order,
    check_statically,
    lower_plan,
    widen_tensor_parallel,
)
from piper_nb.compiler.regather import regather_inputs
from piper_nb.compiler.send_recv import insert_send_recv
from piper_nb.compiler.stage_order import check_stage_order
from piper_nb.cp import (
    ContextParallel,
    cut_context,
    insert_cp_collectives,
    insert_cp_ring,
    place_context,
)
from piper_nb.directives.base import CaptureContext, Context, Directive, Directives
from piper_nb.directives.compile_regions import CompileRegions, apply_compile_regions
from piper_nb.directives.float8 import Float8, apply_float8
from piper_nb.directives.order import Order, apply_orders
from piper_nb.directives.place import Place, apply_places
from piper_nb.directives.recompute import (
    Recompute,
    apply_recompute,
    check_recompute,
    recompute_attention,
)
from piper_nb.directives.replicate import Replicate, insert_grad_sync
from piper_nb.directives.shard import Shard, apply_shards, insert_all_to_all, place_experts
from piper_nb.directives.split import Split, apply_splits
from piper_nb.errors import InternalError, PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.validate import validate
from piper_nb.tp import (
    TensorParallel,
    insert_tp_collectives,
    place_tensor_parallel,
    shard_regions,
)

__all__ = ["Pass", "Phase", "CAPTURE_PASSES", "DAG_PASSES", "PIPELINE", "PLAN_PASSES",
           "PHASES", "run_phase", "check_consumed"]

Rewrite = Callable[[Any, Directives, Any], Any]


@dataclass(frozen=True, slots=True)
class Pass:
    """One named rewrite of a phase and the directive kinds it is handed."""

    name: str
    apply: Rewrite
    consumes: tuple[type[Directive], ...] = ()   # the kinds it applies
    reads: tuple[type[Directive], ...] = ()      # kinds it only reads (another pass applies them)

    def takes(self, d: Directive) -> bool:
        return isinstance(d, self.consumes + self.reads)


def _check_stage_order(capture, directives: Directives, ctx: CaptureContext):
    if ctx.check:
        check_stage_order(capture)
    return capture


def _check_buffers(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    check_buffers(dag, ctx.changed)
    check_recompute(dag, ctx.changed)
    return validate(dag, placed=True)


CAPTURE_PASSES: tuple[Pass, ...] = (
    Pass("stage order check", _check_stage_order),                   # stages contiguous
    Pass("tensor-parallel sharding", shard_regions,                  # regions cut into parts,
         consumes=(TensorParallel,)),                                # layers sharded
    Pass("context cut", cut_context, consumes=(ContextParallel,)),  # a device's tokens,
                                                                     # ring attention
    Pass("selective recompute", recompute_attention,                 # attention cores run
         reads=(Recompute,)),                                        # again in the backward
    Pass("float8", apply_float8, consumes=(Float8,)),                # linears in Float8
)

DAG_PASSES: tuple[Pass, ...] = (
    Pass("build", base_dag),                                         # F, B, U per region
    Pass("split", apply_splits, consumes=(Split,)),                  # microbatch copies
    Pass("backward split", split_backwards, reads=(Order,)),         # B -> BI + BW where named
    Pass("place", apply_places, consumes=(Place,)),                  # devices per pass
    Pass("replica placement", place_replicas, reads=(Replicate,)),   # replicate's devices
    Pass("expert placement", place_experts, reads=(Shard,)),         # each expert's device
    Pass("tensor-parallel placement", place_tensor_parallel,         # one group's first
         reads=(TensorParallel,)),                                   # device
    Pass("context placement", place_context,                         # the context group
         reads=(ContextParallel, TensorParallel)),                   # (over TP leads)
    Pass("placement check", check_placement),                        # all placed; U placed
    Pass("send/recv", insert_send_recv),                             # a pair per crossing
    Pass("tensor-parallel collectives", insert_tp_collectives,       # all-reduces between
         reads=(TensorParallel,)),                                   # a region's parts
    Pass("context collectives", insert_cp_collectives,              # keys and values
         reads=(ContextParallel,)),                                  # gathered
    Pass("context ring", insert_cp_ring, reads=(ContextParallel,)),  # or passed round
    Pass("gradient sync", insert_grad_sync, consumes=(Replicate,)),  # buckets, ZeRO
    Pass("shard", apply_shards, consumes=(Shard,)),                  # experts' surroundings
    Pass("all-to-all", insert_all_to_all),                           # dispatch and combine
    Pass("order", apply_orders, consumes=(Order,)),                  # temporal edges, slots
    Pass("recompute", apply_recompute, consumes=(Recompute,)),       # recomputed passes
    Pass("layer recompute", recompute_layers),                       # TP layers as units
    Pass("sequence regather", regather_inputs),                      # SP inputs kept as slices
    Pass("compile regions", apply_compile_regions,                   # passes through
         consumes=(CompileRegions,)),                                # torch.compile
    Pass("checks", _check_buffers),                                  # buffers, recompute, DAG
)
PIPELINE = DAG_PASSES

PLAN_PASSES: tuple[Pass, ...] = (
    Pass("lower", lower_plan),                                       # instruction lists
    Pass("tensor-parallel widening", widen_tensor_parallel,          # each member's list
         reads=(TensorParallel,)),
    Pass("global loss", add_global_loss),                            # count:AR
    Pass("gradient clipping", add_clipping),                         # norm:AR
    Pass("buffer order check", check_buffers_in_order),              # in-place buffers
    Pass("static checks", check_statically),                         # matching, order, NCCL
)


@dataclass(frozen=True, slots=True)
class Phase:
    """A declared list of passes over one kind of value; `history`: the value is a DAG
    whose history records each pass."""

    name: str
    passes: tuple[Pass, ...]
    history: bool = False


CAPTURE, DAG, PLAN = (Phase("capture", CAPTURE_PASSES), Phase("DAG", DAG_PASSES, True),
                      Phase("plan", PLAN_PASSES))
PHASES: tuple[Phase, ...] = (CAPTURE, DAG, PLAN)


def run_phase(phase: Phase, value, directives: Directives, ctx, consumed: set[int]):
    """`value` through `phase`'s passes, each handed its directives; adds to `consumed` the
    positions in `directives` of those a pass applied."""
    for p in phase.passes:
        mine = tuple((i, d) for i, d in directives if p.takes(d))
        before = value.history if phase.history and value is not None else ()
        try:
            out = p.apply(value, mine, ctx)
        except PlanError as err:   # a pass of one directive: the problem is that row's
            if err.directive is None and len(mine) == 1:
                raise err.at(mine[0][0], mine[0][1].op) from err.__cause__
            raise
        if phase.history:
            detail = out.history[len(before):] if out.history[:len(before)] == before else ()
            out = out.with_history((*before, p.name + (": " + "; ".join(detail)
                                                       if detail else "")))
        value = out
        consumed.update(k for k, (_, d) in enumerate(directives) if isinstance(d, p.consumes))
    return value


def check_consumed(directives: Directives, consumed: set[int],
                   phases: tuple[Phase, ...] = PHASES) -> None:
    """An `InternalError` when a directive of the program was consumed by no pass."""
    left = [(i, d) for k, (i, d) in enumerate(directives) if k not in consumed]
    if left:
        i, d = left[0]
        names = "; ".join(f"{ph.name}: {', '.join(p.name for p in ph.passes)}" for ph in phases)
        raise InternalError(
            f"directive #{i} ({d.op}, {type(d).__name__}) was consumed by no pass: the program "
            f"would compile as if it were not there. Add the pass that applies it to a phase "
            f"of compiler.passes ({names})")
