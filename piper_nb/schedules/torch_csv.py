"""PyTorch pipelining's schedule CSV: read it as Piper's directives, write grids and plans.

`torch.distributed.pipelining` keeps a schedule as one CSV row per pipeline rank, one cell
per step (`_PipelineScheduleRuntime._dump_csv` / `_load_csv`): `0F1` is stage 0's forward
of microbatch 1, `B` a full backward, `I` / `W` the backward for inputs / weights, an empty
cell an idle step, and `(0F3;3B1)OVERLAP_F_B` a forward and a backward run together. Its
`compute_comms` form adds `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`, `UNSHARD`, `RESHARD`
and `REDUCE_GRAD` cells. Reading keeps the compute cells and skips those: Piper derives its
own transfers, gathers and gradient reductions from the placement and the DAG. Cells keep
their column, so an error's "slot" is the CSV column (both rank and column count from 0).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_nb.directives.spec import Directive
from piper_nb.errors import PlanError
from piper_nb.ir.action import Action, Grid, Slot, parse_slot, slot_text
from piper_nb.ir.kinds import Op
from piper_nb.schedules.grid import as_grid, from_grid, validate_grid

__all__ = ["parse_torch_csv", "from_torch_csv", "grid_to_torch_csv", "plan_to_torch_csv"]

# torch's non-compute action types (`_ComputationType`): skipped on reading
_SKIPPED = re.compile(r"^\d+(?:UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)\d*$")
_HEAD = "torch schedule CSV (one line per rank, one column per step, both from 0)"


def _text(source: str | os.PathLike) -> str:
    return Path(source).read_text() if isinstance(source, os.PathLike) else source


def parse_torch_csv(source: str | os.PathLike) -> Grid:
    """The grid of a torch schedule CSV (its text, or a path as a `Path`): one row per rank,
    one slot per column (empty for idle and for skipped communication cells)."""
    text = _text(source)
    if not isinstance(text, str):
        raise PlanError(f"{_HEAD}: pass the CSV text or a pathlib.Path, got {type(text).__name__}")
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise PlanError(f"{_HEAD}: it is empty; write one line of actions per rank, e.g. 0F0,0B0")
    rows = []
    for r, cells in enumerate(csv.reader(lines)):
        rows.append(tuple(_cell(cell, r, c) for c, cell in enumerate(cells)))
    return tuple(rows)


def _cell(cell: str, rank: int, column: int) -> Slot:
    cell = cell.strip()
    if _SKIPPED.match(cell):
        return ()
    try:
        return parse_slot(cell)
    except PlanError as e:
        raise PlanError(f"{_HEAD}, rank {rank} (line {rank + 1}) column {column}: {e}; torch "
                        "writes compute cells as 0F1, 0B1, 0I1, 0W1 or (0F1;1B0)OVERLAP_F_B, and "
                        "SEND_F/RECV_F/SEND_B/RECV_B/UNSHARD/RESHARD/REDUCE_GRAD cells are "
                        "skipped") from None


def from_torch_csv(source: str | os.PathLike, microbatches: int | None = None,
                   place: bool = False) -> list[Directive]:
    """Directives for a schedule in torch pipelining's CSV (`_dump_csv`'s file, its text or
    a `Path`): the same `[place...] + split + order` as the equal text grid (`from_grid`).

    Only compute actions are read (F, B = torch's FULL_BACKWARD, I, W and OVERLAP_F_B
    pairs); communication and resharding cells (SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD,
    RESHARD, REDUCE_GRAD) are skipped, since piper_nb derives transfers, parameter gathers
    and gradient reductions itself. `microbatches` defaults to the largest index + 1; with
    `place=True` each stage goes to the rank running its forwards, as torch infers it.
    """
    grid = parse_torch_csv(source)
    try:
        return from_grid(grid, microbatches, place)
    except PlanError as e:
        raise PlanError(f"{_HEAD}: {e}") from None


def _slot_cell(slot: Slot) -> str:
    """A grid slot as torch writes it: empty when idle, an overlapped pair suffixed."""
    if not slot:
        return ""
    return slot_text(slot) + ("OVERLAP_F_B" if len(slot) > 1 else "")


def _write(rows: Sequence[Sequence[Slot]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([_slot_cell(s) for s in row])
    return out.getvalue()


def grid_to_torch_csv(grid: str | Sequence) -> str:
    """A valid grid (text or rows of slots) as torch's compute-only CSV, which
    `_PipelineScheduleRuntime._load_csv` reads: idle slots become empty cells."""
    grid = as_grid(grid)
    validate_grid(grid)
    return _write(grid)


def plan_to_torch_csv(plan: Any, devices: Sequence[int] | None = None) -> str:
    """One CSV row per device (all, or `devices` in that order) of a compiled plan's compute
    passes in execution order, as torch's `0F1` actions; the stage is the region's PP index.

    Regions of one stage collapse into one action; passes sharing an overlap slot are
    written `(a;b)OVERLAP_F_B`; updates, transfers and collectives are left out. Replicas
    (data or tensor parallel) each get their own row: give one pipeline's `devices` for a
    file torch's `_load_csv` accepts.
    """
    stage_of = {r.index: dict(r.tags).get("PP", 0) for r in plan.regions}
    chosen = range(len(plan.devices)) if devices is None else devices
    rows = []
    for d in chosen:
        row: list[list[Action]] = []
        seen: set[Action] = set()
        last_overlap = -1
        for ins in plan.devices[d].instrs:
            if ins.kind not in (Op.F, Op.B, Op.BI, Op.BW):
                continue
            a = Action(stage_of.get(ins.region, 0), ins.kind, max(ins.mb, 0))
            if a in seen:
                continue
            seen.add(a)
            if ins.overlap >= 0 and ins.overlap == last_overlap and row:
                row[-1].append(a)
            else:
                row.append([a])
            last_overlap = ins.overlap
        rows.append([tuple(s) for s in row])
    return _write(rows)
