# ruff: noqa: E501  (expected grids are written one rank per line, as PyTorch prints them)
"""Expected per-rank grids of every builder, written out the way PyTorch pipelining prints
a schedule (`0F1`, `(1F1;2B0)` for an overlapped pair)."""

from __future__ import annotations

import pytest

from piper_nb.ir.action import Action, grid_text, parse_grid
from piper_nb.schedules import (
    dualpipe_grid,
    dualpipev_grid,
    gpipe_grid,
    interleaved_1f1b_grid,
    one_f_one_b_grid,
    zero_bubble_grid,
)


def same(grid, text: str) -> None:
    assert grid_text(grid) == grid_text(parse_grid(text))


def test_gpipe_3_ranks_4_microbatches():
    same(gpipe_grid(3, 4), """
        0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
        2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3
    """)


def test_1f1b_4_ranks_8_microbatches_is_the_textbook_one():
    same(one_f_one_b_grid(4, 8), """
        0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7
        1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7
        2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7
        3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7
    """)


def test_1f1b_with_fewer_microbatches_than_ranks_caps_the_warmup():
    same(one_f_one_b_grid(4, 2), """
        0F0 0F1 0B0 0B1
        1F0 1F1 1B0 1B1
        2F0 2F1 2B0 2B1
        3F0 3B0 3F1 3B1
    """)


def test_interleaved_2_ranks_4_microbatches_2_chunks():
    # stages 0, 2 on rank 0 and 1, 3 on rank 1; forwards in groups of 2 microbatches
    same(interleaved_1f1b_grid(2, 4, 2), """
        0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """)


def test_interleaved_4_ranks_8_microbatches_2_chunks():
    # rank r warms up with (chunks-1)*ranks + 2*(ranks-r-1) forwards: 10, 8, 6, 4
    same(interleaved_1f1b_grid(4, 8, 2), """
        0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7
        1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7
        2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7
        3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7
    """)


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved_1f1b_grid(4, 6, 1) == one_f_one_b_grid(4, 6)


def test_zb1p_4_ranks_8_microbatches():
    # rank r keeps its first r W's for the cool-down, where the bubble was
    same(zero_bubble_grid(4, 8), """
        0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
        1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7
        2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7
        3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7
    """)


DUALPIPEV_4_10 = """
    0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 (0F7;7B3) (7F4;0B0) (0F8;7B4) (7F5;0B1) (0F9;7B5) (7F6;0B2) 7B6 (7F7;0B3) 7B7 (7F8;0B4) 7B8 (7F9;0B5) 7B9 0I6 0W6 0I7 0W7 0I8 0W8 0I9 0W9
    1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 (1F6;6B2) (6F4;1B0) (1F7;6B3) (6F5;1B1) (1F8;6B4) (6F6;1B2) (1F9;6B5) (6F7;1B3) 6B6 (6F8;1B4) 6B7 (6F9;1B5) 6B8 1B6 6I9 1I7 6W9 1I8 1W7 1I9 1W8 1W9
    2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 (2F5;5B1) (5F4;2B0) (2F6;5B2) (5F5;2B1) (2F7;5B3) (5F6;2B2) (2F8;5B4) (5F7;2B3) (2F9;5B5) (5F8;2B4) 5B6 (5F9;2B5) 5B7 2B6 5B8 2I7 5I9 2I8 2W7 2I9 5W9 2W8 2W9
    3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 (4F4;3B0) (3F5;4B1) (4F5;3B1) (3F6;4B2) (4F6;3B2) (3F7;4B3) (4F7;3B3) (3F8;4B4) (4F8;3B4) (3F9;4B5) (4F9;3B5) 4B6 3B6 4B7 3B7 4I8 3I8 4I9 3I9 4W8 3W8 4W9 3W9
"""


def test_dualpipev_4_ranks_10_chunks():
    # phases per rank r (N = 4): 2(N-r-1) F0 | r+1 x F0 F1 | N-r-1 x I1 W1 F1 |
    # 10-8+r+1 x (F0;B1) (F1;B0), the last rank's first pair not overlapped |
    # N-r-1 x B1 (F1;B0) | r+1 x B1 B0, the later half I only | N-r-1 x W I0 | r+1 x W
    same(dualpipev_grid(4, 10), DUALPIPEV_4_10)


def test_dualpipe_4_ranks_8_chunks():
    # microbatches 0-3 enter at rank 0 (stage s on rank s), 4-7 at rank 3 (stage s on rank 3-s)
    same(dualpipe_grid(4, 8), """
        0F0 0F1 0F2 3F4 3I4 3W4 3F5 (0F3;3B5) (3F6;0B0) 3B6 (3F7;0B1) 3B7 0I2 0W2 0I3 0W3
        1F0 2F4 1F1 2F5 1F2 2B4 (2F6;1B0) (1F3;2B5) (2F7;1B1) 2B6 1B2 2I7 1I3 2W7 1W3
        1F4 2F0 1F5 2F1 1F6 2B0 (2F2;1B4) (1F7;2B1) (2F3;1B5) 2B2 1B6 2I3 1I7 2W3 1W7
        0F4 0F5 0F6 3F0 3I0 3W0 3F1 (0F7;3B1) (3F2;0B4) 3B2 (3F3;0B5) 3B3 0I6 0W6 0I7 0W7
    """)


