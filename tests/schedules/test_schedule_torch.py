"""Our grids against the orders torch.distributed.pipelining computes for its own schedules.

PyTorch builds each rank's `pipeline_order` from the group size and microbatch count only,
so its per-rank helpers run here on a stand-in `self`, without a process group. Idle
steps (None) and REDUCE_GRAD are left out; our grids order, they do not time.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from piper_nb.ir.action import grid_text, parse_grid
from piper_nb.schedules import (
    dualpipev_grid,
    gpipe_grid,
    interleaved_1f1b_grid,
    one_f_one_b_grid,
    zero_bubble_grid,
)

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


COMPUTE = re.compile(r"\d+[FBIW]\d+|\(.*\)OVERLAP_F_B")  # not REDUCE_GRAD, SEND_F, ...


def torch_text(rows) -> str:
    return grid_text(parse_grid("\n".join(
        " ".join(str(a) for a in row if a is not None and COMPUTE.fullmatch(str(a))) or "."
        for row in rows)))


def per_rank(cls, ranks: int, **attrs) -> str:
    me = SimpleNamespace(pp_group_size=ranks, **attrs)
    return torch_text(cls._calculate_single_rank_operations(me, r) for r in range(ranks))


@pytest.mark.parametrize("ranks, m, chunks", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (2, 6, 4),
                                              (4, 12, 2), (3, 6, 2)])
def test_interleaved_matches_schedule_interleaved_1f1b(ranks, m, chunks):
    ours = grid_text(interleaved_1f1b_grid(ranks, m, chunks))
    assert ours == per_rank(schedules.ScheduleInterleaved1F1B, ranks, _n_microbatches=m,
                            n_local_stages=chunks, microbatches_per_round=ranks)


@pytest.mark.parametrize("ranks, m", [(2, 4), (4, 8), (4, 4), (3, 7), (8, 16), (4, 2)])
def test_zb1p_matches_schedule_interleaved_zero_bubble_with_one_stage_per_rank(ranks, m):
    ours = grid_text(zero_bubble_grid(ranks, m))
    assert ours == per_rank(schedules.ScheduleInterleavedZeroBubble, ranks, _n_microbatches=m,
                            n_local_stages=1, microbatches_per_round=ranks)


@pytest.mark.parametrize("ranks, m", [(1, 2), (2, 4), (2, 7), (4, 8), (4, 10), (8, 16)])
def test_dualpipev_matches_schedule_dualpipev(ranks, m):
    ours = grid_text(dualpipev_grid(ranks, m))
    assert ours == per_rank(schedules.ScheduleDualPipeV, ranks, _n_microbatches=m)


@pytest.mark.parametrize("ranks, m", [(2, 4), (4, 8), (3, 5)])
def test_gpipe_and_1f1b_match_pytorch(ranks, m):
    me = SimpleNamespace(_num_stages=ranks, _n_microbatches=m)
    gpipe = schedules.ScheduleGPipe._get_pipeline_order(me)
    assert grid_text(gpipe_grid(ranks, m)) == torch_text(gpipe[r] for r in range(ranks))
    # Schedule1F1B's pipeline_order (a drawing aid there, not what it runs) numbers the last
    # rank's forwards from 1 (torch 2.13: `forward_mb` starts at 0 and is bumped first), so
    # the last rank is left out; our test_schedule_grids.py spells the textbook row out.
    f1b1 = schedules.Schedule1F1B._get_pipeline_order(me)
    ours = one_f_one_b_grid(ranks, m)[:-1]
    assert grid_text(ours) == torch_text(f1b1[r] for r in range(ranks - 1))
