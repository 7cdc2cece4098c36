"""What the builders emit: [place...] + split + one order per rank, the registry behind the
JSON `schedule` op, and argument errors that say how to fix them."""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb.compiler.compile import expand
from piper_nb.directives.spec import Order, Place, Program, Split
from piper_nb.errors import PlanError
from piper_nb.ir.action import grid_text
from piper_nb.schedules import (
    build,
    dualpipe,
    dualpipe_grid,
    dualpipev,
    dualpipev_grid,
    from_grid,
    gpipe,
    gpipe_grid,
    interleaved_1f1b,
    interleaved_1f1b_grid,
    one_f_one_b,
    one_f_one_b_grid,
    zero_bubble,
    zero_bubble_grid,
)

BUILDERS = [
    (gpipe, gpipe_grid, {"ranks": 3, "microbatches": 4}),
    (one_f_one_b, one_f_one_b_grid, {"ranks": 4, "microbatches": 8}),
    (interleaved_1f1b, interleaved_1f1b_grid, {"ranks": 2, "microbatches": 4, "chunks": 3}),
    (zero_bubble, zero_bubble_grid, {"ranks": 4, "microbatches": 6}),
    (dualpipev, dualpipev_grid, {"ranks": 4, "microbatches": 10}),
    (dualpipe, dualpipe_grid, {"ranks": 4, "microbatches": 8}),
]


def places(directives) -> dict[tuple, tuple[int, ...]]:
    return {tuple(sorted(d.filter.items())): d.devices for d in directives if isinstance(d, Place)}


@pytest.mark.parametrize("builder, grid_of, args", BUILDERS)
def test_split_then_one_order_per_rank_whose_slots_are_the_grid(builder, grid_of, args):
    out = builder(**args)
    grid = grid_of(**args)
    assert isinstance(out[0], Split) and out[0].num == args["microbatches"]
    assert out[0].to_json() == {"op": "split", "filter": {}, "dim_name": "MB",
                                "num_microbatches": args["microbatches"]}
    assert len(out) == 1 + len(grid) and all(isinstance(d, Order) for d in out[1:])
    for order, row in zip(out[1:], grid, strict=True):
        assert order.groups == tuple(tuple(a.filter() for a in slot) for slot in row)


def test_an_overlapped_slot_becomes_one_group_of_two_filters():
    order = dualpipev(2, 4)[1]
    pair = next(g for g in order.groups if len(g) == 2)
    assert [dict(f) for f in pair] == [{"PP": 0, "MB": 3, "PASS": "F"},
                                       {"PP": 3, "MB": 1, "PASS": "B"}]


def test_i_and_w_become_passes_bi_and_bw():
    passes = {f["PASS"] for o in zero_bubble(2, 4)[1:] for g in o.groups for f in g}
    assert passes == {"F", "BI", "BW"}


@pytest.mark.parametrize("builder, grid_of, args", BUILDERS)
def test_place_comes_first_and_split_order_stay_the_same(builder, grid_of, args):
    plain = builder(**args)
    placed = builder(**args, place=True)
    n = sum(isinstance(d, Place) for d in placed)
    assert n and all(isinstance(d, Place) for d in placed[:n])
    assert placed[n:] == plain


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b, zero_bubble])
def test_stage_s_on_rank_s(builder):
    assert places(builder(3, 5, place=True)) == {(("PP", s),): (s,) for s in range(3)}


def test_interleaved_stage_s_on_rank_s_mod_ranks():
    got = places(interleaved_1f1b(2, 4, 3, place=True))
    assert got == {(("PP", s),): (s % 2,) for s in range(6)}


def test_dualpipev_rank_r_holds_stages_r_and_2n_minus_1_minus_r():
    got = places(dualpipev(4, 8, place=True))
    assert got == {(("PP", s),): (s if s < 4 else 7 - s,) for s in range(8)}


def test_dualpipe_places_each_stage_and_microbatch_on_its_direction_s_rank():
    got = places(dualpipe(4, 8, place=True))
    want = {(("MB", m), ("PP", s)): (s if m < 4 else 3 - s,) for s in range(4) for m in range(8)}
    assert got == want


def test_from_grid_reads_text_infers_microbatches_and_places():
    text = """
        0F0 0F1 0B0 0B1
        1F0 1B0 1F1 1B1
    """
    out = from_grid(text, place=True)
    assert [d.op for d in out] == ["place", "place", "split", "order", "order"]
    assert out[2].num == 2
    assert places(out) == {(("PP", 0),): (0,), (("PP", 1),): (1,)}
    assert out[3:] == one_f_one_b(2, 2)[1:]
    assert from_grid(one_f_one_b_grid(2, 2)) == one_f_one_b(2, 2)


def test_from_grid_places_a_stage_run_by_two_ranks_per_microbatch():
    assert places(from_grid(grid_text(dualpipe_grid(4, 8)), place=True)) == \
        places(dualpipe(4, 8, place=True))


