"""The plotly timeline: one row per (device, stream), bars by kind, memory beneath."""

from __future__ import annotations

import plotly.graph_objects as go

import piper_nb as pn
from piper_nb.sim import CostModel, simulate
from piper_nb.viz.timeline import timeline_data


def trace_of(schedule, ranks, stages, microbatches):
    model = pn.models.MLP(dim=8, depth=8)
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    plan = pn.compile(spec, schedule(ranks=ranks, microbatches=microbatches, place=True),
                      model.example_batch(batch_size=2 * microbatches, seed=0))
    return simulate(plan, CostModel.uniform(F=1, B=2, W=1, FB=3, comm=0.25))


def test_one_row_per_device_and_stream_and_a_memory_subplot():
    trace = trace_of(pn.schedules.one_f_one_b, 4, 4, 8)
    fig = trace.figure()
    assert isinstance(fig, go.Figure)
    rows = list(fig.layout.yaxis.categoryarray)
    assert sorted(rows) == sorted({f"dev{e.device} {e.stream}" for e in trace.events})
    assert rows[-1] == "dev0 compute"                          # device 0 on top
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert {t.name for t in bars} == {e.kind for e in trace.events}
    assert sum(len(t.x) for t in bars) == len(trace.events)
    assert {t.yaxis for t in fig.data if isinstance(t, go.Scatter)} == {"y2"}
    assert "microbatch" in bars[0].hovertemplate


def test_overlapped_f_and_b_share_their_slot_as_half_bars():
    trace = trace_of(pn.schedules.dualpipev, 2, 4, 8)
    data = timeline_data(trace)
    halves = [b for bars in data.bars.values() for b in bars if b["width"] < 0.8]
    assert halves and len(halves) % 2 == 0
    assert {round(b["width"], 6) for b in halves} == {0.4}


def test_devices_can_be_selected_and_memory_left_out():
    trace = trace_of(pn.schedules.one_f_one_b, 4, 4, 8)
    fig = trace.figure(devices=[1, 2], memory=False)
    assert {r.split()[0] for r in fig.layout.yaxis.categoryarray} == {"dev1", "dev2"}
    assert not any(isinstance(t, go.Scatter) for t in fig.data)
