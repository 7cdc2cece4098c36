"""Every tensor-parallel pattern must match: a plan that shards nothing is refused before
anything runs, never compiled as TP with every device running the whole model.

The user's plan is checked pattern by pattern against the model's module and parameter
paths (`check_patterns`): a typo, or annotate-style brackets (`blocks.[0-1].mlp.0`) where
a plan takes `*`, matches nothing. A pattern that names a module the styles cannot cut (a
LayerNorm given `colwise`) is refused by its type (`check_types`). And a directive whose
regions end up with nothing sharded is refused (`nothing_sharded`). Each error names the
directive, the pattern and the closest module names (`difflib`, as the unmatched
`param_groups` patterns of `optim` do), and says how to fix it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

from torch import nn

from piper_nb.errors import PlanError
from piper_nb.tp.styles import Style, matches_path, style_of

__all__ = ["SHARDABLE", "check_patterns", "check_types", "nothing_sharded"]

SHARDABLE = (nn.Linear, nn.Embedding)
_OP = "tensor_parallel"


def _general(path: str) -> str:
    """`blocks.0.mlp.up` -> `blocks.*.mlp.up`: a path as a plan pattern spells it."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def _candidates(paths: Iterable[str]) -> list[str]:
    """Every path, generalized, and each of its suffixes at component boundaries (a
    pattern is anchored at the end only)."""
    out = set()
    for p in paths:
        parts = _general(p).split(".")
        out |= {".".join(parts[i:]) for i in range(len(parts))}
    return sorted(out - {"", "*"})


def closest(pattern: str, paths: Iterable[str], n: int = 3) -> str:
    """' (closest: 'a', 'b')', or the first few paths when nothing is close."""
    paths = list(paths)
    near = difflib.get_close_matches(pattern, _candidates(paths), n=n, cutoff=0.5)
    if near:
        return "closest: " + ", ".join(repr(c) for c in near)
    return "modules look like " + ", ".join(repr(p) for p in paths[:3])


def check_patterns(model: nn.Module, plan: Mapping[str, str], directive: int) -> None:
    """A pattern of the user's plan that matches no module or parameter path: PlanError."""
    modules = [p for p, _ in model.named_modules() if p]
    names = modules + [p for p, _ in model.named_parameters()]
    for pattern, style in plan.items():
        if any(matches_path(pattern, p) for p in names):
            continue
        hint = " (a plan takes * for any one component, not brackets)" if "[" in pattern \
            else ""
        raise PlanError(f"tensor_parallel: plan pattern {pattern!r} ({style}) matches no "
                        f"module of {type(model).__name__}{hint}; "
                        f"{closest(pattern, modules)}; fix or remove it",
                        directive=directive, op=_OP)


def check_types(model: nn.Module, plan: Mapping[str, str], paths: Iterable[str],
                directive: int) -> None:
    """A module at one of `paths` (a region's) that the plan cuts but no style can (not a
    linear layer or an embedding): PlanError naming its type."""
    for path in paths:
        sh = style_of(plan, path)
        if sh is None or sh.style == Style.REPLICATE:
            continue
        mod = model.get_submodule(path)
        if isinstance(mod, SHARDABLE) or not _has_weight(mod):
            continue
        kind = type(mod).__name__
        hint = (" (transformers' Conv1D, GPT-2's, is a transposed linear layer that the "
                "styles do not cut yet: keep it whole, 'replicate', or use a model built on "
                "nn.Linear)") if kind == "Conv1D" else ""
        raise PlanError(f"tensor_parallel: plan gives {path} ({kind}) {sh.style}, but "
                        f"tensor_parallel shards only nn.Linear and nn.Embedding{hint}; "
                        "give it 'replicate' or drop its pattern", directive=directive, op=_OP)


def _has_weight(mod: nn.Module) -> bool:
    return any(True for _ in mod.parameters(recurse=False))


def nothing_sharded(plan: Mapping[str, str], regions: list, paths: list[str],
                    directive: int) -> PlanError:
    """The error for a directive whose regions hold nothing its plan shards."""
    where = ", ".join(r.name for r in regions)
    shown = ", ".join(repr(p) for p in list(plan)[:4]) + (", ..." if len(plan) > 4 else "")
    near = closest(next(iter(plan), ""), paths) if paths else "they hold no linear layer"
    return PlanError(f"tensor_parallel: the plan ({shown}) shards nothing in region(s) "
                     f"{where}: no linear layer or embedding there matches a pattern "
                     f"({near}); fix the patterns, or drop the directive",
                     directive=directive, op=_OP)
