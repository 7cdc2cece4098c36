"""The Designer's state and the pure edits on it (no widgets here).

A `DesignerState` is the model, the batch, the annotations (module path -> own tags) and
the directive program as rows of Piper's JSON objects. Every edit is a function
`state -> new state` that leaves the caller's state alone (PyTorch's `_merge_bw` mutates
its input; ours must not), so the widget layer only wires controls to these functions and
tests run without a browser. Rows keep what the user typed even when it is wrong: a row
whose devices read `"0,x"` stays in the program and compiles to a Problem pointing at it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from piper_nb.capture.annotate import cut_stages
from piper_nb.capture.batch import Batch
from piper_nb.directives.spec import REGISTRY
from piper_nb.errors import PlanError

__all__ = ["DesignerState", "SCHEDULES", "OPS", "set_tags", "cut", "add_row", "remove_row",
           "move_row", "update_row", "new_row", "schedule_row", "microbatches",
           "set_microbatches", "program_json", "import_json", "stage_count", "own_tags",
           "effective_tags", "load_plan"]

# label in the picker -> builder name of `pn.schedules.build`
SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved 1F1B": "interleaved_1f1b",
             "ZB1P": "zb1p", "DualPipeV": "dualpipev", "DualPipe": "dualpipe"}
OPS = tuple(REGISTRY)          # the directive ops, in the registry's order


@dataclass(frozen=True, eq=False)
class DesignerState:
    """What the Designer edits. `rows` are Piper JSON objects, possibly invalid."""

    model: Any                                   # the nn.Module being annotated
    batch: Batch | tuple | dict                  # as pn.Designer named it, or as a user has it
    annotations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    rows: tuple[Mapping[str, Any], ...] = ()
    cost: str = "uniform"                        # "uniform" | "analytic" | "profiled"
    collapse: str = "auto"                       # DAG drawing: "auto" | "none" | "MB"
    loss_fn: Any = None                          # (output, targets) -> loss; None: the model's

    def replace(self, **changes: Any) -> DesignerState:
        return dataclasses.replace(self, **changes)

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.model.named_modules() if p]


def _copy_rows(rows) -> tuple[dict, ...]:
    return tuple(json.loads(json.dumps(r)) if _jsonable(r) else dict(r) for r in rows)


def _jsonable(obj: Any) -> bool:
    try:
        json.dumps(obj)
        return True
    except (TypeError, ValueError):
        return False


# ---- layers ---------------------------------------------------------------------------
def set_tags(state: DesignerState, path: str, tags: Mapping[str, Any]) -> DesignerState:
    """Module `path` gets exactly these own tags (empty: its annotation is removed)."""
    ann = {p: dict(t) for p, t in state.annotations.items()}
    if tags:
        ann[path] = dict(tags)
    else:
        ann.pop(path, None)
    return state.replace(annotations=ann)


def own_tags(state: DesignerState, path: str) -> dict[str, Any]:
    """Tags the annotations give module `path` itself (patterns included, later wins)."""
    out: dict[str, Any] = {}
    for pattern, tags in state.annotations.items():
        if isinstance(tags, Mapping) and (pattern == path or fnmatch.fnmatchcase(path, pattern)):
            out.update(tags)
    return out


def effective_tags(state: DesignerState, path: str) -> dict[str, Any]:
    """Tags module `path` ends up with: its ancestors' own tags, extended by its own."""
    parts = path.split(".") if path else []
    out: dict[str, Any] = {}
    for i in range(1, len(parts) + 1):
        out.update(own_tags(state, ".".join(parts[:i])))
    return out


def cut(state: DesignerState, n: int, by: str = "params") -> DesignerState:
    """Drop every PP tag, then cut the model into `n` even stages (`pn.cut_stages`)."""
    proposal = cut_stages(state.model, n, by=by,
                          example=state.batch if by == "flops" else None)
    ann: dict[str, dict[str, Any]] = {}
    for p, tags in state.annotations.items():
        rest = {k: v for k, v in tags.items() if k != "PP"}
        if rest:
            ann[p] = rest
    for p, tags in proposal.items():
        ann.setdefault(p, {}).update(tags)
    return state.replace(annotations=ann)


def stage_count(state: DesignerState) -> int:
    """Distinct PP indices in the annotations (1 when there are none)."""
    stages = {t.get("PP") for t in state.annotations.values() if isinstance(t.get("PP"), int)}
    return max(len(stages), 1)


