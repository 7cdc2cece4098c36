"""ZB1P / ZB-H1: 1F1B with the backward split into I (inputs) and W (weights), the W's
deferred into the cool-down bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
schedule ZB-H1; PyTorch's `ScheduleInterleavedZeroBubble` with one stage per rank).

Stage s runs on rank s. Rank r runs min(PP-r-1, m) warm-up forwards, then F and I in
turn; its first r I's keep their W for later, every later I is followed by the oldest
waiting W, and the waiting W's close the row. Activation memory stays 1F1B's (PP-r
microbatches on rank r) and the bubble shrinks to (PP-1)(F+B-2W) with B = I + W.

Any microbatches >= 1 is accepted (PyTorch's form needs m to be a multiple of its round
size even with one stage per rank; the order here is valid for every m).
"""

from __future__ import annotations

from collections import deque

from piper_nb.directives.spec import Directive
from piper_nb.ir.action import Action, Grid, Slot
from piper_nb.schedules.grid import check_count, check_flag, grid_directives

__all__ = ["zero_bubble_grid", "zero_bubble"]


def _row(rank: int, ranks: int, microbatches: int) -> tuple[Slot, ...]:
    warmup = min(ranks - rank - 1, microbatches)
    waiting: deque[int] = deque()
    row: list[Slot] = [(Action(rank, "F", m),) for m in range(warmup)]

    def backward(k: int) -> None:
        row.append((Action(rank, "BI", k),))
        waiting.append(k)
        if k >= rank:  # the first `rank` W's wait for the cool-down
            row.append((Action(rank, "BW", waiting.popleft()),))

    for k in range(microbatches - warmup):
        row.append((Action(rank, "F", warmup + k),))
        backward(k)
    for k in range(microbatches - warmup, microbatches):
        backward(k)
    row += [(Action(rank, "BW", m),) for m in waiting]
    return tuple(row)


def zero_bubble_grid(ranks: int, microbatches: int) -> Grid:
    """Rank r's row of F, I and W actions for stage r."""
    check_count(ranks, "ranks", "zb1p")
    check_count(microbatches, "microbatches", "zb1p")
    return tuple(_row(r, ranks, microbatches) for r in range(ranks))


def zero_bubble(ranks: int, microbatches: int, place: bool = False) -> list[Directive]:
    """split + one order per rank (+ stage s on rank s when `place`)."""
    grid = zero_bubble_grid(ranks, microbatches)
    return grid_directives(grid, microbatches, check_flag(place, "place", "zb1p"), "zb1p")
