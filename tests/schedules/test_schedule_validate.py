"""validate_grid: each (stage, microbatch) runs F, then B or I then W, once, on one rank;
errors name the rank and slot and print the grid with the slot marked."""

from __future__ import annotations

import pytest

from piper_nb.errors import PlanError
from piper_nb.ir.action import Action, parse_grid
from piper_nb.schedules import (
    dualpipe_grid,
    dualpipev_grid,
    gpipe_grid,
    interleaved_1f1b_grid,
    one_f_one_b_grid,
    validate_grid,
    zero_bubble_grid,
)


@pytest.mark.parametrize("grid", [
    gpipe_grid(1, 1), gpipe_grid(3, 5), one_f_one_b_grid(4, 8), one_f_one_b_grid(5, 2),
    interleaved_1f1b_grid(4, 8, 3), zero_bubble_grid(4, 8), zero_bubble_grid(5, 3),
    dualpipev_grid(1, 2), dualpipev_grid(4, 11), dualpipe_grid(2, 4), dualpipe_grid(8, 20),
])
def test_every_builder_grid_is_valid(grid):
    validate_grid(grid)


@pytest.mark.parametrize("text, message", [
    ("0F0 0B0 0F0 0B1", r"rank 0 slot 2: 0F0 appears twice \(first at rank 0 slot 0\)"),
    ("0F0 0F1 0B0", r"rank 0 slot 1: 0F1 has no backward; add 0B1"),
    ("0B0 0F0", r"rank 0 slot 0: 0B0 comes before 0F0 \(slot 1\)"),
    ("0F0 0B0 0W0", r"rank 0 slot 1: 0B0 is a full backward, and 0I0/0W0 split it too"),
    ("0F0 0I0", r"rank 0 slot 1: 0I0 needs its 0W0"),
    ("0F0 0W0 0I0", r"rank 0 slot 1: 0W0 comes before 0I0 \(slot 2\)"),
    ("0B0", r"stage 0 microbatch 0 has a backward but no forward; add 0F0"),
    ("0F0 (0F1;0B1) 0B0", r"rank 0 slot 1: an overlapped slot holds two passes"),
    ("0F0\n1F0 1B0 0B0", r"rank 1 slot 2: 0B0 runs on rank 1 but 0F0 on rank 0"),
    ("0F0 0B0 0F2 0B2", r"stage 0 never runs microbatch 1"),
    ("1F0 1B0", r"stage 0 never runs microbatch 0"),
])
def test_bad_grids_point_at_rank_and_slot(text, message):
    with pytest.raises(PlanError, match=message):
        validate_grid(parse_grid(text))


def test_the_error_prints_the_grid_with_the_slot_marked():
    with pytest.raises(PlanError) as err:
        validate_grid(parse_grid("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1F1"))
    assert "  rank 0: 0F0 0F1 0B0 0B1\n  rank 1: 1F0 1B0 1F1 >>1F1<<" in str(err.value)


def test_a_rank_without_work_is_refused():
    grid = (((Action(0, "F", 0),), (Action(0, "B", 0),)), ())
    with pytest.raises(PlanError, match="rank 1 has no actions"):
        validate_grid(grid)


def test_idle_slots_are_allowed():
    validate_grid((((Action(0, "F", 0),), (), (Action(0, "B", 0),)),))
