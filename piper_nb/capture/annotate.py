"""Annotations: which tags each part of a model carries (`pn.annotate`, `cut_stages`).

`annotate(model, {"blocks.[0-1]": {"PP": 0}, "head": {"PP": 1}})` maps module paths,
with shell patterns (`blocks.*`, `blocks.[0-3]`), to tags. A module inherits the tags of
its parents; a child's own tags extend or override them; for one module, later entries
override earlier ones. `cut_stages` proposes an even pipeline cut by parameters or FLOPs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from piper_nb.errors import PlanError

__all__ = ["Spec", "annotate", "cut_stages", "pipeline_units"]


@dataclass(eq=False)
class Spec:
    """A model plus its annotations; captured into regions lazily (per loss function)."""

    model: nn.Module
    module_tags: dict[str, dict[str, int]]
    annotations: dict[str, dict[str, int]] = field(default_factory=dict)
    _captures: dict = field(default_factory=dict, repr=False)

    def tags_of(self, path: str) -> dict[str, int]:
        """Effective tags of module `path`: its ancestors' tags, extended by its own."""
        tags: dict[str, int] = {}
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            tags.update(self.module_tags.get(".".join(parts[:i]), {}))
        return tags

    def capture(self, loss_fn: Callable | None = None, example: tuple | None = None,
                method: str = "auto"):
        """The model cut into regions (cached per loss function and front end); `example`,
        an (inputs, targets) batch, lets models torch.fx cannot trace be exported."""
        from piper_nb.capture.loss import resolve_loss
        from piper_nb.capture.split import capture_regions
        loss_fn = resolve_loss(self.model, loss_fn, "pn.compile")
        key = (id(loss_fn) if not hasattr(loss_fn, "__func__") else id(loss_fn.__func__), method)
        if key not in self._captures:
            self._captures[key] = capture_regions(self, loss_fn, example, method)
        return self._captures[key]

    def __repr__(self) -> str:
        return f"Spec({type(self.model).__name__}, {self.annotations})"


def _check_tags(where: str, tags: Any) -> dict[str, int]:
    if not isinstance(tags, Mapping):
        raise PlanError(f"annotate: tags for {where!r} must be a {{tag: index}} dict, got {tags!r}")
    for k, v in tags.items():
        if not isinstance(k, str) or k in ("PASS", "MB"):
            raise PlanError(f"annotate: {k!r} on {where!r} is not a free tag name "
                            "(PASS and MB are set by piper_nb)")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"annotate: tag {k} on {where!r} must be a non-negative int, got {v!r}")
    return dict(tags)


def annotate(model: nn.Module, mapping: Mapping[str, Mapping[str, int]] | None = None) -> Spec:
    """Tag the modules of `model`; patterns match dotted module paths (fnmatch syntax)."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"annotate expects an nn.Module, got {type(model).__name__}")
    mapping = dict(mapping or {})
    paths = [p for p, _ in model.named_modules() if p]
    module_tags: dict[str, dict[str, int]] = {}
    for pattern, tags in mapping.items():
        tags = _check_tags(pattern, tags)
        hits = [pattern] if pattern in paths or pattern == "" else [
            p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            near = ", ".join(paths[:12]) + (" ..." if len(paths) > 12 else "")
            raise PlanError(f"annotate: {pattern!r} matches no module of {type(model).__name__}; "
                            f"its modules are {near}")
        for p in hits:
            module_tags.setdefault(p, {}).update(tags)
    return Spec(model=model, module_tags=module_tags, annotations=mapping)


def pipeline_units(model: nn.Module) -> list[str]:
    """The model's top-level children in order, ModuleLists/Sequentials expanded once."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units.extend(f"{name}.{i}" for i, _ in enumerate(child))
        else:
            units.append(name)
    return units


def _unit_costs(model: nn.Module, units: list[str], by: str, example: tuple | None) -> list[float]:
    if by == "params":
        seen: set[int] = set()
        costs = []
        for u in units:
            mod = model.get_submodule(u)
            c = 0
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    c += p.numel()
            costs.append(float(c))
        return costs
    if by == "flops":
        if example is None:
            if not hasattr(model, "example_batch"):
                raise PlanError("cut_stages(by='flops') needs example=(inputs, targets)")
            example = model.example_batch(batch_size=2, seed=0)
        from torch.utils.flop_counter import FlopCounterMode

        from piper_nb.capture.untouched import untouched
        counter = FlopCounterMode(display=False)
        with untouched(model), counter, torch.no_grad():
            model(example[0])
        counts = counter.get_flop_counts()
        root = type(model).__name__
        costs = []
        for u in units:
            key = f"{root}.{u}"
            costs.append(float(sum(counts.get(key, {}).values())) or 1.0)
        return costs
    raise PlanError(f"cut_stages: by must be 'params' or 'flops', got {by!r}")


def _linear_partition(costs: list[float], n: int) -> list[int]:
    """Contiguous split of costs into n parts minimising the largest part; returns part ids."""
    m = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for i in range(k, m + 1):
            for j in range(k - 1, i):
                v = max(best[j][k - 1], prefix[i] - prefix[j])
                if v < best[i][k]:
                    best[i][k], cut[i][k] = v, j
    parts = [0] * m
    i = m
    for k in range(n, 0, -1):
        j = cut[i][k]
        for t in range(j, i):
            parts[t] = k - 1
        i = j
    return parts


def cut_stages(model: nn.Module, n: int, *, by: str = "params", tag: str = "PP",
               example: tuple | None = None) -> dict[str, dict[str, int]]:
    """An annotation mapping that cuts `model` into `n` contiguous stages of even cost."""
    units = pipeline_units(model)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlanError(f"cut_stages: n must be a positive int, got {n!r}")
    if n > len(units):
        raise PlanError(f"cut_stages: cannot cut {len(units)} units ({', '.join(units)}) into "
                        f"{n} stages; use at most {len(units)}")
    parts = _linear_partition(_unit_costs(model, units, by, example), n)
    return {u: {tag: s} for u, s in zip(units, parts, strict=True)}
