"""Every builder's grid, run in unit time: it never deadlocks and its bubble is the
published one (REFERENCES.md: DualPipe's table, Megatron-LM, the zero-bubble paper).

Costs F=1, B=2, I=1, W=1; an overlapped (F;B) slot takes 3 (F&B, no speed-up from the
overlap). Bubble = makespan minus the busiest rank's work.
"""

from __future__ import annotations

import pytest

from piper_nb.ir.action import Action, Grid
from piper_nb.schedules import (
    dualpipe_grid,
    dualpipev_grid,
    gpipe_grid,
    interleaved_1f1b_grid,
    one_f_one_b_grid,
    zero_bubble_grid,
)

COST = {"F": 1, "B": 2, "BI": 1, "BW": 1}


def run(grid: Grid) -> tuple[int, int]:
    """(makespan, bubble) with every rank running its row in order, each slot starting as
    soon as the rank is free and the slot's inputs are done."""
    last = max(a.stage for row in grid for slot in row for a in slot)
    bwd = {(a.stage, a.mb): a.pass_ for row in grid for slot in row for a in slot
           if a.pass_ in ("B", "BI")}

    def needs(a: Action) -> list[tuple[int, str, int]]:
        if a.pass_ == "F":
            return [(a.stage - 1, "F", a.mb)] if a.stage else []
        if a.pass_ == "BW":
            return [(a.stage, "BI", a.mb)]
        own = [(a.stage, "F", a.mb)]
        return own if a.stage == last else own + [(a.stage + 1, bwd[a.stage + 1, a.mb], a.mb)]

    done: dict[tuple[int, str, int], int] = {}
    clock, pos = [0] * len(grid), [0] * len(grid)
    while any(p < len(row) for p, row in zip(pos, grid, strict=True)):
        moved = False
        for r, row in enumerate(grid):
            while pos[r] < len(row):
                deps = [d for a in row[pos[r]] for d in needs(a)]
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps])
                clock[r] += sum(COST[a.pass_] for a in row[pos[r]])
                done.update(((a.stage, a.pass_, a.mb), clock[r]) for a in row[pos[r]])
                pos[r] += 1
                moved = True
        assert moved, f"deadlock: ranks stuck at slots {pos}"
    work = max(sum(COST[a.pass_] for slot in row for a in slot) for row in grid)
    return max(clock), max(clock) - work


@pytest.mark.parametrize("pp, m", [(1, 3), (2, 4), (3, 7), (4, 8), (4, 4), (8, 16), (8, 9)])
def test_1f1b_and_gpipe_bubble_is_pp_minus_1_times_f_plus_b(pp, m):
    assert run(one_f_one_b_grid(pp, m)) == (3 * m + 3 * (pp - 1), 3 * (pp - 1))
    assert run(gpipe_grid(pp, m)) == (3 * m + 3 * (pp - 1), 3 * (pp - 1))


@pytest.mark.parametrize("pp, m", [(1, 3), (2, 4), (3, 7), (4, 8), (4, 4), (8, 16), (8, 9)])
def test_zb1p_bubble_is_pp_minus_1_times_f_plus_b_minus_2w(pp, m):
    f, b, w = 1, 2, 1
    assert run(zero_bubble_grid(pp, m))[1] == (pp - 1) * (f + b - 2 * w)


@pytest.mark.parametrize("pp, m", [(4, 2), (4, 1), (3, 2)])
def test_short_1f1b_and_zb1p_still_run(pp, m):
    assert run(one_f_one_b_grid(pp, m))[0] == 3 * m + 3 * (pp - 1)
    run(zero_bubble_grid(pp, m))


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 2), (2, 6, 4),
                                      (4, 16, 2), (3, 9, 2)])
def test_interleaved_bubble_is_1f1b_bubble_in_chunk_units(pp, m, v):
    # a chunk's F is 1/v of a rank's forward: (p-1)(F+B)/v of full-rank time, Megatron-LM
    assert run(interleaved_1f1b_grid(pp, m, v)) == (3 * v * m + 3 * (pp - 1), 3 * (pp - 1))


@pytest.mark.parametrize("n, bubble", [(1, 0), (2, 2), (3, 4), (4, 6), (8, 14)])
def test_dualpipev_bubble_is_half_pp_minus_1_times_fb_plus_b_minus_3w(n, bubble):
    fb, b, w = 3, 2, 1
    assert (n - 1) * (fb + b - 3 * w) == bubble  # PP = 2N stages
    for chunks in (2 * n, 2 * n + 1, 2 * n + 6):  # the bubble does not depend on chunks
        assert run(dualpipev_grid(n, chunks)) == (6 * chunks + bubble, bubble)


@pytest.mark.parametrize("pp, bubble", [(2, 0), (4, 2), (6, 4), (8, 6)])
def test_dualpipe_bubble_is_half_pp_minus_1_times_fb_plus_b_minus_3w(pp, bubble):
    for chunks in (2 * pp, 2 * pp + 2, 2 * pp + 8):
        assert run(dualpipe_grid(pp, chunks)) == (3 * chunks + bubble, bubble)


def test_dualpipev_4_ranks_10_chunks_and_dualpipe_8_ranks_20_chunks_take_66():
    assert run(dualpipev_grid(4, 10)) == (66, 6)
    assert run(dualpipe_grid(8, 20)) == (66, 6)


def test_a_deadlocked_grid_is_caught():
    crossed = (((Action(0, "F", 0),), (Action(0, "B", 0),)),
               ((Action(1, "B", 0),), (Action(1, "F", 0),)))
    with pytest.raises(AssertionError, match="deadlock"):
        run(crossed)
