"""`recompute`: keep only a region's inputs after its forward; re-run the forward before
its backward (activation checkpointing).

The value `Recompute` (JSON `{"op": "recompute", "filter": {...}}`), its constructor
`pn.recompute`, and the rewrite. The filter picks regions (and, with `MB`, microbatches):
every F, B and BI of a matched (region, microbatch) gets the node attribute `recompute`
(the directive's index), which the lowering copies into `Instr.recompute`. The runtime
then runs the forward under `torch.no_grad()`, stashing its inputs only; B, or BI when the
backward is split, re-seeds the random state as the forward did and runs it again with
autograd before the backward (BW reuses BI's graph). The memory ledger holds no saved
bytes between F and the backward, the cost models charge B or BI one more forward, and
the lowering frees the region's input activations after its backward, which reads them.

A region whose forward changes buffers (BatchNorm's running statistics) cannot be
recomputed: the second forward would update them twice (`check_recompute`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.directives.base import Context, Directive, Directives, call_code
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter
from piper_nb.ir.kinds import Op

__all__ = ["Recompute", "recompute", "apply_recompute", "check_recompute"]

_MARKED = (Op.F, Op.B, Op.BI)     # the passes that run the forward (BW reuses BI's graph)


@dataclass(frozen=True)
class Recompute(Directive):
    """Keep only the inputs of the matched regions' forwards; re-run them in the backward."""

    filter: Mapping[str, Any]
    op = "recompute"

    def __post_init__(self):
        filt = as_filter(self.filter, where="recompute filter")
        if "PASS" in filt:
            raise PlanError(f"recompute filter {filt} names a PASS; a recompute applies to a "
                            "region's forward and backward together: drop PASS from the filter")
        object.__setattr__(self, "filter", filt)

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "recompute", "filter": {"PP": 0}}

    def code(self) -> str:
        return call_code("pn.recompute", recompute, vars(self))


def recompute(filter: Mapping[str, Any]) -> Recompute:
    """Recompute the regions `filter` matches (all their microbatches, or those its `MB`
    names): their forward keeps only its inputs, and their backward first runs the forward
    again. Trades one more forward per backward for the activations autograd would save."""
    return Recompute(filter)


def _key(n) -> tuple:
    return n.region, tuple((k, v) for k, v in n.tags if k != "PASS")


def apply_recompute(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    """Mark every F, B and BI of the matched (region, microbatch) pairs `recompute=<index>`."""
    if not directives:
        return dag
    chosen: dict[tuple, int] = {}
    for idx, d in directives:
        hits = dag.select(d.filter, _MARKED)
        if not hits:
            raise PlanError(f"recompute filter {dict(d.filter)} matches no forward; name a "
                            "region's tags (such as {'PP': 0})", directive=idx, op=d.op)
        for n in hits:
            chosen.setdefault(_key(n), idx)
    nodes = [n.with_attrs(recompute=chosen[_key(n)])
             if n.op in _MARKED and _key(n) in chosen else n for n in dag.nodes]
    regions = len({k[0] for k in chosen})
    return dag.replace(nodes=nodes, step=f"{regions} regions")


def check_recompute(dag: TrainingDAG, changed: Mapping[int, tuple[str, ...]]) -> None:
    """Refuse recomputing a region whose forward changes buffers (`changed`: region ->
    those buffers, from `shapes.propagate`)."""
    for n in dag.nodes:
        idx = n.attr("recompute") if n.attrs and n.op == Op.F else None
        if idx is not None and changed.get(n.region):
            name = dag.regions()[n.region].name
            raise PlanError(
                f"region {{{name}}} changes buffers {', '.join(changed[n.region])} in its "
                "forward: recomputing it would update them twice; leave it out of the "
                "recompute filter, or make the buffers constant (for BatchNorm: "
                "track_running_stats=False, or model.eval() for those layers)",
                directive=idx, op="recompute")
