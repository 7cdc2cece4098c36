"""Dropout in `pn.reference_train(..., seed=)`: one process drawing the masks a plan draws.

A plan seeds each region's forward of each microbatch from (seed, step, region,
microbatch), `runtime.rng`; a tensor-parallel part continues its region's stream, so a TP
plan draws what the unsharded region draws. Here, in one process, a forward pre-hook on
each module that enters a region seeds torch's generator the same way the first time that
region runs in a microbatch, so the same model trained plainly draws the same masks: equal,
mask for mask, to a plan whose forwards each see the whole microbatch (PP, TP, EP), not to
data parallelism, whose replicas each draw their own shard's masks.

A region is named by the effective tags of the module (`Spec.tags_of`); a plain
`nn.Module` is the one region `PP=0` an unannotated model is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from piper_nb.ir.filters import tags_text
from piper_nb.runtime.rng import forward_seed

__all__ = ["RegionSeeds"]


class RegionSeeds:
    """Hooks on a model that seed each region's forward as a plan with `seed` does; call
    `microbatch(step, mb)` before each microbatch's forward and `remove()` at the end."""

    def __init__(self, model: nn.Module, tags_of: Callable[[str], dict], seed: int):
        self.seed, self.where = seed, (0, 0)
        self.seen: set[str] = set()
        self.handles, self.first = [], None
        for path, module in model.named_modules():
            name = tags_text(tags_of(path))
            parent = tags_text(tags_of(path.rpartition(".")[0])) if path else None
            if name and name != parent:
                self.first = self.first or name
                self.handles.append(module.register_forward_pre_hook(self._hook(name)))

    def microbatch(self, step: int, mb: int) -> None:
        """Before microbatch `mb` of `step`: the first region (the first tagged module's)
        seeded at once, since untagged modules run before it (embeddings) join it."""
        self.where, self.seen = (step, mb), set()
        if self.first is not None:
            self._enter(self.first)

    def _enter(self, region: str) -> None:
        if region not in self.seen:   # a region seeds once per microbatch, as a plan's F
            self.seen.add(region)
            torch.manual_seed(forward_seed(self.seed, self.where[0], region, self.where[1], 0))

    def _hook(self, region: str):
        def enter(module, args):
            self._enter(region)
        return enter

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
