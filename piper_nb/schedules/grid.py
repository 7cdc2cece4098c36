"""Per-rank schedule grids: validation and lowering to Piper's `split` + `order` directives.

A grid holds, for each rank, the slots it runs in order (PyTorch pipelining's
`pipeline_order`, one row per rank, in its `0F1` text form). Piper says the same thing as
one `order` directive per rank whose slots are filters `{"PP", "MB", "PASS"}`, after a
`split` into microbatches (Piper, arXiv 2606.11169, section on the directive program). The
placement a grid implies (each stage, or each stage and microbatch, on the rank that runs
its forward) is read from the grid itself, so a builder's layout has one source of truth.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise

from piper_nb.directives.order import Order
from piper_nb.directives.schedule import FUNCTIONS
from piper_nb.directives.spec import Directive, place, split
from piper_nb.errors import PlanError
from piper_nb.ir.action import Action, Grid, parse_grid, slot_text
from piper_nb.ir.kinds import PASS_ORDER, Op

__all__ = ["validate_grid", "from_grid", "grid_directives", "place_directives", "as_grid",
           "check_count", "check_flag"]


def check_count(value: object, name: str, builder: str, minimum: int = 1) -> int:
    """`value` as an integer >= minimum, or a PlanError naming the builder and argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"schedule {builder!r}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"schedule {builder!r}: {name} must be at least {minimum}, got {value}")
    return value


def check_flag(value: object, name: str, builder: str) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"schedule {builder!r}: {name} must be true or false, got {value!r}")
    return value


def as_grid(grid: str | Sequence) -> Grid:
    """A Grid from its text form or from nested sequences of Actions (copied, never mutated)."""
    if isinstance(grid, str):
        return parse_grid(grid)
    if not isinstance(grid, Sequence):
        raise PlanError(f"a schedule grid is text or a list of rows, got {type(grid).__name__}")
    rows = []
    for r, row in enumerate(grid):
        if not isinstance(row, Sequence) or isinstance(row, str):
            raise PlanError(f"schedule grid rank {r}: a row is a list of slots, got {row!r}")
        slots = []
        for i, slot in enumerate(row):
            slot = (slot,) if isinstance(slot, Action) else slot
            if not isinstance(slot, Sequence) or not all(isinstance(a, Action) for a in slot):
                raise PlanError(f"schedule grid rank {r} slot {i}: a slot is a tuple of Actions, "
                                f"got {slot!r}")
            slots.append(tuple(slot))
        rows.append(tuple(slots))
    return tuple(rows)


def _render(grid: Grid, mark: tuple[int, int] | None) -> str:
    lines = []
    for r, row in enumerate(grid):
        cells = [f">>{slot_text(s)}<<" if (r, i) == mark else slot_text(s)
                 for i, s in enumerate(row)]
        lines.append(f"  rank {r}: " + " ".join(cells))
    return "\n".join(lines)


def _fail(grid: Grid, where: tuple[int, int] | None, message: str) -> PlanError:
    head = f"schedule grid, rank {where[0]} slot {where[1]}: " if where else "schedule grid: "
    return PlanError(f"{head}{message}\n{_render(grid, where)}")


def validate_grid(grid: Grid) -> None:
    """Raise PlanError unless every (stage, microbatch) runs F, then B (or I then W), once each.

    Stages 0..S-1 and microbatches 0..M-1 must all appear, and a microbatch's backward
    passes run on the rank row that ran its forward, in later slots. Cross-rank deadlock
    is the compiler's check, not this one's.
    """
    if not grid:
        raise PlanError("schedule grid: it has no ranks; write one row of actions per rank")
    where: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(grid):
        if not any(row):
            raise _fail(grid, None, f"rank {r} has no actions; give it work or drop its row")
        for i, slot in enumerate(row):
            keys = [(a.stage, a.mb) for a in slot]
            if len(set(keys)) != len(keys):
                raise _fail(grid, (r, i), "an overlapped slot holds two passes of one stage and "
                                          "microbatch; put the later pass in a later slot")
            for a in slot:
                if a in where:
                    raise _fail(grid, (r, i), f"{a} appears twice (first at rank {where[a][0]} "
                                              f"slot {where[a][1]}); keep one")
                where[a] = (r, i)
    by_key: dict[tuple[int, int], dict[str, Action]] = defaultdict(dict)
    for a in where:
        by_key[(a.stage, a.mb)][a.pass_] = a
    for (s, m), passes in sorted(by_key.items()):
        _check_passes(grid, s, m, passes, where)
    stages = 1 + max(s for s, _ in by_key)
    mbs = 1 + max(m for _, m in by_key)
    for s in range(stages):
        for m in range(mbs):
            if (s, m) not in by_key:
                raise _fail(grid, None, f"stage {s} never runs microbatch {m} (stages "
                                        f"0..{stages - 1} and microbatches 0..{mbs - 1} appear); "
                                        f"add {s}F{m} and its backward, every microbatch passes "
                                        "every stage")


