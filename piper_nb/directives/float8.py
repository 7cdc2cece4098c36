"""`float8`: the linear layers of the matched regions multiply in Float8, as torchao's
float8 training does (`convert_to_float8_training`, tensorwise dynamic scaling), what
torchtitan's 70B and 405B runs used.

The value `Float8` (JSON `{"op": "float8", "filter": {...}}`), its constructor `pn.float8`,
and its capture pass: in each region the filter matches, every `nn.Linear` (or `F.linear`
on a parameter) whose weight's dimensions are multiples of 16 becomes a
`capture.float8.float8_linear` call (casts with amax scales, `torch._scaled_mm`). The
region's parameters keep their names and dtypes, so ZeRO, the optimizer and checkpoints
see what they saw; the saved bytes the compile measures, the runtime, and the analytic
cost model (Float8 matmuls at the GPU's FP8 rate, the casts and amax reductions as the
memory-bound kernels they are) see the rewritten regions as they are. Like
`recompute(mode="selective")`, it applies to every microbatch: its filter names no `MB`.

torchtitan leaves the output projection in bf16 (its `filter_fqns`): name the regions of
the decoder layers, not the head.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from piper_nb.capture.float8 import float8_linears, uses_float8
from piper_nb.directives.base import CaptureContext, Directive, Directives, call_code
from piper_nb.errors import PlanError
from piper_nb.ir.filters import as_filter, matches

__all__ = ["Float8", "float8", "apply_float8"]


@dataclass(frozen=True)
class Float8(Directive):
    """Run the matched regions' linear layers with Float8 matmuls."""

    filter: Mapping[str, Any]
    op = "float8"

    def __post_init__(self):
        filt = as_filter(self.filter, where="float8 filter")
        for key in ("PASS", "MB"):
            if key in filt:
                raise PlanError(f"float8 filter {filt} names {key}; Float8 changes the regions "
                                "themselves, for every pass and microbatch: drop "
                                f"{key} from the filter")
        object.__setattr__(self, "filter", filt)

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "float8", "filter": {"PP": 0}}

    def code(self) -> str:
        return call_code("pn.float8", float8, vars(self))


def float8(filter: Mapping[str, Any]) -> Float8:
    """Multiply in Float8 in the regions `filter` matches: each linear layer whose weight's
    dimensions are multiples of 16 casts its input and weight to float8 e4m3 (its output's
    gradient to e5m2) with one dynamic scale per tensor and multiplies with
    `torch._scaled_mm`, as torchao's float8 training does. Training it needs FP8 matmuls
    (a CUDA GPU of compute capability 8.9 or later, or the CPU); the analytic cost model
    prices it at the GPU's FP8 rate."""
    return Float8(filter)


def apply_float8(capture, directives: Directives, ctx: CaptureContext):
    """The capture pass: every eligible linear of the matched regions made Float8; each
    changed region is a new module, the user's capture stays as it was."""
    if not directives:
        return capture
    modules, done = list(capture.modules), set()
    for idx, d in directives:
        hits = [r for r in capture.regions if matches(d.filter, dict(r.tags))]
        if not hits:
            raise PlanError(f"float8 filter {dict(d.filter)} matches no region; regions are "
                            + ", ".join(r.name for r in capture.regions),
                            directive=idx, op=d.op)
        for r in hits:
            gm = modules[r.index]
            if r.index in done or not hasattr(gm, "graph"):
                continue
            mine = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
            if float8_linears(mine):
                modules[r.index] = mine
                done.add(r.index)
            elif uses_float8([gm]):   # a capture made Float8 already (a plan compiled again
                done.add(r.index)     # for another batch shape)
        if not any(r.index in done for r in hits):
            raise PlanError(
                f"float8: the regions {dict(d.filter)} matches ("
                + ", ".join(r.name for r in hits[:4]) + (", ..." if len(hits) > 4 else "")
                + ") hold no linear layer whose weight's dimensions are multiples of 16 (what "
                "Float8 matmuls take); name regions with such layers, or drop the directive",
                directive=idx, op=d.op)
    return dataclasses.replace(capture, modules=tuple(modules))