def test_dualpipe_8_ranks_20_chunks():
    same(dualpipe_grid(8, 20), """
        0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F10 7I10 7W10 7F11 7I11 7W11 7F12 7I12 7W12 7F13 (0F7;7B13) (7F14;0B0) (0F8;7B14) (7F15;0B1) (0F9;7B15) (7F16;0B2) 7B16 (7F17;0B3) 7B17 (7F18;0B4) 7B18 (7F19;0B5) 7B19 0I6 0W6 0I7 0W7 0I8 0W8 0I9 0W9
        1F0 1F1 1F2 1F3 1F4 6F10 1F5 6F11 6I10 6W10 6F12 6I11 6W11 6F13 (1F6;6B12) (6F14;1B0) (1F7;6B13) (6F15;1B1) (1F8;6B14) (6F16;1B2) (1F9;6B15) (6F17;1B3) 6B16 (6F18;1B4) 6B17 (6F19;1B5) 6B18 1B6 6I19 1I7 6W19 1I8 1W7 1I9 1W8 1W9
        2F0 2F1 2F2 5F10 2F3 5F11 2F4 5F12 5I10 5W10 5F13 (2F5;5B11) (5F14;2B0) (2F6;5B12) (5F15;2B1) (2F7;5B13) (5F16;2B2) (2F8;5B14) (5F17;2B3) (2F9;5B15) (5F18;2B4) 5B16 (5F19;2B5) 5B17 2B6 5B18 2I7 5I19 2I8 2W7 2I9 5W19 2W8 2W9
        3F0 4F10 3F1 4F11 3F2 4F12 3F3 4F13 3F4 4B10 (4F14;3B0) (3F5;4B11) (4F15;3B1) (3F6;4B12) (4F16;3B2) (3F7;4B13) (4F17;3B3) (3F8;4B14) (4F18;3B4) (3F9;4B15) (4F19;3B5) 4B16 3B6 4B17 3B7 4I18 3I8 4I19 3I9 4W18 3W8 4W19 3W9
        3F10 4F0 3F11 4F1 3F12 4F2 3F13 4F3 3F14 4B0 (4F4;3B10) (3F15;4B1) (4F5;3B11) (3F16;4B2) (4F6;3B12) (3F17;4B3) (4F7;3B13) (3F18;4B4) (4F8;3B14) (3F19;4B5) (4F9;3B15) 4B6 3B16 4B7 3B17 4I8 3I18 4I9 3I19 4W8 3W18 4W9 3W19
        2F10 2F11 2F12 5F0 2F13 5F1 2F14 5F2 5I0 5W0 5F3 (2F15;5B1) (5F4;2B10) (2F16;5B2) (5F5;2B11) (2F17;5B3) (5F6;2B12) (2F18;5B4) (5F7;2B13) (2F19;5B5) (5F8;2B14) 5B6 (5F9;2B15) 5B7 2B16 5B8 2I17 5I9 2I18 2W17 2I19 5W9 2W18 2W19
        1F10 1F11 1F12 1F13 1F14 6F0 1F15 6F1 6I0 6W0 6F2 6I1 6W1 6F3 (1F16;6B2) (6F4;1B10) (1F17;6B3) (6F5;1B11) (1F18;6B4) (6F6;1B12) (1F19;6B5) (6F7;1B13) 6B6 (6F8;1B14) 6B7 (6F9;1B15) 6B8 1B16 6I9 1I17 6W9 1I18 1W17 1I19 1W18 1W19
        0F10 0F11 0F12 0F13 0F14 0F15 0F16 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 (0F17;7B3) (7F4;0B10) (0F18;7B4) (7F5;0B11) (0F19;7B5) (7F6;0B12) 7B6 (7F7;0B13) 7B7 (7F8;0B14) 7B8 (7F9;0B15) 7B9 0I16 0W16 0I17 0W17 0I18 0W18 0I19 0W19
    """)


@pytest.mark.parametrize("ranks, chunks", [(2, 4), (4, 8), (4, 12), (8, 16), (8, 20), (6, 14)])
def test_each_dualpipe_rank_runs_the_dualpipev_row_of_its_half_rank(ranks, chunks):
    # DeepSeek's DualPipe is DualPipeV's eight phases with h = PP/2 and hr = min(r, PP-1-r):
    # the V row of rank hr, its stage 0 renamed to this rank's nearer-start stage.
    half = chunks // 2
    v = dualpipev_grid(ranks // 2, half)
    for r, row in enumerate(dualpipe_grid(ranks, chunks)):
        hr = min(r, ranks - 1 - r)
        first, second = (r, 0), (ranks - 1 - r, half)  # (stage, first microbatch)
        if r >= ranks // 2:
            first, second = second, first

        def rename(a: Action, hr=hr, first=first, second=second) -> Action:
            stage, mb0 = first if a.stage == hr else second
            return Action(stage, a.pass_, mb0 + a.mb)

        assert row == tuple(tuple(rename(a) for a in slot) for slot in v[hr])
