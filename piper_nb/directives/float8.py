"""`float8`: the linear layers of the matched regions multiply in Float8, as torchao's
float8 training does (`convert_to_float8_training`, tensorwise dynamic scaling), what
torchtitan's 70B and 405B runs used.

The value `Float8` (JSON `{"op": "float8", "filter": {...}}`), its constructor `pn.float8`,
and its capture pass: in each region the filter matches, every `nn.Linear` (or `F.linear`
on a parameter) whose weight's dimensions are multiples of 16 becomes a call of a
`capture.float8.Float8Matmul` submodule (casts with amax scales, `torch._scaled_mm`). The
region's parameters keep their names and dtypes, so ZeRO, the optimizer and checkpoints
see what they saw; the saved bytes the compile measures, the runtime, and the analytic
cost model (Float8 matmuls at the GPU's FP8 rate, the casts and amax reductions as the
memory-bound kernels they are) see the rewritten regions as they are. Like
`recompute(mode="selective")`, it applies to every microbatch: its filter names no `MB`.

torchtitan leaves the output projection in bf16 (its `filter_fqns`): name the regions of
the decoder layers, not the head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.capture.float8 import float8_linears, uses_float8
from piper_nb.directives.base import (
    CaptureContext,
    Directive,
    Directives,
    call_code,
    whole_regions,
)
from piper_nb.directives.region_rewrite import rewrite_regions

__all__ = ["Float8", "float8", "apply_float8"]


@dataclass(frozen=True)
class Float8(Directive):
    """Run the matched regions' linear layers with Float8 matmuls."""

    filter: Mapping[str, Any]
    op = "float8"

    def __post_init__(self):
        object.__setattr__(self, "filter", whole_regions(
            self.filter, self.op, "Float8 changes the regions themselves"))

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
    """The capture pass: every eligible linear of the matched regions made Float8 (a region
    made Float8 already, by a compile of this plan for another batch, stays as it is)."""
    return rewrite_regions(capture, directives, float8_linears, _nothing,
                           rewritten=lambda gm: uses_float8([gm]))


def _nothing(filt: dict, names: str) -> str:
    return (f"float8: the regions {filt} matches ({names}) hold no linear layer whose "
            "weight's dimensions are multiples of 16 (what Float8 matmuls take); name regions "
            "with such layers, or drop the directive")
