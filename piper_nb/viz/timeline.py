"""Trace -> plotly timeline (one row per device and stream, memory over time beneath)
and Trace -> Chrome trace JSON.

Walk-then-draw (micrograd's `draw_dot`): `timeline_data` walks the trace into rows,
bars (grouped by kind, so the legend is the pass / op kind) and memory curves;
`draw_timeline` only renders them. Overlapped F&B slots (two compute events with the same
span) are drawn as two half-height bars sharing the slot.

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

from piper_nb.trace import MEMORY_KINDS

__all__ = ["COLORS", "TimelineData", "timeline_data", "draw_timeline", "timeline_figure",
           "to_chrome_trace", "stream_order"]

COLORS = {"F": "#4C78A8", "B": "#F58518", "BI": "#E45756", "BW": "#72B7B2", "U": "#54A24B",
          "SEND": "#B279A2", "RECV": "#FF9DA6", "ALL_REDUCE": "#9D755D",
          "ALL_GATHER": "#8CD17D", "REDUCE_SCATTER": "#EECA3B", "ALL_TO_ALL": "#79706E"}
MAX_DEVICES = 64


@dataclass
class TimelineData:
    rows: list[str]                                   # top to bottom
    bars: dict[str, list[dict]] = field(default_factory=dict)   # kind -> bars
    memory: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    unit: str = "s"
    title: str = ""
    capacity: float | None = None                     # bytes per device, drawn as a line


def _row(d: int, stream: str) -> str:
    return f"dev{d} {stream}"


def timeline_data(trace, devices=None) -> TimelineData:
    streams = stream_order(trace)
    chosen = sorted(streams) if devices is None else sorted(set(devices) & set(streams))
    note = ""
    if devices is None and len(chosen) > MAX_DEVICES:
        note = f" (first {MAX_DEVICES} of {len(chosen)} devices; pass devices=[...])"
        chosen = chosen[:MAX_DEVICES]
    keep = set(chosen)
    rows = [_row(d, s) for d in chosen for s in streams[d]]
    shared: dict[tuple, int] = defaultdict(int)
    for e in trace.events:
        if e.device in keep and e.stream == "compute":
            shared[(e.device, e.start, e.end)] += 1
    seen: dict[tuple, int] = defaultdict(int)
    bars: dict[str, list[dict]] = defaultdict(list)
    for e in trace.events:
        if e.device not in keep:
            continue
        span = (e.device, e.start, e.end)
        n = shared.get(span, 1) if e.stream == "compute" and e.end > e.start else 1
        k = seen[span] if n > 1 else 0
        if n > 1:
            seen[span] += 1
        bars[e.kind].append({"row": _row(e.device, e.stream), "start": e.start,
                             "duration": e.end - e.start, "label": e.label or e.kind,
                             "node": e.node, "mb": e.mb, "width": 0.8 / n,
                             "offset": -0.4 + k * 0.8 / n})
    memory = {}
    for m in sorted(trace.memory, key=lambda m: (m.device, m.time)):
        if m.device in keep:
            t, v = memory.setdefault(m.device, ([], []))
            t.append(m.time)
            v.append(m.total)
    title = f"{trace.source} timeline, step {trace.step_time:.4g} {trace.unit}{note}"
    return TimelineData(rows, dict(bars), memory, trace.unit, title,
                        trace.meta.get("memory_capacity"))


def _bytes_scale(peak: float) -> tuple[float, str]:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= div:
            return div, name
    return 1, "B"


def draw_timeline(data: TimelineData, memory: bool = True):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    with_mem = memory and bool(data.memory)
    fig = make_subplots(rows=2 if with_mem else 1, cols=1, shared_xaxes=True,
                        row_heights=[0.72, 0.28] if with_mem else [1.0], vertical_spacing=0.06)
    for kind, bars in data.bars.items():
        fig.add_trace(go.Bar(
            orientation="h", name=kind, marker_color=COLORS.get(kind, "#999999"),
            y=[b["row"] for b in bars], x=[b["duration"] for b in bars],
            base=[b["start"] for b in bars], width=[b["width"] for b in bars],
            offset=[b["offset"] for b in bars],
            customdata=[[b["label"], b["node"], b["mb"]] for b in bars],
            hovertemplate=("%{customdata[0]}<br>node %{customdata[1]}<br>microbatch "
                           "%{customdata[2]}<br>start %{base:.4g}, duration %{x:.4g} "
                           + data.unit + "<extra></extra>")), row=1, col=1)
    fig.update_yaxes(type="category", categoryorder="array",
                     categoryarray=list(reversed(data.rows)), row=1, col=1)
    if with_mem:
        top = max(max(v) for _, v in data.memory.values())
        div, name = _bytes_scale(max(top, data.capacity or 0))
        for d, (t, v) in data.memory.items():
            fig.add_trace(go.Scatter(x=t, y=[x / div for x in v], mode="lines", line_shape="hv",
                                     name=f"dev{d} memory", legendgroup="memory",
                                     hovertemplate=f"dev{d}: %{{y:.4g}} {name}<extra></extra>"),
                          row=2, col=1)
        if data.capacity is not None:   # the device's memory: a plan fits below the line
            fig.add_hline(y=data.capacity / div, line_dash="dash", line_color="crimson",
                          annotation_text=f"capacity {data.capacity / div:.4g} {name}",
                          annotation_position="top left", row=2, col=1)
        fig.update_yaxes(title_text=f"memory ({name})", row=2, col=1)
        fig.update_xaxes(title_text=f"time ({data.unit})", row=2, col=1)
    else:
        fig.update_xaxes(title_text=f"time ({data.unit})", row=1, col=1)
    fig.update_layout(barmode="overlay", title=data.title, bargap=0.1,
                      height=220 + 22 * len(data.rows) + (180 if with_mem else 0),
                      legend={"orientation": "h", "y": -0.12})
    return fig


def timeline_figure(trace, devices=None, memory: bool = True):
    """The plotly `go.Figure` of a Trace (see the module docstring)."""
    return draw_timeline(timeline_data(trace, devices), memory)


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
