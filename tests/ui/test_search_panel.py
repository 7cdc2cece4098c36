"""The Designer's Search tab driven from Python, as the front end would drive it: inputs set,
buttons clicked, a point of the frontier clicked through plotly's own click dispatch; and
the pieces under it (pins as text, the frontier, the sort, the progress callable)."""

from __future__ import annotations

import math

import pytest
from plotly.callbacks import Points

import piper_nb as pn
from piper_nb.planner.frontier import REFUSED_SHOWN, figure, pareto, points
from piper_nb.planner.knobs import Knobs, Schedule
from piper_nb.planner.result import Candidate, SearchResult, Status
from piper_nb.ui import Designer
from piper_nb.ui.designer import EDITOR_TABS
from piper_nb.ui.search_panel import parse_pins, sort_rows
from piper_nb.ui.state import program_json

SEARCH_TAB = EDITOR_TABS.index("Search")


def knobs(pp=1, schedule=Schedule.NONE, m=1) -> Knobs:
    return Knobs(pp, 1, 4 // pp, 0, schedule, m, 0, False)


def cand(step, peak, status=Status.SIMULATED, **kw) -> Candidate:
    return Candidate(knobs(**kw), status, step, 1.0, 0.1, peak,
                     reason="memory model: over" if status is Status.REFUSED else "")


def test_pins_read_as_text_and_bad_ones_are_plan_errors():
    assert parse_pins("tp=2; schedule=1f1b,ZB1P; sp=yes") == {
        "tp": [2], "schedule": ["1f1b", "zb1p"], "sp": [True]}
    assert parse_pins("  ") == {}
    assert parse_pins("recompute=all\nzero=1,3") == {"recompute": ["all"], "zero": [1, 3]}
    with pytest.raises(pn.PlanError, match="write knob=value"):
        parse_pins("tp 2")
    with pytest.raises(pn.PlanError, match="cannot pin 'tpp'"):
        parse_pins("tpp=2")
    with pytest.raises(pn.PlanError, match="not a schedule"):
        parse_pins("schedule=zigzag")


def test_sort_rows_by_any_column_either_way_none_last():
    rows = [{"a": 2, "s": "zb1p"}, {"a": None, "s": "1f1b"}, {"a": 1, "s": "gpipe"}]
    assert [r["a"] for r in sort_rows(rows, "a")] == [1, 2, None]
    assert [r["a"] for r in sort_rows(rows, "a", descending=True)] == [2, 1, None]
    assert [r["s"] for r in sort_rows(rows, "s")] == ["1f1b", "gpipe", "zb1p"]


def test_pareto_keeps_exactly_the_undominated():
    a, b, c, d = cand(3.0, 1.0), cand(2.0, 2.0), cand(2.5, 3.0), cand(1.0, 4.0)
    assert pareto([c, a, d, b]) == [a, b, d]          # c is slower and heavier than b
    assert pareto([cand(1.0, 1.0), cand(1.0, 1.0)]) == [cand(1.0, 1.0)]


def test_frontier_figure_draws_every_point_once_with_its_index():
    ranked = [cand(1.0, 2 * 2**30, pp=2, schedule=Schedule.ONE_F_ONE_B, m=2),
              cand(2.0, 1 * 2**30)]
    estimated = [cand(1.5, 3 * 2**30, Status.ESTIMATED, pp=2, schedule=Schedule.ZB1P, m=2)]
    refused = [cand(0.5, (9 + i) * 2**30, Status.REFUSED) for i in range(REFUSED_SHOWN + 5)]
    refused.append(Candidate(knobs(), Status.REFUSED, reason="compile: no"))   # no time
    refused.append(Candidate(knobs(), Status.REFUSED, math.nan, peak=2.0, reason="x"))
    result = SearchResult(ranked, estimated, refused, 4, 400, {"total": 1.0}, 8 * 2**30)
    drawn = points(result)
    assert drawn[:3] == ranked + estimated and len(drawn) == 3 + REFUSED_SHOWN
    fig = figure(result)
    names = [t.name for t in fig.data]
    assert names[0] == f"refused ({REFUSED_SHOWN} of {REFUSED_SHOWN + 5})"
    assert {"1F1B", "ZB1P", "no pipeline", "Pareto frontier", "device memory 8 GiB"} <= set(names)
    indices = sorted(i for t in fig.data if t.customdata is not None for i in t.customdata)
    assert indices == list(range(len(drawn)))
    for t in (t for t in fig.data if t.customdata is not None):   # each point where its
        for i, x, y in zip(t.customdata, t.x, t.y, strict=True):    # candidate's figures say
            assert math.isclose(x, drawn[i].peak / 2**30) and math.isclose(y, drawn[i].step)
    zb = next(t for t in fig.data if t.name == "ZB1P")
    assert list(zb.marker.symbol) == ["circle-open"]          # estimated: hollow
    assert "memory model: over" in next(t for t in fig.data if t.name.startswith("refused")).hovertext[0]
    assert fig.layout.xaxis.title.text == "peak memory per device (GiB)"
    lo, hi = fig.layout.yaxis.range        # framing the fitting steps (1 to 2 s)
    assert 0.5 < lo < 1.0 and 2.0 < hi < 2.5
    assert fig.layout.title.text.endswith(f"{REFUSED_SHOWN} refused off the axis: double-click")
    # a device far larger than every point: its memory is said in the title, not drawn
    light = SearchResult(ranked, estimated, [], 4, 3, {"total": 1.0}, 80 * 2**30)
    fig = figure(light)
    assert not any(t.name.startswith("device memory") for t in fig.data)
    assert fig.layout.title.text.endswith("a device holds 80 GiB")


@pytest.fixture(scope="module")
def searched(gpt):
    d = Designer(*gpt, debounce=None)
    d.editors.selected_index = SEARCH_TAB
    panel = d.search
    panel.devices.value, panel.precision.value, panel.top.value = 4, "fp32", 3
    panel.pins.value = "schedule=none,1f1b"
    panel.run_button.click()              # on its thread, as a click in the browser
    panel.thread.join(timeout=300)
    yield d
    d.close()


def test_a_search_fills_the_figure_table_and_picker(searched):
    panel = searched.search
    result = panel.result
    assert result is not None and result.ranked, panel.status.value
    assert {c.knobs.schedule for c in result.ranked} <= {Schedule.NONE, Schedule.ONE_F_ONE_B}
    assert all(c.knobs.pp * c.knobs.tp * c.knobs.dp == 4 for c in result.ranked)
    assert not panel.run_button.disabled and panel.stop_button.disabled
    assert panel.bar.value == panel.bar.max
    assert "candidates explored" in panel.status.value
    assert panel.table.value.count("<tr>") == 1 + len(result.ranked) + len(result.estimated)
    assert len(panel.pick.options) == len(result.ranked) + len(result.estimated)
    assert sum(len(t.customdata) for t in panel.figure.data if t.customdata is not None) \
        == len(panel.drawn)
    panel.sort.value, panel.descending.value = "peak GiB", True
    unit = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
    shown = [float(x.split()[0]) * unit[x.split()[1]] for x in _column(panel.table.value, "peak")]
    assert shown == sorted(shown, reverse=True)


def _column(table: str, head: str) -> list[str]:
    import re
    heads = re.findall(r"<th>(.*?)</th>", table)
    rows = re.findall(r"<tr>(.*?)</tr>", table)[1:]
    return [re.findall(r"<td>(.*?)</td>", r)[heads.index(head)] for r in rows]


def test_clicking_a_point_loads_its_candidate_into_the_directive_rows(searched):
    d, panel = searched, searched.search
    before = program_json(d.state)
    # the slowest simulated candidate, so the rows surely change from the Designer's own
    target = max(panel.result.ranked, key=lambda c: c.step)
    index = panel.drawn.index(target)
    trace = next(t for t in panel.figure.data
                 if t.customdata is not None and index in t.customdata)
    at = list(trace.customdata).index(index)
    trace._dispatch_on_click(Points(point_inds=[at], xs=[trace.x[at]], ys=[trace.y[at]],
                                    trace_name=trace.name, trace_index=0), None)
    assert program_json(d.state) != before
    assert [dict(r) for r in d.state.rows] == [x.to_json() for x in target.program]
    assert d.state.annotations == target.annotation
    assert d.outcome.plan is not None and not d.problems, d.problems
    assert d.outcome.plan.world == 4
    assert "loaded" in panel.status.value
    assert d.directives.json.value == program_json(d.state)        # the JSON tab follows
    assert all(x.code() in d.directives.python.value for x in target.program)   # and Python


def test_a_refused_point_says_why_and_loads_nothing(searched):
    d, panel = searched, searched.search
    rows = d.state.rows
    refused = Candidate(knobs(), Status.REFUSED, 1.0, 1.0, 0.0, 1.0, reason="memory bound: x")
    panel.load(refused)
    assert d.state.rows == rows and "memory bound: x" in panel.status.value


def test_a_bad_pin_is_said_in_the_tab_and_nothing_runs(gpt):
    d = Designer(*gpt, debounce=None)
    try:
        d.search.pins.value = "tp=two"
        d.search.run_button.click()
        assert d.search.thread is None and "pn-bad" in d.search.status.value
        assert "tp='two'" in d.search.status.value or "tp=" in d.search.status.value
    finally:
        d.close()


def test_stop_keeps_the_best_so_far(gpt):
    d = Designer(*gpt, debounce=None)
    try:
        panel = d.search
        panel.precision.value = "fp32"
        asked, real = [], panel._progress

        def progress(phase, done, total):      # Stop pressed as the tenth candidate starts
            asked.append(phase)
            if done == 10:
                panel.stop()
            return real(phase, done, total)

        panel._progress = progress
        panel.search(wait=True)
        result = panel.result
        assert result.interrupted and not result.ranked and result.explored == 9
        assert result.best is not None and result.best.status == "estimated"
        assert "interrupted" in panel.status.value and set(asked) == {"probing", "exploring"}
    finally:
        d.close()


def test_search_reports_progress_to_a_callable(gpt):
    model, batch = gpt
    seen = []
    result = pn.search(model, batch, devices=2, precision="fp32", top=1,
                       progress=lambda *a: seen.append(a))
    explore = [s for s in seen if s[0] == "exploring"]
    assert explore[0][1] == 0 and explore[-1][1] == explore[-1][2] == result.explored
    assert any(s[0] == "verifying" for s in seen) and result.ranked
