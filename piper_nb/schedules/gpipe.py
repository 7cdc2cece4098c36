"""GPipe: every forward, then every backward (Huang et al. 2019, "GPipe"; PyTorch's
`ScheduleGPipe`).

Stage s runs on rank s. Each rank keeps all `microbatches` activations alive until its
backwards start; the bubble is (PP-1)(F+B), the same as 1F1B's, at higher memory.
"""

from __future__ import annotations

from piper_nb.directives.spec import Directive
from piper_nb.ir.action import Action, Grid
from piper_nb.schedules.grid import check_count, check_flag, grid_directives

__all__ = ["gpipe_grid", "gpipe"]


def gpipe_grid(ranks: int, microbatches: int) -> Grid:
    """Rank r: rF0 rF1 ... rF(m-1) rB0 rB1 ... rB(m-1)."""
    check_count(ranks, "ranks", "gpipe")
    check_count(microbatches, "microbatches", "gpipe")
    return tuple(
        tuple((Action(r, "F", m),) for m in range(microbatches))
        + tuple((Action(r, "B", m),) for m in range(microbatches))
        for r in range(ranks))


def gpipe(ranks: int, microbatches: int, place: bool = False) -> list[Directive]:
    """split + one order per rank (+ stage s on rank s when `place`)."""
    grid = gpipe_grid(ranks, microbatches)
    return grid_directives(grid, microbatches, check_flag(place, "place", "gpipe"), "gpipe")
