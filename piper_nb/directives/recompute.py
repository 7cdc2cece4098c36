"""`recompute`: keep only a region's inputs after its forward; re-run the forward before
its backward (activation checkpointing), or, `mode="selective"`, only its attention cores.

The value `Recompute` (JSON `{"op": "recompute", "filter": {...}, "mode": "full"}`), its
constructor `pn.recompute`, and the rewrites.

Full recompute (Megatron's `--recompute-granularity full`, torchtitan's `mode = "full"`)
is a DAG rewrite. The filter picks regions (and, with `MB`, microbatches):
every F, B and BI of a matched (region, microbatch) gets the node attribute `recompute`
(the directive's index), which the lowering copies into `Instr.recompute`. The runtime
then runs the forward under `torch.no_grad()`, stashing its inputs only; B, or BI when the
backward is split, re-seeds the random state as the forward did and runs it again with
autograd before the backward (BW reuses BI's graph). The memory ledger holds no saved
bytes between F and the backward, the cost models charge B or BI one more forward, and
the lowering frees the region's input activations after its backward, which reads them.

A region whose forward changes buffers (BatchNorm's running statistics) cannot be
recomputed: the second forward would update them twice (`check_recompute`).

Selective recompute (Megatron's `--recompute-granularity selective`, Korthikanti et al.
2022) is a capture rewrite (`recompute_attention`): in each matched region, every
attention core (scores, softmax, dropout, the product with v: `capture.attention_core`)
keeps only its inputs and runs again in the backward; the rest of the region saves what
autograd saves. Nothing else changes: the saved bytes the compile measures, the runtime
and the simulator see the rewritten region as it is, and the analytic cost model charges
the backward the cores' FLOPs once more (`sim.flops`). It applies to every microbatch, so
its filter names no `MB`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.capture.attention_core import recompute_cores
from piper_nb.capture.recomputed import Recomputed
from piper_nb.directives.base import CaptureContext, Context, Directive, Directives, call_code
from piper_nb.directives.region_rewrite import rewrite_regions
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter
from piper_nb.ir.kinds import Op

__all__ = ["Recompute", "recompute", "apply_recompute", "check_recompute",
           "recompute_attention", "MODES"]

MODES = ("full", "selective")
_MARKED = (Op.F, Op.B, Op.BI)     # the passes that run the forward (BW reuses BI's graph)


@dataclass(frozen=True)
class Recompute(Directive):
    """Keep only the inputs of the matched regions' forwards; re-run them in the backward."""

    filter: Mapping[str, Any]
    mode: str = "full"
    op = "recompute"

    def __post_init__(self):
        filt = as_filter(self.filter, where="recompute filter")
        if "PASS" in filt:
            raise PlanError(f"recompute filter {filt} names a PASS; a recompute applies to a "
                            "region's forward and backward together: drop PASS from the filter")
        if self.mode not in MODES:
            raise PlanError(f"recompute mode {self.mode!r} is not one of {', '.join(MODES)}: "
                            "'full' keeps each region's inputs only, 'selective' its "
                            "activations but the attention cores'")
        if self.mode == "selective" and "MB" in filt:
            raise PlanError(f"recompute filter {filt} names microbatches (MB), but selective "
                            "recompute changes the regions themselves, for every microbatch: "
                            "drop MB from the filter, or use mode='full'")
        object.__setattr__(self, "filter", filt)

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "recompute", "filter": {"PP": 0}}

    def code(self) -> str:
        return call_code("pn.recompute", recompute, vars(self))


def recompute(filter: Mapping[str, Any], mode: str = "full") -> Recompute:
    """Recompute the regions `filter` matches (all their microbatches, or those its `MB`
    names). `mode="full"`: their forward keeps only its inputs, and their backward first
    runs the forward again, one more forward per backward for all the activations autograd
    would save. `mode="selective"`: only the attention cores (scores, softmax, dropout,
    probabilities times values) keep just their inputs and run again in the backward, a
    few percent more FLOPs for the activations that grow with the sequence squared."""
    return Recompute(filter, mode)


def _key(n) -> tuple:
    return n.region, tuple((k, v) for k, v in n.tags if k != "PASS")


def recompute_attention(capture, directives: Directives, ctx: CaptureContext):
    """The capture pass of selective recompute: the attention cores of every region a
    selective directive matches run again in the backward (`capture.attention_core`); a
    region whose cores run so already (a compile of this plan for another batch) stays."""
    chosen = tuple((i, d) for i, d in directives if d.mode == "selective")
    if not chosen:
        return capture
    return rewrite_regions(capture, chosen, recompute_cores, _no_core,
                           rewritten=lambda gm: any(isinstance(m, Recomputed)
                                                    for m in gm.modules()))


def _no_core(filt: dict, names: str) -> str:
    return (f"selective recompute: the regions {filt} matches ({names}) hold no attention core "
            "(a product of two activations, what is computed from it, and its product with "
            "the values; or a fused attention) to recompute; use mode='full', or a filter "
            "that names attention layers")


def apply_recompute(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    """Mark every F, B and BI of the matched (region, microbatch) pairs `recompute=<index>`
    (full recompute; selective recompute changed the regions already)."""
    directives = tuple((i, d) for i, d in directives if d.mode == "full")
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
