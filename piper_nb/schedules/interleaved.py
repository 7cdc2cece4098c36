"""Interleaved 1F1B with `chunks` model chunks per rank (Narayanan et al. 2021, Megatron-LM's
`forward_backward_pipelining_with_interleaving`; PyTorch's `ScheduleInterleaved1F1B`).

Stages = ranks * chunks, stage s on rank s % ranks. A rank's forwards go through its chunks
in groups of `ranks` microbatches (depth first); the backwards go through the chunks in
reverse. Rank r runs min((chunks-1)*ranks + 2*(ranks-r-1), chunks*m) warm-up forwards,
then one forward and one backward in turn, then the rest of the backwards. With per-chunk
times the bubble is (PP-1)(F+B) chunk-units, 1/chunks of 1F1B's.

Megatron's form is kept: microbatches must be a multiple of ranks (PyTorch also accepts
some other counts by resizing its groups). With chunks=1 this is plain 1F1B, as Megatron
does; PyTorch's interleaved schedule would warm up twice as deep.
"""

from __future__ import annotations

from collections import defaultdict

from piper_nb.directives.spec import Directive
from piper_nb.errors import PlanError
from piper_nb.ir.action import Action, Grid, Slot
from piper_nb.ir.kinds import Op
from piper_nb.schedules.grid import check_count, check_flag, grid_directives
from piper_nb.schedules.one_f_one_b import one_f_one_b_grid

__all__ = ["interleaved_1f1b_grid", "interleaved_1f1b"]


def _row(rank: int, ranks: int, microbatches: int, chunks: int) -> tuple[Slot, ...]:
    total = chunks * microbatches
    warmup = min((chunks - 1) * ranks + 2 * (ranks - rank - 1), total)
    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def act(pass_: str, k: int) -> Slot:
        chunk = (k // ranks) % chunks
        stage = (chunk if pass_ == Op.F else chunks - 1 - chunk) * ranks + rank
        mb = next_mb[pass_, stage]
        next_mb[pass_, stage] += 1
        return (Action(stage, pass_, mb),)

    row = [act("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        row += [act("F", warmup + k), act("B", k)]
    row += [act("B", k) for k in range(total - warmup, total)]
    return tuple(row)


def interleaved_1f1b_grid(ranks: int, microbatches: int, chunks: int) -> Grid:
    """Rank r's row over stages r, r+ranks, ..., r+(chunks-1)*ranks."""
    check_count(ranks, "ranks", "interleaved_1f1b")
    check_count(microbatches, "microbatches", "interleaved_1f1b")
    check_count(chunks, "chunks", "interleaved_1f1b")
    if chunks == 1:
        return one_f_one_b_grid(ranks, microbatches)
    if microbatches % ranks:
        lo = microbatches // ranks * ranks
        hint = f"{lo} or {lo + ranks}" if lo else f"{ranks}"
        raise PlanError(f"schedule 'interleaved_1f1b': microbatches ({microbatches}) must be a "
                        f"multiple of ranks ({ranks}); use {hint}")
    return tuple(_row(r, ranks, microbatches, chunks) for r in range(ranks))


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int,
                     place: bool = False) -> list[Directive]:
    """split + one order per rank (+ stage s on rank s % ranks when `place`)."""
    grid = interleaved_1f1b_grid(ranks, microbatches, chunks)
    return grid_directives(grid, microbatches, check_flag(place, "place", "interleaved_1f1b"),
                           "interleaved_1f1b")
