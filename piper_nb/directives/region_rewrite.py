"""Capture passes that rewrite the graphs of the regions a directive matches (selective
recompute's attention cores, Float8's linears): each changed region a new module, the
user's capture left as it was, and a filter that matches nothing, or matches regions with
nothing to rewrite, a PlanError naming the directive."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch.fx as fx

from piper_nb.directives.base import Directives
from piper_nb.errors import PlanError
from piper_nb.ir.filters import matches

__all__ = ["rewrite_regions"]


def rewrite_regions(capture, directives: Directives, rewrite: Callable[[fx.GraphModule], int],
                    nothing: Callable[[dict, str], str],
                    rewritten: Callable[[fx.GraphModule], bool] | None = None):
    """`capture` with `rewrite(graph module)` (in place; how many changes) applied to a copy
    of each region a directive matches. `nothing(filter, region names)` is the PlanError's
    text when no region a directive matches changes; `rewritten(module)` says a region was
    rewritten already (a capture compiled again), which counts as changed."""
    modules, done = list(capture.modules), set()
    for idx, d in directives:
        hits = [r for r in capture.regions if matches(d.filter, dict(r.tags))]
        if not hits:
            raise PlanError(f"{d.op} filter {dict(d.filter)} matches no region; regions are "
                            + ", ".join(r.name for r in capture.regions),
                            directive=idx, op=d.op)
        for r in hits:
            gm = modules[r.index]
            if r.index in done or not hasattr(gm, "graph"):
                continue
            mine = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
            if rewrite(mine):
                modules[r.index] = mine
                done.add(r.index)
            elif rewritten is not None and rewritten(gm):
                done.add(r.index)
        if not any(r.index in done for r in hits):
            names = ", ".join(r.name for r in hits[:4]) + (", ..." if len(hits) > 4 else "")
            raise PlanError(nothing(dict(d.filter), names), directive=idx, op=d.op)
    return dataclasses.replace(capture, modules=tuple(modules))
