"""From Designer state to plan, trace and problems: `compile_state`, `evaluate`.

Problems are collected, never raised: each `PlanError` becomes a `Problem` that names
the directive row (its index, so the UI can highlight it) or the layer it comes from,
with the library's readable message and no traceback. Checks run cheapest first: layer
tags one module at a time, then each row on its own (JSON form, schedule builder), and
only when all of those pass the whole program is compiled and simulated. Captures are
cached per annotation set in the `cache` dict the caller owns (the Designer keeps one),
so an edit of a directive recompiles in tens of milliseconds. Compiling runs the model on
a slice of the batch to learn shapes; on tensors that small torch's worker threads only
contend (10-20x slower on a loaded 2-core machine), so it runs on one intra-op thread.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from piper_nb.capture.annotate import annotate
from piper_nb.capture.loss import resolve_loss
from piper_nb.compiler.compile import compile as compile_plan
from piper_nb.compiler.compile import expand
from piper_nb.directives.spec import Program, directive_from_json
from piper_nb.errors import PlanError
from piper_nb.profile import CostModel
from piper_nb.sim.simulate import simulate
from piper_nb.ui.state import DesignerState

__all__ = ["Problem", "Outcome", "compile_state", "simulate_plan", "cost_model", "evaluate",
           "COST_MODELS"]

COST_MODELS = {"uniform (F=1, B=2, W=1)": "uniform", "analytic (H100)": "analytic",
               "profiled here": "profiled"}


@dataclass(frozen=True)
class Problem:
    """One thing wrong, pointing at a directive row or a layer when it can."""

    message: str
    row: int | None = None          # index of the directive row to fix
    op: str | None = None
    layer: str | None = None        # module path whose tags are wrong
    stage: str = "compile"   # "layer" | "directive" | "compile" | "simulate" | "memory" | "internal"

    @property
    def where(self) -> str:
        if self.row is not None:
            return f"directive #{self.row}" + (f" ({self.op})" if self.op else "")
        if self.layer is not None:
            return f"layer {self.layer}"
        return self.stage

    def text(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Outcome:
    """Everything one refresh produced; `seconds` times each phase."""

    plan: Any = None
    trace: Any = None
    problems: list[Problem] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def _from_error(err: PlanError, stage: str, rows=(), annotations=None) -> Problem:
    """The error as a problem of the row the user wrote: a schedule row, not the order or
    split it expands to; a stage no row places, as a problem of the layer tagged with it."""
    row = err.directive
    if row is not None and 0 <= row < len(rows) and isinstance(rows[row], dict):
        return Problem(err.reason, row=row, op=_row_name(rows[row]), stage=stage)
    unplaced = _UNPLACED.search(err.reason)
    if row is None and unplaced and annotations:
        with contextlib.suppress(ValueError, SyntaxError):
            tags = ast.literal_eval(unplaced.group(1))
            layer = next((path for path, own in annotations.items() if isinstance(own, dict)
                          and tags and all(own.get(k) == v for k, v in tags.items())), None)
            if layer is not None:
                return Problem(err.reason, layer=layer, stage=stage)
    return Problem(err.reason, row=row, op=err.op, stage=stage)


_UNPLACED = re.compile(r"add a place directive for (\{.*\})")


def schedule_problems(state: DesignerState) -> list[Problem]:
    """Stages numbered with a gap (a layer set to PP 5 of 4): the layers past it. A
    schedule row whose stages are not the layers' (ranks=2 over a model cut into 4 stages
    deadlocks, or leaves stages unordered): the row, and its ranks set right."""
    stages = {own["PP"] for own in state.annotations.values()
              if isinstance(own, dict) and isinstance(own.get("PP"), int)}
    if stages != set(range(len(stages))):    # a gap: the layers past it are wrong
        gap = min(set(range(max(stages) + 1)) - stages)
        return [Problem(f"PP {own['PP']} leaves PP {gap} without a layer (the stages are "
                        f"{', '.join(map(str, sorted(stages)))}): number the stages from 0 "
                        f"without a gap, PP {gap} here or below", layer=path, stage="layer")
                for path, own in state.annotations.items()
                if isinstance(own, dict) and isinstance(own.get("PP"), int) and own["PP"] > gap]
    out = []
    for i, row in enumerate(state.rows):
        if not (isinstance(row, dict) and row.get("op") == "schedule" and stages
                and isinstance(row.get("ranks"), int)):
            continue
        try:
            expanded = expand([directive_from_json(row)])
        except PlanError:
            continue                                      # row_problems says why
        ordered = {g["PP"] for _, d in expanded if getattr(d, "op", "") == "order"
                   for group in d.groups for g in group if isinstance(g.get("PP"), int)}
        if not ordered or ordered == stages:
            continue
        ranks = row["ranks"] * len(stages) / len(ordered)
        fix = (f"set ranks={int(ranks)}" if ranks == int(ranks) else
               f"cut the layers into a multiple of {len(ordered) // row['ranks']} stages")
        out.append(Problem(
            f"ranks={row['ranks']} orders {_stages(ordered)}, but the layers are cut into "
            f"{_stages(stages)}: {fix}", row=i, op=_row_name(row), stage="directive"))
    return out


def _stages(pp: set[int]) -> str:
    n = len(pp)
    span = (f"PP {min(pp)}-{max(pp)}" if sorted(pp) == list(range(min(pp), max(pp) + 1))
            else "PP " + ", ".join(map(str, sorted(pp))))
    return f"{n} stage{'s' * (n != 1)} ({span})"


def _row_name(row: dict) -> str | None:
    """A row as its editor shows it: its op, and a schedule's name."""
    if row.get("op") == "schedule" and row.get("name"):
        return f"schedule {row['name']}"
    return row.get("op")