# ---- directive rows -------------------------------------------------------------------
def schedule_row(name: str, ranks: int, microbatches: int, chunks: int | None = None,
                 place: bool = False) -> dict[str, Any]:
    """A `{"op": "schedule", ...}` row for builder `name` (a picker label works too)."""
    name = SCHEDULES.get(name, name)
    row: dict[str, Any] = {"op": "schedule", "name": name, "ranks": ranks,
                           "microbatches": microbatches}
    if name == "interleaved_1f1b":
        row["chunks"] = chunks if chunks is not None else 2
    if place:
        row["place"] = True
    return row


def new_row(op: str, state: DesignerState) -> dict[str, Any]:
    """A sensible fresh row of kind `op` for this state (each directive's `row`)."""
    if op not in REGISTRY:
        raise PlanError(f"unknown op {op!r}; the ops are {', '.join(OPS)}")
    row = REGISTRY[op].row(stage_count(state), max(microbatches(state) or 4, 1))
    placed = _placed(state, row.get("filter"))
    if op == "replicate" and placed:   # the replicas are the devices the stage is placed on
        row["devices"] = placed
    return row


def _placed(state: DesignerState, filt) -> list[int] | None:
    """The devices the first place row with this filter names, else None."""
    for r in state.rows:
        if (isinstance(r, Mapping) and r.get("op") == "place" and r.get("filter") == filt
                and isinstance(r.get("devices"), list) and r["devices"]):
            return list(r["devices"])
    return None


def add_row(state: DesignerState, row: Mapping[str, Any], at: int | None = None) -> DesignerState:
    rows = list(_copy_rows(state.rows))
    rows.insert(len(rows) if at is None else at, dict(row))
    return state.replace(rows=tuple(rows))


def remove_row(state: DesignerState, i: int) -> DesignerState:
    rows = list(_copy_rows(state.rows))
    del rows[i]
    return state.replace(rows=tuple(rows))


def move_row(state: DesignerState, i: int, delta: int) -> DesignerState:
    """Row `i` moves by `delta` places (clamped to the list)."""
    rows = list(_copy_rows(state.rows))
    j = min(max(i + delta, 0), len(rows) - 1)
    rows.insert(j, rows.pop(i))
    return state.replace(rows=tuple(rows))


def update_row(state: DesignerState, i: int, fields: Mapping[str, Any],
               drop: tuple[str, ...] = ()) -> DesignerState:
    """Row `i` with `fields` set and the keys in `drop` removed."""
    rows = list(_copy_rows(state.rows))
    row = {k: v for k, v in rows[i].items() if k not in drop}
    row.update(fields)
    rows[i] = row
    return state.replace(rows=tuple(rows))


def microbatches(state: DesignerState) -> int | None:
    """The microbatch count the program asks for (first schedule or split row)."""
    for row in state.rows:
        if row.get("op") == "schedule" and isinstance(row.get("microbatches"), int):
            return row["microbatches"]
        if row.get("op") == "split" and isinstance(row.get("num_microbatches"), int):
            return row["num_microbatches"]
    return None


def set_microbatches(state: DesignerState, n: int) -> DesignerState:
    """Every schedule and MB split row asks for `n` microbatches."""
    rows = []
    for row in _copy_rows(state.rows):
        if row.get("op") == "schedule" and "microbatches" in row:
            row["microbatches"] = n
        elif row.get("op") == "split" and row.get("dim_name", "MB") == "MB":
            row["num_microbatches"] = n
        rows.append(row)
    return state.replace(rows=tuple(rows))


# ---- Piper JSON -----------------------------------------------------------------------
def program_json(state: DesignerState, expand: bool = False, indent: int | None = 1) -> str:
    """The program in Piper's JSON list format; `expand` writes schedule rows out as the
    split/order (and place) directives their builders produce, for Piper itself."""
    rows = _expanded(state.rows) if expand else list(state.rows)
    return json.dumps([r.to_json() if expand else r for r in rows], indent=indent)


def _expanded(rows) -> list:
    from piper_nb.compiler.compile import expand
    from piper_nb.directives.spec import Program
    return [d for _, d in expand(Program(rows))]


def load_plan(state: DesignerState, annotations: Mapping[str, Mapping[str, Any]],
              program) -> DesignerState:
    """A whole plan (a search's candidate: its stage cut and `pn.Program`) in place of the
    state's annotations and rows, as one edit."""
    return state.replace(annotations={p: dict(t) for p, t in annotations.items()},
                         rows=_copy_rows(d.to_json() for d in program))


def import_json(state: DesignerState, text: str) -> DesignerState:
    """Rows from Piper's JSON list; rows are kept even when invalid (they become Problems),
    but the text must be a JSON list of objects each with an `op`."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(f"the program is not valid JSON: {err}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "op" in r for r in rows):
        raise PlanError("a directive program is a JSON list of objects, each with an 'op'")
    return state.replace(rows=_copy_rows(rows))