def test_from_grid_refuses_a_microbatch_count_the_grid_does_not_run():
    with pytest.raises(PlanError, match="microbatches=2"):
        from_grid("0F0 0F1 0B0 0B1", microbatches=3)


def test_from_grid_validates():
    with pytest.raises(PlanError, match="0F1 has no backward"):
        from_grid("0F0 0F1 0B0")


@pytest.mark.parametrize("name, args, same_as", [
    ("gpipe", {"ranks": 2, "microbatches": 3}, gpipe(2, 3)),
    ("1f1b", {"ranks": 2, "microbatches": 3}, one_f_one_b(2, 3)),
    ("one_f_one_b", {"ranks": 2, "microbatches": 3, "place": True}, one_f_one_b(2, 3, True)),
    ("1F1B", {"ranks": 2, "microbatches": 3}, one_f_one_b(2, 3)),
    ("interleaved_1f1b", {"ranks": 2, "microbatches": 4, "chunks": 2},
     interleaved_1f1b(2, 4, 2)),
    ("interleaved", {"ranks": 2, "microbatches": 4, "chunks": 2}, interleaved_1f1b(2, 4, 2)),
    ("zb1p", {"ranks": 2, "microbatches": 3}, zero_bubble(2, 3)),
    ("zero_bubble", {"ranks": 2, "microbatches": 3}, zero_bubble(2, 3)),
    ("zbh1", {"ranks": 2, "microbatches": 3}, zero_bubble(2, 3)),
    ("dualpipev", {"ranks": 2, "microbatches": 4}, dualpipev(2, 4)),
    ("dualpipe", {"ranks": 2, "microbatches": 4}, dualpipe(2, 4)),
    ("grid", {"text": "0F0 0B0\n1F0 1B0"}, one_f_one_b(2, 1)),
])
def test_build_finds_each_builder_by_name_or_alias(name, args, same_as):
    assert build(name, **args) == same_as


def test_the_json_schedule_op_expands_through_build():
    program = Program.from_json('[{"op": "schedule", "name": "1f1b", "ranks": 2, '
                                '"microbatches": 4, "place": true}]')
    assert [d for _, d in expand(program)] == one_f_one_b(2, 4, place=True)


def test_build_unknown_name_lists_the_known_ones():
    with pytest.raises(PlanError, match="unknown schedule 'pipedream'.*gpipe.*1f1b.*dualpipe"):
        build("pipedream", ranks=2, microbatches=4)


def test_build_names_unknown_and_missing_arguments():
    with pytest.raises(PlanError, match="unknown argument.*stages.*takes ranks, microbatches"):
        build("1f1b", stages=2, microbatches=4)
    with pytest.raises(PlanError, match="missing argument.*chunks"):
        build("interleaved", ranks=2, microbatches=4)


@pytest.mark.parametrize("call, message", [
    (lambda: gpipe(0, 4), "ranks must be at least 1"),
    (lambda: one_f_one_b(2, 0), "microbatches must be at least 1"),
    (lambda: one_f_one_b(2.0, 4), "ranks must be an integer"),
    (lambda: zero_bubble(True, 4), "ranks must be an integer"),
    (lambda: one_f_one_b(2, 4, place="yes"), "place must be true or false"),
    (lambda: interleaved_1f1b(4, 6, 2), r"multiple of ranks \(4\); use 4 or 8"),
    (lambda: interleaved_1f1b(4, 8, 0), "chunks must be at least 1"),
    (lambda: dualpipev(4, 7), r"at least 2 \* ranks = 8"),
    (lambda: dualpipe(3, 12), "ranks .3. must be even"),
    (lambda: dualpipe(4, 9), "must be even and at least 2 \\* ranks = 8; use microbatches=10"),
    (lambda: dualpipe(4, 6), "use microbatches=8"),
])
def test_bad_arguments_say_how_to_fix(call, message):
    with pytest.raises(PlanError, match=message):
        call()


def test_legitimate_small_cases_are_accepted():
    one_f_one_b(4, 2)        # fewer microbatches than ranks: the pipeline never fills
    zero_bubble(4, 3)
    zero_bubble(4, 9)        # PyTorch wants a multiple of its round size here; no need
    interleaved_1f1b(4, 5, 1)  # one chunk is plain 1F1B, no divisibility needed
    dualpipev(1, 2)
    dualpipev(2, 5)          # DualPipeV takes odd chunk counts
    dualpipe(2, 4)


def test_a_schedule_for_more_stages_than_the_cut_says_both_counts_and_the_fix():
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]), *dualpipev(2, 4)]
    with pytest.raises(PlanError, match=r"directive #3 \(order\): the DualPipeV schedule .*"
                       r"runs 4 stages x 4 microbatches, the model has 2 x 4: cut the model "
                       r"into 4 stages \(pn.cut_stages\(model, 4\)\)$"):
        pn.compile(spec, program, model.example_batch(batch_size=8, seed=0))
