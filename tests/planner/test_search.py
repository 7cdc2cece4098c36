"""`pn.search` on small models: the space it explores, pins, the refusals, the ranked rows
(compiled, checked, simulated) and the stage-level timing it explores with, which must
agree with the simulator's on the same grid."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb.capture.float8 import uses_float8
from piper_nb.planner.knobs import Knobs, Schedule, check_pins, space
from piper_nb.planner.pipeline import steps_of, timing


def gpt():
    return pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16)


@pytest.fixture(scope="module")
def found():
    model = gpt()
    return model, pn.search(model, model.example_batch(batch_size=8, seed=0), devices=4,
                            precision="fp32", progress=False)


def test_the_ranked_rows_are_simulated_compiled_plans_fastest_first(found):
    model, result = found
    assert result.ranked and len(result.ranked) <= 5
    steps = [c.step for c in result.ranked]
    assert steps == sorted(steps)
    assert all(c.status == "simulated" for c in result.ranked)
    batch = model.example_batch(batch_size=8, seed=0)
    for c in result.ranked:
        k = c.knobs
        assert k.pp * k.tp * k.dp == 4
        plan = pn.compile(pn.annotate(model, c.annotation), c.program, batch)
        trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"),
                            memory=pn.MemorySettings(optimizer="adamw"))
        assert trace.step_time == pytest.approx(c.step)
        assert max(trace.peak_memory.values()) == pytest.approx(c.peak)


def test_a_refused_class_says_why_and_is_never_ranked(found):
    _, result = found
    tp4 = [c for c in result.refused if c.knobs.tp == 4]
    assert tp4 and all("heads=2" in c.reason for c in tp4)
    assert all(c.knobs.tp != 4 for c in result.ranked + result.estimated)
    assert result.explored >= len(result.ranked) + len(result.refused)


def test_the_table_prints_the_top_rows_and_sorts_by_a_column(found):
    _, result = found
    text = result.table(3)
    assert "candidates explored" in text and "tok/s/dev" in text
    assert len(text.splitlines()) == 2 + min(3, len(result.ranked))
    by_memory = result.rows(None, sort="memory")
    peaks = [r["peak GiB"] for r in by_memory]
    assert peaks == sorted(peaks)
    with pytest.raises(pn.PlanError, match="sort by one of"):
        result.rows(sort="speed")
    assert "<table>" in result._repr_html_()


def test_pins_hold_every_candidate():
    model = gpt()
    result = pn.search(model, model.example_batch(batch_size=8, seed=0), devices=4,
                       precision="fp32", progress=False, top=2,
                       pin={"pp": 2, "schedule": "1f1b", "recompute": "all"})
    rows = result.ranked + result.estimated + result.refused
    assert rows
    assert all(c.knobs.pp == 2 and c.knobs.schedule is Schedule.ONE_F_ONE_B
               and c.knobs.recompute == 2 for c in rows)


@pytest.mark.parametrize("kwargs, match", [
    ({"devices": 0}, "devices must be a positive int"),
    ({"devices": 4, "pin": {"stages": 2}}, "cannot pin 'stages'"),
    ({"devices": 4, "pin": {"schedule": "zigzag"}}, "is not a schedule"),
    ({"devices": 4, "cost": "guess"}, "cost must be one of"),
    ({"devices": 4, "jobs": 0}, "jobs must be a positive int"),
    ({"devices": 16, "pin": {"pp": 1, "tp": 1}}, "DP must divide the batch of 8"),
    ({"devices": 4, "pin": {"float8": "maybe"}}, "float8='maybe' must be True or False"),
    ({"devices": 4, "pin": {"float8": True}, "hardware": "A100"}, "float8=True needs FP8"),
])
def test_bad_input_is_a_plan_error_before_the_search(kwargs, match):
    model = gpt()
    with pytest.raises(pn.PlanError, match=match):
        pn.search(model, model.example_batch(batch_size=8, seed=0), progress=False, **kwargs)


def test_a_batch_the_model_cannot_take_is_a_plan_error_before_the_search():
    model = gpt()
    wrong = (torch.zeros(8, 16, 3), torch.zeros(8, 16, dtype=torch.long))   # not token ids
    with pytest.raises(pn.PlanError, match="does not compile on this batch"):
        pn.search(model, wrong, devices=2, precision="fp32", progress=False)


def test_when_nothing_fits_it_names_the_smallest_shortfall():
    model = gpt()
    result = pn.search(model, model.example_batch(batch_size=8, seed=0), devices=2,
                       precision="fp32", progress=False, capacity=64 * 2**10)
    assert not result.fits and result.best is None
    assert "GiB more than" in result.shortfall and "PP" in result.shortfall
    assert "nothing fits" in result.summary()
    with pytest.raises(pn.PlanError, match="no candidate fits"):
        result.save_best("unused.json")


def test_the_space_keeps_tp_in_a_node_and_the_schedules_rules():
    ks = list(space(16, 32, 10, gpus_per_node=4))
    assert {k.tp for k in ks} == {1, 2, 4}
    assert all(k.pp * k.tp * k.dp == 16 and 32 % (k.dp * k.microbatches) == 0 for k in ks)
    assert all(k.microbatches % k.pp == 0 for k in ks if k.schedule is Schedule.INTERLEAVED)
    assert all(k.microbatches >= 2 * k.pp for k in ks if k.schedule is Schedule.DUALPIPEV)
    assert all(k.schedule is Schedule.NONE for k in ks if k.pp == 1)
    assert all(k.zero == 0 for k in ks if k.dp == 1)


def test_context_parallelism_is_tried_for_long_sequences_with_and_without_tp():
    short = list(space(16, 32, 10, gpus_per_node=8, sequence=4096))
    assert {k.cp for k in short} == {1}
    long = list(space(16, 32, 10, gpus_per_node=8, sequence=32768))
    assert {k.cp for k in long} == {1, 2, 4, 8, 16}
    assert all(k.pp * k.tp * k.cp * k.dp == 16 for k in long)
    assert all(k.ep == 1 for k in long if k.cp > 1)
    assert {(k.tp, k.cp) for k in long if k.tp > 1 and k.cp > 1} == {
        (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (8, 2)}
    assert any(k.zero == 3 and k.dp == 1 for k in long if k.cp > 1)   # ZeRO over CP
    # zigzag chunks of at least 1024 tokens: 16k over CP 16 gives 512, not tried
    assert {k.cp for k in space(16, 32, 10, gpus_per_node=8, sequence=16384)} == {1, 2, 4, 8}
    pinned = list(space(8, 16, 6, gpus_per_node=8, pins={"cp": {2}}, sequence=64))
    assert pinned and all(k.cp == 2 for k in pinned) and {k.tp for k in pinned} == {1, 2, 4}
    assert "CP2" in pinned[0].label()


def test_a_context_parallel_candidate_is_ranked_as_its_program_compiles():
    model = gpt()
    batch = model.example_batch(batch_size=4, seed=0)
    result = pn.search(model, batch, devices=4, progress=False, top=2, pin={"cp": 2})
    assert len(result.ranked) == 2
    for c in result.ranked:
        assert c.knobs.cp == 2
        assert any(d.op == "context_parallel" for d in c.program)
        steps = [ev for ev in c.trace.events if "#cpF" in ev.node]
        assert steps, "the ring's all-gathers are in the simulated step"
    both = pn.search(model, batch, devices=4, progress=False, top=1, pin={"cp": 2, "tp": 2})
    (c,) = both.ranked   # CP x TP: the context over the TP groups' first devices
    cp = next(d for d in c.program if d.op == "context_parallel")
    tp = next(d for d in c.program if d.op == "tensor_parallel")
    assert cp.groups == ((0, 2),) and tp.groups == ((0, 1), (2, 3))
    assert any("#cpF" in ev.node for ev in c.trace.events)
    assert any("#tpF" in ev.node for ev in c.trace.events)


def test_float8_is_tried_without_tp_when_pinned():
    plain = list(space(8, 16, 6, gpus_per_node=4))
    assert not any(k.float8 for k in plain)
    both = list(space(8, 16, 6, gpus_per_node=4, pins={"float8": {False, True}}))
    assert {k.float8 for k in both if k.tp == 1} == {True, False}
    assert not any(k.float8 for k in both if k.tp > 1)   # per-shard scales would not train
    assert len(both) == len(plain) + sum(k.tp == 1 for k in plain)
    pinned = list(space(8, 16, 6, gpus_per_node=4, pins={"float8": {True}}))
    assert pinned and all(k.float8 and k.tp == 1 for k in pinned)


def test_a_float8_candidate_is_ranked_as_its_program_compiles():
    model = gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    result = pn.search(model, batch, devices=2, progress=False, top=2,
                       pin={"float8": True, "pp": 1})
    assert result.ranked and all(c.knobs.float8 for c in result.ranked)
    best = result.ranked[0]
    assert "f8" in best.knobs.label() and best.row(8)["Float8"] == "yes"
    assert any(d.op == "float8" for d in best.program)
    plan = pn.compile(pn.annotate(model, best.annotation), best.program, batch,
                      precision="bf16")
    assert uses_float8(plan.capture.modules)
    trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"),
                        memory=pn.MemorySettings(optimizer="adamw"))
    assert trace.step_time == pytest.approx(best.step)
    # the same candidates without Float8 price otherwise: the knob reaches the estimate
    plain = pn.search(model, batch, devices=2, progress=False, top=1,
                      pin={"float8": False, "pp": 1})
    same = {c.knobs.__class__(**{**c.knobs.as_dict(), "schedule": c.knobs.schedule,
                                 "float8": True}): c.step for c in plain.estimated}
    assert any(same.get(c.knobs) not in (None, c.step) for c in result.estimated)


def test_one_layer_in_k_recomputes_where_every_rank_does():
    ks = list(space(8, 16, 6, gpus_per_node=4))
    assert {k.every for k in ks} == {1, 2}
    assert all(k.recompute == k.pp for k in ks if k.every > 1)
    pinned = list(space(8, 16, 6, gpus_per_node=4, pins={"every": {4}}))
    assert pinned and all(k.every == 4 and k.recompute == k.pp for k in pinned)
    with pytest.raises(pn.PlanError, match="every k is recomputed, k at least 1"):
        check_pins({"every": 0})


def test_a_candidate_recomputing_one_layer_in_two_prices_between_none_and_all():
    model = gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    pin = {"pp": 1, "tp": 1, "zero": 0, "microbatches": 1, "every": [1, 2, 4]}
    result = pn.search(model, batch, devices=2, precision="fp32", progress=False, top=4,
                       pin=pin)
    by = {(c.knobs.recompute, c.knobs.every): c for c in result.ranked}
    assert set(by) == {(0, 1), (1, 1), (1, 2), (1, 4)}
    none, half, full = by[(0, 1)], by[(1, 2)], by[(1, 1)]
    assert none.step < half.step < full.step
    assert none.peak >= half.peak >= full.peak and none.peak > full.peak
    assert half.knobs.label().endswith("rc1/2") and half.row(8)["recompute"] == "1 (1 in 2)"
    # layers 0 and 2 of the four recompute, and the program names them alone
    tags = [half.annotation[f"blocks.{i}"]["AC"] for i in range(4)]
    assert tags == [2, 1, 2, 1]
    assert [dict(d.filter) for d in half.program if d.op == "recompute"] == [{"PP": 0, "AC": 2}]
    plan = pn.compile(pn.annotate(model, half.annotation), half.program, batch)
    trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"),
                        memory=pn.MemorySettings(optimizer="adamw"))
    assert trace.step_time == pytest.approx(half.step)


@pytest.mark.parametrize("schedule", [s for s in Schedule if s is not Schedule.NONE])
def test_the_stage_timing_equals_the_simulator_on_the_same_grid(schedule):
    """Unit costs, no communication: the explore tier's timing of a grid is the
    simulator's step on the plan compiled from the same schedule."""
    pp, m = 2, 4
    k = Knobs(pp, 1, 1, 0, schedule, m, 0, False)
    stages = k.stages
    model = pn.models.MLP(dim=8, depth=stages)
    ann = {f"layers.{i}": {"PP": i} for i in range(stages)}
    from piper_nb.planner.build import program
    plan = pn.compile(pn.annotate(model, ann), program(k, list(range(stages))),
                      model.example_batch(batch_size=8, seed=0))
    want = pn.simulate(plan, pn.CostModel.uniform(F=1, B=2, W=1)).step_time
    ones = [1.0] * stages
    step, _ = timing(steps_of(schedule, pp, m), ones, [2.0] * stages, ones, 0.0)
    assert step == pytest.approx(want)


def test_an_interrupted_search_keeps_the_best_so_far(monkeypatch):
    """Ctrl-C while exploring: the search returns what it estimated, marked interrupted."""
    from piper_nb.planner import explore
    calls = {"n": 0}
    real = explore.estimate

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(explore, "estimate", interrupting)
    model = gpt()
    result = pn.search(model, model.example_batch(batch_size=8, seed=0), devices=4,
                       precision="fp32", progress=False)
    assert result.interrupted and not result.ranked
    assert result.fits and result.best is result.estimated[0]
    assert result.best.status == "estimated" and result.best.program is not None
    assert "interrupted" in result.summary()
    assert len(result.estimated) <= result.explored < len(list(space(4, 8, 6, gpus_per_node=8)))
    steps = [c.step for c in result.estimated]
    assert steps == sorted(steps)
