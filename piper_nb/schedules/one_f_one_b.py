"""1F1B (PipeDream-flush): warm-up forwards, then one forward and one backward in turn,
then the remaining backwards (Narayanan et al. 2021, Megatron-LM's
`forward_backward_pipelining_without_interleaving`; PyTorch's `Schedule1F1B`).

Stage s runs on rank s. Rank r runs min(PP-r-1, m) warm-up forwards, so it holds at most
PP-r microbatches of activations; the bubble is (PP-1)(F+B).

Any microbatches >= 1 is accepted. PyTorch's `Schedule1F1B` refuses m < PP, but the order
stays correct then: warm-up is capped at m and the pipeline simply never fills.
"""

from __future__ import annotations

from piper_nb.directives.spec import Directive
from piper_nb.ir.action import Action, Grid, Slot
from piper_nb.schedules.grid import check_count, check_flag, grid_directives

__all__ = ["one_f_one_b_grid", "one_f_one_b"]


def _row(rank: int, ranks: int, microbatches: int) -> tuple[Slot, ...]:
    warmup = min(ranks - rank - 1, microbatches)
    row: list[Slot] = [(Action(rank, "F", m),) for m in range(warmup)]
    for i in range(microbatches - warmup):
        row += [(Action(rank, "F", warmup + i),), (Action(rank, "B", i),)]
    row += [(Action(rank, "B", m),) for m in range(microbatches - warmup, microbatches)]
    return tuple(row)


def one_f_one_b_grid(ranks: int, microbatches: int) -> Grid:
    """Rank 0 of 4 with 8 microbatches: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 ... 0F7 0B4 0B5 0B6 0B7."""
    check_count(ranks, "ranks", "1f1b")
    check_count(microbatches, "microbatches", "1f1b")
    return tuple(_row(r, ranks, microbatches) for r in range(ranks))


def one_f_one_b(ranks: int, microbatches: int, place: bool = False) -> list[Directive]:
    """split + one order per rank (+ stage s on rank s when `place`)."""
    grid = one_f_one_b_grid(ranks, microbatches)
    return grid_directives(grid, microbatches, check_flag(place, "place", "1f1b"), "1f1b")