def _check_passes(grid: Grid, s: int, m: int, passes: dict[str, Action],
                  where: dict[Action, tuple[int, int]]) -> None:
    first = where[min(passes.values(), key=lambda a: where[a])]
    if Op.F not in passes:
        raise _fail(grid, first, f"stage {s} microbatch {m} has a backward but no forward; "
                                 f"add {s}F{m} before it")
    f_at = where[passes["F"]]
    if Op.B in passes and (Op.BI in passes or Op.BW in passes):
        raise _fail(grid, where[passes["B"]], f"{s}B{m} is a full backward, and {s}I{m}/{s}W{m} "
                                              "split it too; use either B or I and W")
    if Op.B not in passes and Op.BI not in passes:
        raise _fail(grid, f_at, f"{s}F{m} has no backward; add {s}B{m} (or {s}I{m} and {s}W{m})")
    if (Op.BI in passes) != (Op.BW in passes):
        have, need = ("I", "W") if Op.BI in passes else ("W", "I")
        raise _fail(grid, where[passes["BI" if have == "I" else "BW"]],
                    f"{s}{have}{m} needs its {s}{need}{m}; I and W come in pairs")
    chain = [passes[p] for p in PASS_ORDER if p in passes]
    for before, after in pairwise(chain):
        (rb, ib), (ra, ia) = where[before], where[after]
        if ra != rb:
            raise _fail(grid, (ra, ia), f"{after} runs on rank {ra} but {before} on rank {rb}; a "
                                        "microbatch's backward passes run where its forward ran")
        if ia <= ib:
            raise _fail(grid, (ra, ia), f"{after} comes before {before} (slot {ib}) on rank {ra}; "
                                        f"move it after")


def place_directives(grid: Grid) -> list[Directive]:
    """`place` per stage on the rank running its forwards; per (stage, microbatch) when a
    stage's forwards run on several ranks (full DualPipe's two copies of each stage)."""
    ranks: dict[int, dict[int, int]] = defaultdict(dict)  # stage -> mb -> rank
    for r, row in enumerate(grid):
        for slot in row:
            for a in slot:
                if a.pass_ == Op.F:
                    ranks[a.stage][a.mb] = r
    out: list[Directive] = []
    for s in sorted(ranks):
        holders = set(ranks[s].values())
        if len(holders) == 1:
            out.append(place({"PP": s}, [holders.pop()]))
        else:
            out.extend(place({"PP": s, "MB": m}, [r]) for m, r in sorted(ranks[s].items()))
    return out


_TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B",
           "zb1p": "ZB1P", "dualpipev": "DualPipeV", "dualpipe": "DualPipe"}


def schedule_label(name: str) -> str:
    """How messages name the schedule a builder (or a grid) wrote."""
    if name in _TITLES:
        return f"the {_TITLES[name]} schedule (pn.schedules.{FUNCTIONS[name]})"
    return "the schedule grid (pn.schedules.from_grid)"


def grid_directives(grid: Grid, microbatches: int, place: bool = False,
                    schedule: str = "grid") -> list[Directive]:
    """[place...] + split into `microbatches` + one `order` per rank (idle slots dropped);
    each order remembers the `schedule` (builder name) that wrote it, for messages."""
    out = place_directives(grid) if place else []
    out.append(split({}, "MB", microbatches))
    label = schedule_label(schedule)
    for row in grid:
        out.append(Order([[a.filter() for a in slot] for slot in row if slot], label))
    return out


def from_grid(text_or_grid: str | Sequence, microbatches: int | None = None,
              place: bool = False) -> list[Directive]:
    """Directives for a hand-written grid; microbatches default to the largest index + 1."""
    grid = as_grid(text_or_grid)
    validate_grid(grid)
    used = 1 + max(a.mb for row in grid for slot in row for a in slot)
    if microbatches is None:
        microbatches = used
    check_count(microbatches, "microbatches", "grid")
    if microbatches != used:
        raise PlanError(f"schedule 'grid': microbatches={microbatches} but the grid runs "
                        f"microbatches 0..{used - 1}; pass microbatches={used} or leave it out")
    return grid_directives(grid, microbatches, check_flag(place, "place", "grid"), "grid")