def _internal(err: Exception, stage: str) -> Problem:
    return Problem(f"{type(err).__name__}: {err} (an internal error of piper_nb; please report "
                   "it with the program's JSON)", stage="internal")


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _spec(state: DesignerState, cache: dict):
    key = ("spec", json.dumps(state.annotations, sort_keys=True, default=str))
    if key not in cache:
        cache[key] = annotate(state.model, state.annotations)
    return cache[key]


def layer_problems(state: DesignerState) -> list[Problem]:
    out = []
    for path, tags in state.annotations.items():
        if not isinstance(tags, dict):
            out.append(Problem(f"tags must be written tag=index, got {tags!r}", layer=path,
                               stage="layer"))
            continue
        try:
            annotate(state.model, {path: tags})
        except PlanError as err:
            out.append(Problem(err.reason.removeprefix("annotate: "), layer=path, stage="layer"))
    return out


def row_problems(state: DesignerState) -> list[Problem]:
    out = []
    for i, row in enumerate(state.rows):
        op = _row_name(row) if isinstance(row, dict) else None
        try:
            expand([directive_from_json(row)])   # a schedule is checked by expanding it
        except PlanError as err:
            out.append(Problem(err.reason, row=i, op=op, stage="directive"))
    return out


def compile_state(state: DesignerState, cache: dict | None = None) -> tuple[Any, list[Problem]]:
    """(plan, []) or (None, problems) for the state's annotations and rows."""
    cache = {} if cache is None else cache
    key = ("layers", json.dumps(state.annotations, sort_keys=True, default=str))
    if key not in cache:        # one annotate per layer: checked once per annotation set
        cache[key] = layer_problems(state)
    problems = list(cache[key]) + row_problems(state)
    problems = problems or schedule_problems(state)
    if problems:
        return None, problems
    if not state.rows:
        return None, [Problem("the program is empty: add directives or pick a schedule",
                              stage="directive")]
    try:
        if state.loss_fn is None:   # the Designer's own words: it takes loss_fn= too
            resolve_loss(state.model, None, "pn.Designer(model, batch, loss_fn=...)")
        with one_thread():
            return compile_plan(_spec(state, cache), Program(state.rows), state.batch,
                                loss_fn=state.loss_fn), []
    except PlanError as err:
        return None, [_from_error(err, "compile", state.rows, state.annotations)]
    except Exception as err:  # a bug below us: show it as a problem, not a traceback
        return None, [_internal(err, "compile")]


def cost_model(state: DesignerState, plan, cache: dict | None = None) -> CostModel:
    """The state's cost model for `plan`; profiled ones are cached per regions and shapes."""
    if state.cost == "analytic":
        return CostModel.analytic(plan)
    if state.cost == "profiled":
        cache = {} if cache is None else cache
        key = ("profile", json.dumps(state.annotations, sort_keys=True, default=str),
               plan.batch_size // max(plan.microbatches, 1))
        if key not in cache:
            cache[key] = CostModel.profile(plan, comm=False)
        return cache[key]
    return CostModel.uniform(F=1, B=2, W=1)


def simulate_plan(state: DesignerState, plan, cache: dict | None = None) -> tuple[Any, list[Problem]]:
    """The trace, and a "memory" problem per device whose predicted peak exceeds the
    hardware's memory (when the cost model knows it: analytic)."""
    try:
        trace = simulate(plan, cost_model(state, plan, cache))
        over = trace.over_capacity() if trace.memory_capacity is not None else []
        return trace, [Problem(line, stage="memory") for line in over]
    except PlanError as err:
        return None, [_from_error(err, "simulate")]
    except Exception as err:
        return None, [_internal(err, "simulate")]


def evaluate(state: DesignerState, cache: dict | None = None) -> Outcome:
    """Compile and simulate the state, timing each phase."""
    cache = {} if cache is None else cache
    out = Outcome()
    t0 = time.perf_counter()
    out.plan, out.problems = compile_state(state, cache)
    t1 = time.perf_counter()
    out.seconds["compile"] = t1 - t0
    if out.plan is not None:
        out.trace, problems = simulate_plan(state, out.plan, cache)
        out.problems += problems
        out.seconds["simulate"] = time.perf_counter() - t1
    return out
