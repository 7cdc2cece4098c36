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
    return pn.search(model, model.example_batch(batch_size=8, seed=0), devices=8,
                     precision="fp32", top=2, jobs=jobs, **kwargs)


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
