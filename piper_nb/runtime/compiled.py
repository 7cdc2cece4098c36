"""Regions run through `torch.compile` (`pn.compile_regions`): a region's module compiled
once per worker, its forward and backward by AOTAutograd, and what the compiles cost.

`CompiledRegion` stands in for the module: the first call with a new signature (the
inputs' shapes, dtypes and whether they need gradients, and the grad mode: a recomputed
region runs its first forward without autograd) compiles, with the backward lowered then
too rather than at its first run, so the time a step spends compiling is the time of
those first calls (`seconds`, reported per step: `Result.compile_s`). A worker with a
backward split into BI and BW (which keeps the graph between them) compiles without
donated buffers. A failure to compile is raised as a `RuntimeError` naming the region and
PyTorch's first line, which the cluster reports as the worker's failure.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch._functorch.config  # noqa: F401 - the AOTAutograd settings below

from piper_nb.directives.compile_regions import parse_setting
from piper_nb.ir.kinds import PASSES, Op

__all__ = ["CompiledRegion", "compiled_modules"]


class CompiledRegion:
    """A region's module under `torch.compile` with the setting its instructions carry."""

    def __init__(self, module: torch.nn.Module, setting: str, name: str):
        self.module, self.setting, self.name = module, setting, name
        self.fn = torch.compile(module, **parse_setting(setting))
        self.seen: set = set()
        self.seconds = 0.0

    def __getattr__(self, name: str):   # buffers, rank attributes: the module's
        return getattr(self.module, name)

    def __call__(self, *args):
        key = (torch.is_grad_enabled(), *(
            (tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in args))
        if key in self.seen:
            return self.fn(*args)
        start = time.perf_counter()
        try:
            with _lowering():
                out = self.fn(*args)
        except Exception as err:   # noqa: BLE001 - PyTorch's words, with the region's name
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise RuntimeError(f"compile_regions: region {self.name} fails under "
                               f"torch.compile ({self.setting}): {type(err).__name__}: "
                               f"{first}") from err
        self.seconds += time.perf_counter() - start
        self.seen.add(key)
        return out


def _lowering():
    """Lower the backward with the forward (AOTAutograd defers it to its first run)."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def compiled_modules(plan, instrs, modules: dict) -> dict:
    """`modules` (region -> module) with each region whose passes carry a compile setting
    (`Pass.compiled`) wrapped in a `CompiledRegion`."""
    settings = {i.region: i.data.compiled for i in instrs
                if i.kind in PASSES and i.data.compiled}
    split = {i.region for i in instrs if i.kind == Op.BI}
    if split & set(settings) and hasattr(torch._functorch.config, "donated_buffer"):
        # BI keeps the graph for BW, which a backward donating its buffers cannot (the
        # setting is read as the backward runs: for this worker's process, which is its own)
        torch._functorch.config.donated_buffer = False
    return {r: CompiledRegion(m, settings[r], plan.regions[r].name) if r in settings else m
            for r, m in modules.items()}
