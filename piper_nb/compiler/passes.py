"""The pass pipeline: every rewrite from a captured model to the placed, ordered DAG, in one
declared list.

Each pass has one signature, `apply(dag, directives, ctx) -> dag`: the DAG so far, the
directives of the kinds it takes (index in the user's program, directive), and the
compile's `Context` (captured model, value shapes, frozen parameters). The runner hands
each pass its directives, records the pass's name in the DAG's history (so a tool can
show the DAG after each one), and checks at the end that every directive of the program
was consumed by some pass: a directive kind that is registered but that no pass applies
is an `InternalError`, never a plan that silently ignores it.

The order is Piper's fixed order, whatever the order of the program: split, BI/BW split,
place (and the placement replicate and shard imply), send/recv, gradient sync (replicate,
tied and doubled parameters), shard (all-to-all), order, recompute. `consumes` are the
directive kinds a pass applies; `reads` the kinds it only looks at (the orders that name
a split backward; the replicates and shards that imply placement before their own pass).
Adding a directive is its module (value, JSON, rewrite) and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from piper_nb.compiler.backward_split import split_backwards
from piper_nb.compiler.base_dag import base_dag
from piper_nb.compiler.placement import check_placement, place_replicas
from piper_nb.compiler.send_recv import insert_send_recv
from piper_nb.directives.base import Context, Directive, Directives
from piper_nb.directives.order import Order, apply_orders
from piper_nb.directives.place import Place, apply_places
from piper_nb.directives.recompute import Recompute, apply_recompute
from piper_nb.directives.replicate import Replicate, insert_grad_sync
from piper_nb.directives.shard import Shard, apply_shards, insert_all_to_all, place_experts
from piper_nb.directives.split import Split, apply_splits
from piper_nb.directives.tensor_parallel import TensorParallel, insert_tp_collectives, place_tensor_parallel
from piper_nb.errors import InternalError, PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.validate import validate

__all__ = ["Pass", "PIPELINE", "run_pipeline"]

Rewrite = Callable[[TrainingDAG | None, Directives, Context], TrainingDAG]


@dataclass(frozen=True, slots=True)
class Pass:
    """One named rewrite of the pipeline and the directive kinds it is handed."""

    name: str
    apply: Rewrite
    consumes: tuple[type[Directive], ...] = ()   # the kinds it applies
    reads: tuple[type[Directive], ...] = ()      # kinds it only reads (another pass applies them)

    def takes(self, d: Directive) -> bool:
        return isinstance(d, self.consumes + self.reads)


PIPELINE: tuple[Pass, ...] = (
    Pass("build", base_dag),                                         # F, B, U per region
    Pass("split", apply_splits, consumes=(Split,)),                  # microbatch copies
    Pass("backward split", split_backwards, reads=(Order,)),         # B -> BI + BW where named
    Pass("place", apply_places, consumes=(Place,)),                  # devices per pass
    Pass("replica placement", place_replicas, reads=(Replicate,)),   # replicate's devices
    Pass("expert placement", place_experts, reads=(Shard,)),         # each expert's device
    Pass("tensor-parallel placement", place_tensor_parallel,         # one group's first
         reads=(TensorParallel,)),                                   # device
    Pass("placement check", check_placement),                        # all placed; U placed
    Pass("send/recv", insert_send_recv),                             # a pair per crossing
    Pass("tensor-parallel collectives", insert_tp_collectives,       # all-reduces between
         consumes=(TensorParallel,)),                                # a region's parts
    Pass("gradient sync", insert_grad_sync, consumes=(Replicate,)),  # buckets, ZeRO
    Pass("shard", apply_shards, consumes=(Shard,)),                  # experts' surroundings
    Pass("all-to-all", insert_all_to_all),                           # dispatch and combine
    Pass("order", apply_orders, consumes=(Order,)),                  # temporal edges, slots
    Pass("recompute", apply_recompute, consumes=(Recompute,)),       # recomputed passes
)


def run_pipeline(directives: Directives, ctx: Context,
                 pipeline: tuple[Pass, ...] = PIPELINE) -> TrainingDAG:
    """The placed, validated DAG of `directives` (schedule builders already expanded)."""
    dag: TrainingDAG | None = None
    consumed: set[int] = set()
    for p in pipeline:
        mine = tuple((i, d) for i, d in directives if p.takes(d))
        before = dag.history if dag is not None else ()
        try:
            out = p.apply(dag, mine, ctx)
        except PlanError as err:   # a pass of one directive: the problem is that row's
            if err.directive is None and len(mine) == 1:
                raise err.at(mine[0][0], mine[0][1].op) from err.__cause__
            raise
        detail = out.history[len(before):] if out.history[:len(before)] == before else ()
        entry = p.name + (": " + "; ".join(detail) if detail else "")
        dag = out.with_history((*before, entry))
        consumed.update(k for k, (_, d) in enumerate(directives) if isinstance(d, p.consumes))
    left = [(i, d) for k, (i, d) in enumerate(directives) if k not in consumed]
    if left:
        i, d = left[0]
        raise InternalError(
            f"directive #{i} ({d.op}, {type(d).__name__}) was consumed by no pass: the program "
            f"would compile as if it were not there. Add the pass that applies it to "
            f"compiler.passes.PIPELINE (passes: {', '.join(p.name for p in pipeline)})")
    return validate(dag, placed=True)
