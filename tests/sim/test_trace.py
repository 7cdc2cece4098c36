"""Trace: JSON round trip, bubbles on a hand-made trace, comparison, Chrome trace."""

from __future__ import annotations

import json

import pytest

import piper_nb as pn
from piper_nb.sim import CostModel, Event, MemorySample, Trace, simulate


def small_trace() -> Trace:
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, pn.schedules.one_f_one_b(ranks=2, microbatches=4, place=True),
                      model.example_batch(batch_size=8, seed=0))
    return simulate(plan, CostModel.uniform(comm=0.25))


def test_json_round_trip_keeps_every_event_and_sample():
    trace = small_trace()
    back = Trace.from_json(trace.to_json())
    assert back.events == trace.events and back.memory == trace.memory
    assert (back.source, back.unit, back.meta) == ("simulated", "unit", trace.meta)
    assert back.step_time == trace.step_time and back.peak_memory == trace.peak_memory


def test_bubble_is_compute_idle_time_inside_the_step_with_overlap_counted_once():
    ev = [Event(0, "compute", "a", "F", 0, 1), Event(0, "compute", "b", "F", 2, 4),
          Event(0, "compute", "c", "B", 2, 4), Event(0, "pp", "s", "SEND", 4, 5),
          Event(1, "compute", "d", "F", 1, 3)]
    trace = Trace(tuple(ev))
    assert trace.step_time == 5
    assert trace.bubble(0) == 2          # idle 1-2 and 4-5
    assert trace.bubble(1) == 3
    assert trace.bubble_fraction(0) == pytest.approx(0.4)
    assert trace.bubble_fraction() == pytest.approx(0.5)


def test_peak_memory_is_the_largest_total_per_device():
    trace = Trace((), (MemorySample(0, 0, params=5), MemorySample(0, 1, params=5, activations=3),
                       MemorySample(1, 0, grads=2)))
    assert trace.peak_memory == {0: 8, 1: 2}


def test_compare_matches_instructions_and_reports_the_step_ratio(hand_plan):
    plan = hand_plan("r0:F0 r0:B0 r0:F1 r0:B1")
    pred = simulate(plan, CostModel.uniform(F=1, B=2))
    meas = Trace(tuple(Event(e.device, e.stream, e.node, e.kind, 2 * e.start, 2 * e.end,
                             e.mb, e.region, e.label) for e in pred.events), source="measured")
    cmp = meas.compare(pred)         # either order: the simulated trace is the prediction
    assert cmp.rows[0] == (0, "r0:B0", 2, 4, 2.0)
    assert [r[1] for r in cmp.rows] == ["r0:B0", "r0:B1", "r0:F0", "r0:F1"]
    assert cmp.step_ratio == 2.0 and cmp.unmatched == 0
    assert "| all | step | 6 | 12 | 2 |" in cmp.table()


def test_chrome_trace_has_one_pid_per_device_and_one_tid_per_stream(tmp_path):
    trace = small_trace()
    path = tmp_path / "trace.json"
    trace.to_chrome_trace(path)
    obj = json.loads(path.read_text())
    xs = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(trace.events)
    assert {e["pid"] for e in xs} == set(trace.devices)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in obj["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], names[(e["pid"], e["tid"])]) for e in xs} == \
        {(e.device, e.stream) for e in trace.events}
    assert names[(0, 0)] == "compute"
    assert any(e["ph"] == "C" for e in obj["traceEvents"])
