"""Schedule actions in PyTorch pipelining's compact text form: `{stage}{pass}{microbatch}`.

`0F1` is the forward of stage 0 on microbatch 1; passes are F (forward), B (full
backward), I (backward for inputs, our BI) and W (backward for weights, our BW). A slot
holding several actions that may overlap is written `(1F1;2B0)`, and PyTorch's suffix
`OVERLAP_F_B` is accepted. A `Grid` is one row of slots per rank; its text form is one line
per rank, slots separated by spaces, `.` for an idle slot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import LETTER, PASS_OF_LETTER

__all__ = ["Action", "Slot", "Grid", "parse_action", "parse_slot", "parse_grid", "grid_text",
           "slot_text", "PASS_OF_LETTER", "LETTER_OF_PASS"]

LETTER_OF_PASS = {k.value: v for k, v in LETTER.items()}
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One pass of one stage on one microbatch."""

    stage: int
    pass_: str  # F | B | BI | BW
    mb: int

    def __post_init__(self):
        if self.pass_ not in LETTER_OF_PASS:
            raise PlanError(f"action pass must be one of F, B, BI, BW, got {self.pass_!r}")
        if self.stage < 0 or self.mb < 0:
            raise PlanError(f"action stage and microbatch must be >= 0, got {self.stage}, {self.mb}")

    def __str__(self) -> str:
        return f"{self.stage}{LETTER_OF_PASS[self.pass_]}{self.mb}"

    def filter(self) -> dict:
        """The directive filter that selects this action's DAG node."""
        return {"PP": self.stage, "MB": self.mb, "PASS": self.pass_}


Slot = tuple[Action, ...]
Grid = tuple[tuple[Slot, ...], ...]


def parse_action(text: str) -> Action:
    m = _ACTION.match(text.strip())
    if not m:
        raise PlanError(f"cannot read schedule action {text!r}: write {{stage}}{{F|B|I|W}}{{microbatch}}, "
                        "e.g. 0F1 or 2I0")
    return Action(int(m.group(1)), PASS_OF_LETTER[m.group(2)], int(m.group(3)))


def parse_slot(text: str) -> Slot:
    text = text.strip()
    if text in (".", "_", ""):
        return ()
    if text.startswith("("):
        body = text.removesuffix("OVERLAP_F_B")
        if not body.endswith(")"):
            raise PlanError(f"cannot read overlapped slot {text!r}: write (1F1;2B0)")
        parts = [p for p in body[1:-1].split(";") if p.strip()]
        if len(parts) < 2:
            raise PlanError(f"overlapped slot {text!r} needs at least two actions, e.g. (1F1;2B0)")
        return tuple(parse_action(p) for p in parts)
    return (parse_action(text),)


def slot_text(slot: Slot) -> str:
    if not slot:
        return "."
    if len(slot) == 1:
        return str(slot[0])
    return "(" + ";".join(str(a) for a in slot) + ")"


def parse_grid(text: str) -> Grid:
    """One line per rank (blank lines and `#` comments ignored; an optional `rank N:` prefix)."""
    rows = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        line = re.sub(r"^(rank\s*)?\d+\s*:", "", line).strip()
        # keep overlapped slots whole even if written with spaces inside the parentheses
        tokens = re.findall(r"\([^)]*\)(?:OVERLAP_F_B)?|[^\s,]+", line)
        rows.append(tuple(s for s in (parse_slot(t) for t in tokens) if s))
    if not rows:
        raise PlanError("the schedule grid is empty: write one line of actions per rank")
    return tuple(rows)


def grid_text(grid: Grid) -> str:
    return "\n".join(" ".join(slot_text(s) for s in row) for row in grid)
