"""DualPipe and DualPipeV: bidirectional pipelines that overlap one chunk's forward with
another's backward (DeepSeek-V3 report, arXiv 2412.19437; public repository
deepseek-ai/DualPipe, `dualpipe/dualpipe.py` and `dualpipe/dualpipev.py`; PyTorch's
`ScheduleDualPipeV` follows the same code).

Each rank holds two stages, its "stage 0" and "stage 1", and runs eight phases (n ranks
per direction, r the rank's position, C chunks through each of its stages; `(x; y)` is one
overlapped slot):
  1. 2(n-r-1) times: F stage 0
  2. r+1 times: F stage 0, F stage 1
  3. n-r-1 times: I stage 1, its W, F stage 1
  4. C-2n+r+1 times: (F stage 0; B stage 1), (F stage 1; B stage 0); at r = n-1 the first
     pair runs as two slots, F then B
  5. n-r-1 times: B stage 1, (F stage 1; B stage 0)
  6. r+1 times: B stage 1, B stage 0; the later half of these are I only, their W's queued
     first in, first out (DeepSeek's `enable_zb` and `WeightGradStore`)
  7. n-r-1 times: the oldest queued W, then I stage 0 (its W queued)
  8. r+1 times: the oldest queued W

DualPipeV: N ranks, 2N stages, rank r holds stages r and 2N-1-r, every microbatch passes
both (n = N, C = microbatches). Full DualPipe: PP ranks and PP stages, microbatches
0..C/2-1 enter at rank 0 (stage s on rank s), C/2..C-1 at rank PP-1 (stage s on rank
PP-1-s); rank r runs the phases with n = PP/2 and r replaced by min(r, PP-1-r), its stage 0
being the direction it is nearer the start of (C = microbatches/2 per direction).
With F=W=B/2 both have bubble (PP/2-1)(F&B+B-3W), PP the stage count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from piper_nb.directives.spec import Directive
from piper_nb.errors import PlanError
from piper_nb.ir.action import Action, Grid, Slot
from piper_nb.schedules.grid import check_count, check_flag, grid_directives

__all__ = ["dualpipev_grid", "dualpipe_grid", "dualpipev", "dualpipe"]

# (local stage 0|1, chunk index) -> Action's (stage, microbatch)
Locate = Callable[[int, int], tuple[int, int]]


def _row(n: int, r: int, chunks: int, locate: Locate) -> tuple[Slot, ...]:
    """The eight phases of one rank; `n` ranks per direction, `r` the rank's position."""
    nf, nb = [0, 0], [0, 0]  # next chunk to run forward / backward, per local stage
    queued: deque[tuple[int, int]] = deque()  # I's whose W waits, oldest first

    def act(local: int, chunk: int, pass_: str) -> Action:
        stage, mb = locate(local, chunk)
        return Action(stage, pass_, mb)

    def f(local: int) -> Action:
        nf[local] += 1
        return act(local, nf[local] - 1, "F")

    def b(local: int, zb: bool = False) -> Action:
        nb[local] += 1
        if zb:
            queued.append((local, nb[local] - 1))
        return act(local, nb[local] - 1, "BI" if zb else "B")

    def w() -> Action:
        return act(*queued.popleft(), "BW")

    row: list[Slot] = []
    row += [(f(0),) for _ in range(2 * (n - r - 1))]                      # 1
    for _ in range(r + 1):                                                 # 2
        row += [(f(0),), (f(1),)]
    for _ in range(n - r - 1):                                             # 3
        row += [(b(1, zb=True),), (w(),), (f(1),)]
    for i in range(chunks - 2 * n + r + 1):                                # 4
        if i == 0 and r == n - 1:
            row += [(f(0),), (b(1),)]
        else:
            row.append((f(0), b(1)))
        row.append((f(1), b(0)))
    for _ in range(n - r - 1):                                             # 5
        row += [(b(1),), (f(1), b(0))]
    zb = False
    for i in range(r + 1):                                                 # 6
        zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
        row.append((b(1, zb),))
        zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
        row.append((b(0, zb),))
    for _ in range(n - r - 1):                                             # 7
        row += [(w(),), (b(0, zb=True),)]
    row += [(w(),) for _ in range(r + 1)]                                  # 8
    return tuple(row)


def dualpipev_grid(ranks: int, microbatches: int) -> Grid:
    """N = ranks, 2N stages; rank r's stage 0 is stage r, its stage 1 stage 2N-1-r."""
    check_count(ranks, "ranks", "dualpipev")
    check_count(microbatches, "microbatches", "dualpipev")
    if microbatches < 2 * ranks:
        raise PlanError(f"schedule 'dualpipev': microbatches ({microbatches}) must be at least "
                        f"2 * ranks = {2 * ranks}; use microbatches={2 * ranks} or more")

    def rank_row(r: int) -> tuple[Slot, ...]:
        stages = (r, 2 * ranks - 1 - r)
        return _row(ranks, r, microbatches, lambda local, k: (stages[local], k))

    return tuple(rank_row(r) for r in range(ranks))


def dualpipe_grid(ranks: int, microbatches: int) -> Grid:
    """PP = ranks stages; microbatches 0..C/2-1 run stage s on rank s, C/2..C-1 on PP-1-s."""
    check_count(ranks, "ranks", "dualpipe")
    check_count(microbatches, "microbatches", "dualpipe")
    if ranks % 2:
        raise PlanError(f"schedule 'dualpipe': ranks ({ranks}) must be even, half the chunks "
                        f"enter at each end; use an even count such as {ranks + 1}, or dualpipev")
    if microbatches % 2 or microbatches < 2 * ranks:
        raise PlanError(f"schedule 'dualpipe': microbatches ({microbatches}) must be even and at "
                        f"least 2 * ranks = {2 * ranks}; use microbatches="
                        f"{max(2 * ranks, microbatches + microbatches % 2)}")
    half = microbatches // 2

    def rank_row(r: int) -> tuple[Slot, ...]:
        # direction 0: stage r, microbatch k; direction 1: stage PP-1-r, microbatch half+k
        dirs = ((r, 0), (ranks - 1 - r, half))
        if r >= ranks // 2:  # nearer the start of direction 1, which is then its stage 0
            dirs = dirs[::-1]
        return _row(ranks // 2, min(r, ranks - 1 - r), half,
                    lambda local, k: (dirs[local][0], dirs[local][1] + k))

    return tuple(rank_row(r) for r in range(ranks))


def dualpipev(ranks: int, microbatches: int, place: bool = False) -> list[Directive]:
    """split + one order per rank (+ stages r and 2N-1-r on rank r when `place`)."""
    grid = dualpipev_grid(ranks, microbatches)
    return grid_directives(grid, microbatches, check_flag(place, "place", "dualpipev"), "dualpipev")


def dualpipe(ranks: int, microbatches: int, place: bool = False) -> list[Directive]:
    """split + one order per rank (+ per (stage, microbatch) places when `place`: each stage
    has a copy on ranks s and PP-1-s; the compiler sums the two copies' gradients)."""
    grid = dualpipe_grid(ranks, microbatches)
    return grid_directives(grid, microbatches, check_flag(place, "place", "dualpipe"), "dualpipe")
