"""Trace -> plotly timeline (one row per device and stream, memory over time beneath)
and Trace -> Chrome trace JSON.

Walk-then-draw (micrograd's `draw_dot`): `timeline_data` walks the trace into rows,
bars (grouped by kind, so the legend is the pass / op kind; a tensor-parallel collective,
`r1:AR_F0`, is its own kind, "TP ALL_REDUCE") and memory curves;
`draw_timeline` only renders them. Overlapped F&B slots (two compute events with the same
span) are drawn as two half-height bars sharing the slot.

At scale (`viz/replicas.py`): devices whose timelines are identical (data-parallel
replicas) share one row, "devices 0,8,16,...,120 (x16) compute"; `group=False` draws each,
and a small enough figure carries both views behind two buttons. Each bar carries its
microbatch (with its chunk or direction) as text and its instruction on hover; times are
in s, ms or µs by the step's length and memory in GiB, MiB or KiB by its peak
(`viz/units.py`); the legend stands on the right, clear of both axis titles.

The Chrome trace (Trace Event Format, opens in Perfetto) has one process (pid) per
device, one thread (tid) per stream (compute first), a complete ("X") event per
instruction and a counter ("C") track of the device's memory by kind. Its times are
microseconds: seconds are scaled by 1e6, a cost model's abstract unit is drawn as 1 ms.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from piper_nb.ir.kinds import Op
from piper_nb.ir.text import TP_LABEL
from piper_nb.trace import MEMORY_KINDS
from piper_nb.viz.replicas import DeviceGroup, bar_marks, group_replicas
from piper_nb.viz.units import bytes_scale, time_scale, time_text

__all__ = ["COLORS", "TimelineData", "timeline_data", "draw_timeline", "timeline_figure",
           "to_chrome_trace", "stream_order", "span_hover", "bar_span"]

COLORS = {Op.F: "#4C78A8", Op.B: "#F58518", Op.BI: "#E45756", Op.BW: "#72B7B2", Op.U: "#54A24B",
          Op.SEND: "#B279A2", Op.RECV: "#FF9DA6", Op.ALL_REDUCE: "#9D755D",
          Op.ALL_GATHER: "#8CD17D", Op.REDUCE_SCATTER: "#EECA3B", Op.ALL_TO_ALL: "#79706E"}
TP = "TP "   # a tensor-parallel collective's legend entry: "TP ALL_REDUCE"
COLORS |= {TP + k: c for k, c in (("ALL_REDUCE", "#D37295"), ("REDUCE_SCATTER", "#FABFD2"),
                                   ("ALL_GATHER", "#B07AA1"))}
MAX_DEVICES = 64       # rows of devices (or groups of replicas) drawn unless devices= says
EXPAND_BARS = 6000     # a figure carries its every-device view up to this many bars


@dataclass
class TimelineData:
    rows: list[str]                                   # top to bottom
    bars: dict[str, list[dict]] = field(default_factory=dict)   # kind -> bars
    # row label ("dev3", "devices 0,8,...,120 (x16)") -> (times, total bytes, bytes by kind)
    memory: dict[str, tuple[list[float], list[float], list[tuple]]] = field(default_factory=dict)
    unit: str = "s"                                   # the trace's unit
    title: str = ""
    capacity: float | None = None                     # bytes per device, drawn as a line
    groups: list[DeviceGroup] = field(default_factory=list)
    time: tuple[float, str] = (1.0, "s")              # (factor, name) of the time axis
    key: str = ""                                     # what the bars' text means


def _free_comm(bars: dict[str, list[dict]]) -> str:
    """A second title line when the drawn rows have communication and none of it takes
    time (the uniform cost model's default): its rows would be empty with no word why."""
    comm = [b["duration"] for kind in bars.values() for b in kind
            if not b["row"].endswith(" compute")]
    if not comm or any(d > 0 for d in comm):
        return ""
    return ("<br><sup>communication is priced at 0 by this cost model (its bars have no width)"
            "<br>to see it: analytic or profiled costs, or comm= in the uniform one</sup>")


def timeline_data(trace, devices=None, group: bool = True) -> TimelineData:
    """Walk `trace` into rows, bars by kind and memory curves (see the module docstring):
    one row per group of identical replicas (or per device when not `group`) and stream."""
    groups = group_replicas(trace, devices, group)
    note = ""
    if devices is None and len(groups) > MAX_DEVICES:
        note = f" (first {MAX_DEVICES} of {len(groups)} rows; pass devices=[...])"
        groups = groups[:MAX_DEVICES]
    streams = stream_order(trace)
    label = {g.devices[0]: g.label for g in groups}
    rows = [f"{label[d]} {s}" for d in label for s in streams.get(d, [])]
    bars, memory = _bars(trace, label), _memory(trace, label)
    collapsed = sum(len(g.devices) for g in groups)
    where = f"{collapsed} devices" + (f" in {len(groups)} groups of identical replicas"
                                      if len(groups) < collapsed else "")
    title = (f"{trace.source.capitalize()} timeline: step {time_text(trace.step_time, trace.unit)}"
             f", {where}{note}{_free_comm(bars)}")
    return TimelineData(rows, bars, memory, trace.unit, title,
                        trace.meta.get("memory_capacity"), groups,
                        time_scale(trace.step_time, trace.unit), bar_marks(trace).key())


def _bars(trace, label: dict[int, str]) -> dict[str, list]:
    shared: dict[tuple, int] = defaultdict(int)
    for e in trace.events:
        if e.device in label and e.stream == "compute":
            shared[(e.device, e.start, e.end)] += 1
    marks = bar_marks(trace)
    seen: dict[tuple, int] = defaultdict(int)
    bars: dict[str, list[dict]] = defaultdict(list)
    for e in trace.events:
        if e.device not in label:
            continue
        span = (e.device, e.start, e.end)
        n = shared.get(span, 1) if e.stream == "compute" and e.end > e.start else 1
        k = seen[span] if n > 1 else 0
        if n > 1:
            seen[span] += 1
        kind = TP + e.kind if TP_LABEL.match(e.label) else e.kind
        bars[kind].append({"row": f"{label[e.device]} {e.stream}", "start": e.start,
                             "duration": e.end - e.start, "label": e.label or e.kind,
                             "node": e.node, "mb": e.mb, "text": marks.text(e),
                             "words": marks.words(e),
                             "width": 0.8 / n, "offset": -0.4 + k * 0.8 / n})
    return dict(bars)


def _memory(trace, label: dict[int, str]) -> dict[str, tuple]:
    memory: dict[str, tuple] = {}
    for m in sorted((m for m in trace.memory if m.device in label),
                    key=lambda m: (m.device, m.time)):
        t, v, kinds = memory.setdefault(label[m.device], ([], [], []))
        t.append(m.time)
        v.append(m.total)
        kinds.append(tuple(getattr(m, k) for k in MEMORY_KINDS))
    return memory


def draw_timeline(data: TimelineData, memory: bool = True, expanded: TimelineData | None = None):
    """Render `data` (walk-then-draw); with `expanded` (the same trace, every device), the
    figure carries both and two buttons switch between them."""
    from piper_nb.extras import require
    make_subplots = require("plotly.subplots", "the timeline figure").make_subplots
    with_mem = memory and bool(data.memory)
    fig = make_subplots(rows=2 if with_mem else 1, cols=1, shared_xaxes=True,
                        row_heights=[0.72, 0.28] if with_mem else [1.0], vertical_spacing=0.06)
    factor, tname = data.time
    div, bname = bytes_scale(max([max(v) for _, v, _ in data.memory.values()]
                                 + [data.capacity or 0], default=0))
    counts = [_add(fig, d, with_mem, factor, div, bname, visible=d is data)
              for d in ([data, expanded] if expanded is not None else [data])]
    fig.update_yaxes(type="category", categoryorder="array",
                     categoryarray=list(reversed(data.rows)), row=1, col=1)
    if with_mem:
        if data.capacity is not None:   # the device's memory: a plan fits below the line
            fig.add_hline(y=data.capacity / div, line_dash="dash", line_color="crimson",
                          annotation_text=f"capacity {data.capacity / div:.4g} {bname}",
                          annotation_position="top left", row=2, col=1)
        fig.update_yaxes(title_text=f"memory ({bname})", row=2, col=1)
    fig.update_xaxes(title_text=f"time ({tname})", row=2 if with_mem else 1, col=1)
    halves = any(b["width"] < 0.8 for bars in data.bars.values() for b in bars)
    top = (110 if expanded is not None else 70) + 16 * data.title.count("<br>")
    entries = len(data.bars) + (len(data.memory) + 1 if with_mem else 0)
    legend = legend_title(data.key)
    # room for the whole legend between the margins (80 px below): its title's lines, then
    # an entry of 20 px and the 12 px gap between groups each
    height = max(_height(len(data.rows), with_mem, halves),
                 top + 80 + 20 * (legend.count("<br>") + 1) + 32 * entries + 20)
    fig.update_layout(barmode="overlay", title=data.title, bargap=0.1, height=height,
                      uniformtext={"minsize": 8, "mode": "hide"},
                      legend={"title": {"text": legend}, "tracegroupgap": 12},
                      margin={"t": top})
    if expanded is not None:
        fig.update_layout(updatemenus=[_toggle(data, expanded, counts, with_mem, halves)])
    return fig


def legend_title(key: str) -> str:
    """The legend's title: "pass / op", and beneath it what the bars' text means."""
    lines = key.replace(", ", ",<br>", 1).replace(" (", "<br>(", 1) if key else ""
    return "pass / op" + (f"<br><span style='font-size: 11px'>{lines}</span>" if key else "")


def _height(rows: int, with_mem: bool, halves: bool = False) -> int:
    """Pixels for `rows` rows (taller when overlapped half bars must carry their text)."""
    return 180 + (40 if halves else 26) * rows + (200 if with_mem else 0)


def span_hover(i: int, unit: str) -> str:
    """Hover text of a bar whose customdata[i:i + 3] is `_span`'s [start, end, duration]
    (a horizontal bar's own %{x} is where it ends, not how long it takes)."""
    return (f"start %{{customdata[{i}]:.4g}}, end %{{customdata[{i + 1}]:.4g}}, "
            f"takes %{{customdata[{i + 2}]:.4g}} {unit}")


def bar_span(bar: dict, factor: float) -> list[float]:
    """[start, end, duration] of `bar` in the shown unit (`factor` per unit of the trace)."""
    start, duration = bar["start"] * factor, bar["duration"] * factor
    # to the digits the hover shows: a figure of thousands of bars stays small
    return [float(f"{x:.5g}") for x in (start, start + duration, duration)]


def _add(fig, data: TimelineData, with_mem: bool, factor: float, div: float, bname: str,
         visible: bool) -> int:
    """Add `data`'s bars (and memory curves) to `fig`; returns how many traces."""
    import plotly.graph_objects as go
    tname, n = data.time[1], 0
    for kind, bars in data.bars.items():
        fig.add_trace(go.Bar(
            orientation="h", name=kind, marker_color=COLORS.get(kind, "#999999"),
            visible=visible, legendgroup=kind, y=[b["row"] for b in bars],
            x=[b["duration"] * factor for b in bars],
            base=[b["start"] * factor for b in bars], width=[b["width"] for b in bars],
            offset=[b["offset"] for b in bars], text=[b["text"] for b in bars],
            textposition="inside", insidetextanchor="middle", textangle=0,
            customdata=[[b["label"], b["words"], b["node"], *bar_span(b, factor)] for b in bars],
            hovertemplate=("<b>%{customdata[0]}</b> (" + kind + ")<br>%{customdata[1]}<br>"
                           "node %{customdata[2]}<br>" + span_hover(3, tname) +
                           "<extra></extra>")), row=1, col=1)
        n += 1
    if not with_mem:
        return n
    hover = "<br>".join(f"{k} %{{customdata[{i}]:.3g}} {bname}" for i, k in enumerate(MEMORY_KINDS))
    for name, (t, v, kinds) in data.memory.items():
        fig.add_trace(go.Scatter(
            x=[x * factor for x in t], y=[x / div for x in v], mode="lines", line_shape="hv",
            name=name, visible=visible, legendgroup="memory",
            legendgrouptitle={"text": "memory"},
            customdata=[[float(f"{x / div:.4g}") for x in k] for k in kinds],
            hovertemplate=f"{name}: %{{y:.3g}} {bname}<br>{hover}<extra></extra>"), row=2, col=1)
        n += 1
    return n


def _toggle(data: TimelineData, expanded: TimelineData, counts: list[int], with_mem: bool,
            halves: bool):
    a, b = counts
    views = [("replicas grouped", data, [True] * a + [False] * b),
             ("every device", expanded, [False] * a + [True] * b)]
    return {"type": "buttons", "direction": "right", "x": 0, "xanchor": "left", "y": 1.0,
            "yanchor": "bottom", "pad": {"b": 6}, "showactive": True,
            "buttons": [{"label": name, "method": "update",
                         "args": [{"visible": vis},
                                  {"yaxis.categoryarray": list(reversed(d.rows)),
                                   "height": _height(len(d.rows), with_mem, halves),
                                   "title": d.title}]}
                        for name, d, vis in views]}


def timeline_figure(trace, devices=None, memory: bool = True, group: bool = True):
    """The plotly `go.Figure` of a Trace (see the module docstring): identical replicas
    share a row unless `group=False`; when that collapsed rows and every device fits in
    EXPAND_BARS bars, buttons in the figure expand them."""
    data = timeline_data(trace, devices, group)
    expanded = None
    if group and len(data.groups) < sum(len(g.devices) for g in data.groups):
        chosen = {d for g in data.groups for d in g.devices}
        if sum(e.device in chosen for e in trace.events) <= EXPAND_BARS:
            expanded = timeline_data(trace, sorted(chosen), group=False)
    return draw_timeline(data, memory, expanded)


def stream_order(trace) -> dict[int, list[str]]:
    """Device -> its streams, compute first, then the others by name."""
    out: dict[int, set[str]] = {}
    for e in trace.events:
        out.setdefault(e.device, set()).add(e.stream)
    return {d: sorted(s, key=lambda x: (x != "compute", x)) for d, s in sorted(out.items())}


def to_chrome_trace(trace, path: str | Path | None = None) -> dict:
    """The Chrome trace of `trace` as a dict (see the module docstring); also written as
    JSON to `path` when given."""
    scale = 1e6 if trace.unit == "s" else 1e3
    streams = stream_order(trace)
    events: list[dict] = []
    for d, names in streams.items():
        events.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0,
                       "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": d, "tid": 0,
                       "args": {"sort_index": d}})
        for tid, s in enumerate(names):
            events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid,
                           "args": {"name": s}})
    tids = {(d, s): i for d, names in streams.items() for i, s in enumerate(names)}
    for e in trace.events:
        events.append({"ph": "X", "name": e.label or e.kind, "cat": e.kind, "pid": e.device,
                       "tid": tids[(e.device, e.stream)], "ts": e.start * scale,
                       "dur": max(e.end - e.start, 0.0) * scale,
                       "args": {"node": e.node, "mb": e.mb, "region": e.region}})
    for m in trace.memory:
        events.append({"ph": "C", "name": "memory (bytes)", "pid": m.device, "tid": 0,
                       "ts": m.time * scale, "args": {k: getattr(m, k) for k in MEMORY_KINDS}})
    obj = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"source": trace.source, "unit": trace.unit,
                         "time_scale_us_per_unit": scale}}
    if path is not None:
        Path(path).write_text(json.dumps(obj))
    return obj
