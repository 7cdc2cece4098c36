"""`compile_regions`: the matched regions' forwards and backwards run through
`torch.compile` on the workers (AOTAutograd: one compiled forward and one compiled
backward per region and shape), as torchtitan's `--compile` compiles each block.

The value `CompileRegions` (JSON `{"op": "compile_regions", "filter": {...}, "mode":
"default", "dynamic": false, "backend": "inductor"}`), its constructor
`pn.compile_regions`, and its DAG pass: every pass of a matched region is marked, and the
lowering writes the setting into each of its instructions (`Pass.compiled`, e.g.
`"inductor"` or `"inductor:max-autotune:dynamic"`), which `print(plan)` lists under the
regions. The runtime compiles a region's module on a worker the first time it runs
(`runtime.compiled`); the compile's own time is reported on the first step
(`Result.compile_s`) and so kept out of the step times that follow.

Recompute (the forward run again before the backward, without autograd the first time)
and the parts of tensor- and context-parallel regions (the collectives between them stay
the plan's) compile as any region does. A backward split into its input and weight halves
(zero-bubble schedules, DualPipe) stays exact, but AOTAutograd has one backward graph per
region, which computes every gradient: BI runs it, and BW runs it again for the weights'
(a whole backward's time, not half).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.directives.base import (
    Context,
    Directive,
    Directives,
    call_code,
    check_choice,
    whole_regions,
)
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import matches
from piper_nb.ir.kinds import PASSES

__all__ = ["CompileRegions", "compile_regions", "apply_compile_regions", "MODES", "BACKENDS",
           "compile_setting", "parse_setting", "compiled_regions"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKENDS = ("inductor", "aot_eager")


@dataclass(frozen=True)
class CompileRegions(Directive):
    """Run the matched regions through `torch.compile`."""

    filter: Mapping[str, Any]
    mode: str = "default"
    dynamic: bool = False
    backend: str = "inductor"
    op = "compile_regions"

    def __post_init__(self):
        object.__setattr__(self, "filter", whole_regions(self.filter, self.op,
                                                         "a region is compiled"))
        check_choice(self.op, "mode", self.mode, MODES)
        check_choice(self.op, "backend", self.backend, BACKENDS)
        check_choice(self.op, "dynamic", self.dynamic, (True, False))

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "compile_regions", "filter": {}}

    def code(self) -> str:
        return call_code("pn.compile_regions", compile_regions, vars(self))


def compile_regions(filter: Mapping[str, Any], mode: str = "default", dynamic: bool = False,
                    backend: str = "inductor") -> CompileRegions:
    """Compile the regions `filter` matches with `torch.compile` on the workers: each
    region's forward and backward (AOTAutograd), once per shape, with `mode` (`"default"`,
    `"max-autotune"`, ...) and `dynamic` as `torch.compile` takes them. `backend="inductor"`
    generates kernels (Triton on a GPU, C++ on the CPU); `"aot_eager"` traces and partitions
    the same graphs but runs them eagerly (quick to compile: for checking). The first step
    pays the compile (`Result.compile_s`)."""
    return CompileRegions(filter, mode, dynamic, backend)


def compile_setting(d: CompileRegions) -> str:
    """The setting as instructions carry it: `backend[:mode][:dynamic]`."""
    return ":".join([d.backend, *([d.mode] if d.mode != "default" else []),
                     *(["dynamic"] if d.dynamic else [])])


def parse_setting(setting: str) -> dict[str, Any]:
    """`torch.compile`'s keyword arguments for an instruction's setting."""
    backend, *rest = setting.split(":")
    mode = next((r for r in rest if r != "dynamic"), "default")
    return {"backend": backend, "mode": None if mode == "default" else mode,
            "dynamic": "dynamic" in rest}


def compiled_regions(regions, directives) -> dict[int, str]:
    """Region index -> the compile setting of the first `CompileRegions` of `directives`
    (`(index, directive)` pairs) matching it."""
    out: dict[int, str] = {}
    for _, d in directives:
        if isinstance(d, CompileRegions):
            for r in regions:
                if r.index not in out and matches(d.filter, dict(r.tags)):
                    out[r.index] = compile_setting(d)
    return out


def apply_compile_regions(dag: TrainingDAG, directives: Directives, ctx: Context
                          ) -> TrainingDAG:
    """Mark every pass of the matched regions `compiled=<setting>` (the first directive
    matching a region wins)."""
    if not directives:
        return dag
    regions = dag.regions()
    for idx, d in directives:
        if not any(matches(d.filter, dict(r.tags)) for r in regions):
            raise PlanError(f"compile_regions filter {dict(d.filter)} matches no region; "
                            "name a region's tags (such as {'PP': 0}), or {} for all",
                            directive=idx, op=d.op)
    chosen = compiled_regions(regions, directives)
    nodes = [n.with_attrs(compiled=chosen[n.region])
             if n.op in PASSES and n.region in chosen else n for n in dag.nodes]
    return dag.replace(nodes=nodes, step=f"{len(chosen)} regions")
