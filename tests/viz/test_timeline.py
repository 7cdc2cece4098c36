"""The plotly timeline: one row per (device, stream), bars by kind, memory beneath."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

import piper_nb as pn
from piper_nb.sim import CostModel, simulate
from piper_nb.ui.render import comparison_figure
from piper_nb.viz.replicas import group_label
from piper_nb.viz.timeline import timeline_data, timeline_figure
from piper_nb.viz.units import bytes_scale, bytes_text, time_text


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
    assert all(c[1].startswith("microbatch") for c in bars[0].customdata)
    assert "%{customdata[0]}" in bars[0].hovertemplate        # the instruction's text


def test_the_hover_gives_start_end_and_duration_not_the_end_as_the_duration():
    trace = trace_of(pn.schedules.one_f_one_b, 2, 2, 4)
    late = max((e for e in trace.events if e.kind == "B"), key=lambda e: e.start)
    fig = trace.figure()
    bars = next(t for t in fig.data if isinstance(t, go.Bar) and t.name == "B")
    assert "start %{customdata[3]:.4g}, end %{customdata[4]:.4g}, takes " \
           "%{customdata[5]:.4g}" in bars.hovertemplate and "%{x" not in bars.hovertemplate
    hit = [c for c in bars.customdata if c[0] == late.label and c[3] == late.start]
    assert len(hit) == 1 and list(hit[0][3:]) == [late.start, late.end, late.end - late.start]
    assert late.end - late.start == 2 and late.start > 2   # a B of 2 units, late in the step
    side = comparison_figure(trace, trace)   # the Run tab's predicted / measured pair
    assert all("takes %{customdata[3]:.4g}" in t.hovertemplate for t in side.data
               if isinstance(t, go.Bar))


def test_a_timeline_says_when_communication_is_priced_at_zero():
    model = pn.models.MLP(dim=8, depth=8)
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      pn.schedules.one_f_one_b(ranks=2, microbatches=2, place=True),
                      model.example_batch(batch_size=8, seed=0))
    free = timeline_figure(simulate(plan, CostModel.uniform())).layout.title.text
    assert "communication is priced at 0" in free
    timed = timeline_figure(simulate(plan, CostModel.uniform(comm=0.5))).layout.title.text
    assert "priced at 0" not in timed


def test_tensor_parallel_collectives_have_a_legend_entry_of_their_own():
    model = pn.models.TinyGPT(layers=2)
    plan = pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                      [pn.tensor_parallel({}, [0, 1]), pn.split({}, num=2)],
                      model.example_batch(batch_size=4, seed=0))
    data = timeline_data(simulate(plan, CostModel.uniform(comm=0.5)))
    assert {b["label"] for b in data.bars["TP ALL_REDUCE"]} >= {"r1:AR_F0", "r1:AR_B1"}
    assert all(b["row"].endswith(" tp") for b in data.bars["TP ALL_REDUCE"])
    assert "ALL_REDUCE" not in data.bars      # nor among the data-parallel ones


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


def plan_pp2_dp2(schedule=pn.schedules.one_f_one_b, stages=2, **kw):
    """PP 2 x DP 2: stage s on devices s and s + 2 (ranks of a 2-rank schedule)."""
    model = pn.models.MLP(dim=8, depth=8)
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    program = [*schedule(ranks=2, microbatches=4, **kw)]
    rank = {s: s % 2 for s in range(stages)} if schedule is not pn.schedules.dualpipev \
        else {0: 0, 1: 1, 2: 1, 3: 0}
    for s in range(stages):
        devices = [rank[s], rank[s] + 2]
        program += [pn.place({"PP": s}, devices), pn.replicate({"PP": s}, devices, zero=1)]
    return pn.compile(spec, program, model.example_batch(batch_size=16, seed=0))


def test_identical_replicas_share_a_row_and_buttons_expand_them():
    trace = simulate(plan_pp2_dp2(), CostModel.uniform(F=1, B=2, W=1, comm=0.25))
    data = timeline_data(trace)
    assert [g.devices for g in data.groups] == [(0, 2), (1, 3)]
    assert data.rows[0] == "devices 0,2 (x2) compute"
    assert set(data.memory) == {"devices 0,2 (x2)", "devices 1,3 (x2)"}
    assert sum(len(b) for b in data.bars.values()) == sum(e.device in (0, 1)
                                                          for e in trace.events)
    every = timeline_data(trace, group=False)
    assert [g.devices for g in every.groups] == [(0,), (1,), (2,), (3,)]
    fig = timeline_figure(trace)
    (menu,) = fig.layout.updatemenus
    grouped, expanded = (b.args for b in menu.buttons)
    assert [b.label for b in menu.buttons] == ["replicas grouped", "every device"]
    assert expanded[1]["yaxis.categoryarray"][-1] == "dev0 compute"
    shown = [t for t, v in zip(fig.data, grouped[0]["visible"], strict=True) if v]
    assert {t.y[0].split(" (")[0] for t in shown if isinstance(t, go.Bar)} <= {
        "devices 0,2", "devices 1,3"}
    assert not any(t.visible is False for t in shown)
    assert group_label(tuple(range(0, 128, 8))) == "devices 0,8,16,...,120 (x16)"


def test_bars_carry_their_microbatch_and_chunk_and_the_instruction_on_hover():
    onefb = trace_of(pn.schedules.one_f_one_b, 2, 2, 4)
    fb = timeline_data(onefb).bars["F"]
    assert [b["text"] for b in fb if b["row"] == "dev0 compute"] == ["0", "1", "2", "3"]
    assert [b["label"] for b in fb if b["row"] == "dev0 compute"] == [
        e.label for e in onefb.events if e.device == 0 and e.kind == "F"]
    inter = timeline_data(trace_of(lambda **k: pn.schedules.interleaved_1f1b(chunks=2, **k),
                                   2, 4, 4))
    texts = {b["text"] for b in inter.bars["F"] if b["row"] == "dev1 compute"}
    assert texts == {f"{m}c{c}" for m in range(4) for c in range(2)}
    assert any(b["words"].startswith("microbatch 2, chunk 1, region 3") for b in inter.bars["F"])
    both = timeline_data(trace_of(pn.schedules.dualpipe, 4, 4, 8)).bars["F"]
    arrows = {b["text"][-1] for b in both}
    assert arrows == {"\u2193", "\u2191"}
    assert {b["text"] for b in both if b["text"].startswith("0")} == {"0\u2193"}


def test_units_read_as_english_and_the_legend_clears_the_axis_titles():
    trace = trace_of(pn.schedules.one_f_one_b, 2, 2, 4)
    fig = trace.figure()
    assert fig.layout.title.text.startswith(f"Simulated timeline: step {trace.step_time:g} units")
    assert fig.layout.xaxis2.title.text == "time (units)"
    peak = max(trace.peak_memory.values())
    div, unit = bytes_scale(peak)
    assert fig.layout.yaxis2.title.text == f"memory ({unit})"
    mem = [t for t in fig.data if isinstance(t, go.Scatter)]
    assert max(max(t.y) for t in mem) == pytest.approx(peak / div)
    assert all(unit in t.hovertemplate for t in mem)
    assert fig.layout.legend.orientation in (None, "v")     # on the right, off both axes
    assert time_text(0.0123, "s") == "12.3 ms" and time_text(20.3, "s") == "20.3 s"
    assert time_text(1, "unit") == "1 unit" and bytes_text(3 * 2**30) == "3 GiB"
    assert bytes_scale(5 * 2**20) == (2**20, "MiB") and bytes_scale(100) == (1, "B")
    # never in exponent notation: the Designer's headline once read "1.01e+03 KiB"
    assert bytes_text(1034000) == "1010 KiB" and bytes_text(2**20 - 100) == "1024 KiB"
    assert time_text(0.9997, "s") == "1000 ms" and time_text(12345, "unit") == "12345 units"
    assert time_text(1234.5, "s") == "1234 s" and bytes_text(1.5 * 2**30) == "1.5 GiB"


def test_predicted_and_measured_stack_on_the_same_rows_and_clock():
    """The Run tab's pair: predicted above measured, one row per device and stream in both
    (replicas not grouped, though the prediction's replicas run alike), and one time axis
    when both clocks are in one unit."""
    model = pn.models.MLP(dim=8, depth=4)
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), [
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
        *pn.schedules.one_f_one_b(ranks=2, microbatches=2)], model.example_batch(8, seed=0))
    predicted = simulate(plan, CostModel.uniform(F=1e-3, B=2e-3, W=1e-3, comm=1e-4))
    measured = simulate(plan, CostModel.uniform(F=2e-3, B=3e-3, W=1e-3, comm=1e-4))
    fig = comparison_figure(predicted, measured)
    top, low = fig.layout.yaxis, fig.layout.yaxis2
    assert list(top.categoryarray) == list(low.categoryarray)
    assert {r.split()[0] for r in top.categoryarray} == {"dev0", "dev1", "dev2", "dev3"}
    assert top.domain[0] > low.domain[1]                           # stacked, predicted above
    assert fig.layout.xaxis.domain == fig.layout.xaxis2.domain
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    assert {t.xaxis for t in fig.data} == {"x", "x2"}
    assert fig.layout.legend.x > 1                                 # outside the plot area


def test_the_legend_says_what_the_bar_text_means():
    plain = trace_of(pn.schedules.one_f_one_b, 2, 2, 4).figure().layout.legend.title.text
    assert plain.startswith("pass / op") and "bar text: microbatch" in plain
    chunked = trace_of(lambda **k: pn.schedules.interleaved_1f1b(chunks=2, **k), 2, 4, 4).figure()
    assert "1c0: microbatch 1, first chunk" in chunked.layout.legend.title.text
    bars = [t for t in chunked.data if isinstance(t, go.Bar) and t.name == "F"]
    assert any("c1" in text for t in bars for text in t.text)


def test_sequence_parallel_draws_its_all_gathers_and_reduce_scatters():
    model = pn.models.TinyGPT(layers=2)
    plan = pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                      [pn.tensor_parallel({}, [0, 1], sequence_parallel=True)],
                      model.example_batch(batch_size=4, seed=0))
    data = timeline_data(simulate(plan, CostModel.uniform(comm=0.5)))
    gathers, scatters = data.bars["TP ALL_GATHER"], data.bars["TP REDUCE_SCATTER"]
    # forward, backward, and the gathers again before the backward (`compiler.regather`)
    assert {b["label"].split(":")[1][:4] for b in gathers} == {"AG_F", "AG_B", "AG_R"}
    assert {b["label"].split(":")[1][:4] for b in scatters} == {"RS_F", "RS_B"}
    assert all(b["row"].endswith(" tp") for b in gathers + scatters)
