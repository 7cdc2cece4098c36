"""`pn.search` spread over processes (`planner.spread`): forked workers probe the TP
classes and estimate the candidates in chunks, and find exactly what one process finds;
Ctrl-C in a worker stops the search with what was estimated before it."""

from __future__ import annotations

import os

import pytest

import piper_nb as pn
from piper_nb.planner import explore, spread
from piper_nb.planner.knobs import space

pytestmark = pytest.mark.skipif(spread.workers(2, "analytic") < 2,
                                reason="needs fork (Linux) to spread")


def gpt():
    return pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16)


def _search(jobs: int, **kwargs):
    model = gpt()
    kwargs.setdefault("progress", False)
    kwargs.setdefault("top", 2)
    return pn.search(model, model.example_batch(batch_size=8, seed=0), devices=8,
                     precision="fp32", jobs=jobs, **kwargs)


def _rows(result) -> list:
    return [(c.knobs, c.status, c.step, c.peak, c.reason)
            for c in (*result.ranked, *result.estimated, *result.refused)]


@pytest.fixture
def always_spread(monkeypatch):
    """Spread even this small model's probes and its few hundred candidates (chunks of
    16), as a large model's are."""
    monkeypatch.setattr(explore, "SLOW_PROBE", 0.0)
    monkeypatch.setattr(explore, "SPREAD_AT", 1)
    monkeypatch.setattr(explore, "CHUNK", 16)


def test_two_processes_find_what_one_finds(always_spread):
    seen = []
    many = _search(2, progress=lambda *a: seen.append(a))
    one = _search(1)
    assert many.explored == one.explored == len(list(space(8, 8, 6, gpus_per_node=8)))
    assert _rows(many) == _rows(one) and many.ranked
    probing = [s for s in seen if s[0] == "probing"]
    assert probing[-1][1] == probing[-1][2] > 1          # every TP class, one by one
    exploring = [s for s in seen if s[0] == "exploring"]
    assert exploring[-1][1] == exploring[-1][2] == many.explored
    steps = {b - a for (_, a, _), (_, b, _) in zip(exploring, exploring[1:], strict=False)}
    assert steps <= {16, many.explored % 16}             # a chunk at a time


def test_ctrl_c_in_a_worker_keeps_what_was_estimated(always_spread, monkeypatch):
    parent, real = os.getpid(), explore.estimate
    calls = {"n": 0}

    def interrupting(*args, **kwargs):     # a worker's 20th estimate is interrupted
        calls["n"] += 1
        if os.getpid() != parent and calls["n"] > 20:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(explore, "estimate", interrupting)
    result = _search(2)
    assert result.interrupted and not result.ranked and result.fits
    assert 16 <= result.explored < len(list(space(8, 8, 6, gpus_per_node=8)))


def test_profiled_costs_stay_in_one_process():
    assert spread.workers(None, "profile") == 1
    assert spread.workers(3, "analytic") == 3
    assert spread.workers(None, "analytic") == len(os.sched_getaffinity(0))


def test_the_floors_are_below_every_estimate():
    """`step_floor` and `bound`, which prune before the estimate, are floors of it."""
    from piper_nb.capture.batch import Batch
    from piper_nb.planner import engine
    from piper_nb.planner.estimate import Context, bound, estimate, layout, step_floor
    for model in (gpt(), pn.models.TinyMoE(vocab=64, dim=32, layers=2, experts=4, top_k=2,
                                           seq=16)):
        batch = Batch.of(model.example_batch(batch_size=8, seed=0), "test")
        units = engine.unit_names(model, batch)
        experts = engine.find_experts(model)
        setup = engine._Setup(model, batch, 128, units, pn.sim.gpus.spec_of("H100"),
                              pn.Topology.of("H100"), "fp32", pn.MemorySettings(), "analytic",
                              None, "auto", experts, engine._holding(units, experts))
        cands = list(space(8, 8, len(units), gpus_per_node=8, experts=experts))
        probes, _ = explore._probe_all(setup, cands, False, 1)
        ctx = Context(8, next(iter(probes.values())).links, None, None, 12.0, 4.0)
        checked = 0
        for k in cands:
            p = probes[explore._key(k)]
            if p.error is None:
                lay = layout(k, p, ctx)
                est = estimate(k, lay, ctx)
                assert step_floor(k, lay) <= est.step * (1 + 1e-12), k.label()
                assert bound(k, lay) <= est.peak * (1 + 1e-12), k.label()
                checked += 1
        assert checked > 300


def test_pruning_dominated_candidates_keeps_the_fastest_and_the_frontier(monkeypatch):
    pruned = _search(1, top=3)
    assert pruned.reasons().get("dominated", 0) > 0
    monkeypatch.setattr(explore._Front, "beating", lambda self, step, peak: None)
    whole = _search(1, top=3)
    assert "dominated" not in whole.reasons() and pruned.explored == whole.explored
    assert [(c.knobs, c.step) for c in pruned.ranked] == [(c.knobs, c.step) for c in whole.ranked]

    def front(result):
        rows = [c for c in (*result.ranked, *result.estimated) if c.step is not None]
        return {(c.knobs, c.step) for c in rows if not any(
            o.step <= c.step and o.peak <= c.peak and (o.step, o.peak) != (c.step, c.peak)
            for o in rows)}
    assert front(pruned) == front(whole)
