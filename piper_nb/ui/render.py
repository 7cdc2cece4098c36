"""What the Designer's views show, as plain values: HTML strings and plotly figures.

The widget layer copies these into long-lived widgets (an HTML's `value`, a
`FigureWidget`'s traces and layout), so everything here is testable without a front end:
the status line, the plan grid, the problems list, the memory figure (peak per device
beside memory over time), an empty placeholder figure, and for a launch the loss curve and
the predicted and measured timelines stacked in one figure, row for row.
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from piper_nb.ui.compute import Outcome, Problem
from piper_nb.viz.units import bytes_scale, bytes_text, time_scale, time_text

__all__ = ["summary_html", "grid_html", "problems_html", "memory_figure", "placeholder_figure",
           "loss_figure", "timeline_figure", "comparison_figure", "bytes_text"]


def summary_html(outcome: Outcome, refresh_seconds: float | None = None) -> str:
    """One status line: step time, bubble, peak memory, problems, refresh time."""
    parts = []
    if outcome.trace is not None:
        tr = outcome.trace
        peak = max(tr.peak_memory.values(), default=0)
        parts += [f"step <b>{time_text(tr.step_time, tr.unit)}</b>",
                  f"bubble <b>{tr.bubble_fraction():.0%}</b>",
                  f"peak memory <b>{bytes_text(peak)}</b>",
                  f"{outcome.plan.world} devices x {outcome.plan.microbatches} microbatches"]
    if outcome.problems:
        n = len(outcome.problems)
        parts.append(f"<span class='pn-bad'>{n} problem{'s' if n > 1 else ''}</span>")
    elif outcome.plan is not None:
        parts.append("<span class='pn-good'>plan checked</span>")
    if refresh_seconds is not None:
        parts.append(f"<span class='pn-muted'>refreshed in {refresh_seconds * 1000:.0f} ms</span>")
    return "<div class='pn-summary'>" + " &middot; ".join(parts) + "</div>"


def grid_html(plan) -> str:
    """The per-device instruction grid (`plan.grid()`), monospace."""
    if plan is None:
        return "<p class='pn-muted'>No plan: see Problems.</p>"
    return grid_pre(plan.grid())


def grid_pre(text: str) -> str:
    """An instruction grid's text, monospace, scrolling past 520 px."""
    return ("<pre class='pn-grid' style='font-family: monospace; font-size: 12px; "
            f"line-height: 1.25; overflow: auto; max-height: 520px'>{html.escape(text)}</pre>")


def problems_html(problems: list[Problem]) -> str:
    """Each problem as a readable entry naming its row or layer (no tracebacks)."""
    if not problems:
        return "<p class='pn-good'>No problems: the plan compiles, passes its checks and simulates.</p>"
    items = []
    for p in problems:
        style = " style='color: #b00020'" if p.stage == "memory" else ""   # does not fit
        first, _, rest = p.message.partition("\n")   # a deadlock's grid: folded, monospace
        more = f"<details><summary>details</summary>{grid_pre(rest)}</details>" if rest else ""
        items.append(f"<li class='pn-problem pn-{p.stage}'{style} "
                     f"data-row='{'' if p.row is None else p.row}'>"
                     f"<b>{html.escape(p.where)}</b>: {html.escape(first)}{more}</li>")
    return "<ul class='pn-problems'>" + "".join(items) + "</ul>"


def placeholder_figure(message: str, height: int = 260) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(height=height, title=message, xaxis={"visible": False},
                      yaxis={"visible": False})
    return fig


def timeline_figure(trace, title: str | None = None, group: bool = True) -> go.Figure:
    """The trace's timeline without the memory strip (the Memory tab has it); identical
    replicas share a row when `group`."""
    from piper_nb.viz.timeline import timeline_figure as draw
    if trace is None:
        return placeholder_figure("no timeline: see Problems")
    fig = draw(trace, memory=False, group=group)
    if title:
        fig.update_layout(title=f"{title}: {fig.layout.title.text}")
    return fig


def memory_figure(trace) -> go.Figure:
    """Peak bytes per device (bars) beside bytes over the step per device (lines)."""
    if trace is None or not trace.memory:
        return placeholder_figure("no memory trace: see Problems")
    peaks = trace.peak_memory
    div, unit = bytes_scale(max(peaks.values(), default=0))
    factor, tname = time_scale(trace.step_time, trace.unit)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.3, 0.7],
                        subplot_titles=("peak per device", "over the step"))
    devs = sorted(peaks)
    fig.add_trace(go.Bar(x=[f"dev{d}" for d in devs], y=[peaks[d] / div for d in devs],
                         name="peak", marker_color=[device_color(d) for d in devs],
                         showlegend=False,
                         hovertemplate="%{x}: %{y:.4g} " + unit + "<extra></extra>"), row=1, col=1)
    series: dict[int, tuple[list, list]] = {}
    for m in sorted(trace.memory, key=lambda m: (m.device, m.time)):
        t, v = series.setdefault(m.device, ([], []))
        t.append(m.time * factor)
        v.append(m.total / div)
    for d, (t, v) in series.items():
        fig.add_trace(go.Scatter(x=t, y=v, mode="lines", line_shape="hv", name=f"dev{d}",
                                 line={"color": device_color(d)},
                                 hovertemplate=f"dev{d}: %{{y:.4g}} {unit}<extra></extra>"),
                      row=1, col=2)
    fig.update_yaxes(title_text=f"memory ({unit})", row=1, col=1)
    fig.update_yaxes(title_text=f"memory ({unit})", row=1, col=2)
    fig.update_xaxes(title_text=f"time ({tname})", row=1, col=2)
    fig.update_layout(height=340, title=f"{trace.source.capitalize()} memory: peak "
                      f"{bytes_text(max(peaks.values(), default=0))}")
    return fig


def device_color(d: int) -> str:
    """Device d's colour in every figure of the Designer (plotly's own cycle)."""
    return qualitative.Plotly[d % len(qualitative.Plotly)]


def round_ticks(top: float, ticks: int = 4) -> dict:
    """An axis from 0 past `top` with ticks at round values (1, 2 or 5 x 10^k apart), as
    plotly layout keys: a constant learning rate of 0.1 reads 0, 0.05, 0.1, not 0.0011,
    0.0399, 0.0786."""
    if not top > 0:
        return {"rangemode": "tozero"}
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    end = math.ceil(top / step * (1 + 1e-9)) * step
    if end - top < step * 0.2:                 # room above the largest value
        end += step
    return {"range": [0, end], "tick0": 0, "dtick": step, "tickformat": "~g"}


def loss_figure(losses: list[float], reference: list[float] | None = None,
                steps: int | None = None, lrs: list[float] | None = None) -> go.Figure:
    """The launch's loss per step beside the single-process reference, and the learning
    rate each step used (right axis)."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(range(1, len(losses) + 1)), y=list(losses),
                             mode="lines+markers", name="piper_nb"))
    fig.add_trace(go.Scatter(x=list(range(1, len(reference or []) + 1)), y=list(reference or []),
                             mode="lines", name="reference", line={"dash": "dash"}))
    fig.add_trace(go.Scatter(x=list(range(1, len(lrs or []) + 1)), y=list(lrs or []),
                             mode="lines", name="learning rate", yaxis="y2",
                             line={"color": "#999", "width": 1}))
    xrange = [0.5, (steps or max(len(losses), 1)) + 0.5]
    fig.update_layout(height=280, title="Loss and learning rate per step",
                      xaxis={"title": "step", "range": xrange, "dtick": 1},
                      yaxis={"title": "loss"},
                      yaxis2={"title": "learning rate", "overlaying": "y", "side": "right",
                              "showgrid": False, **round_ticks(max(lrs or [0.0]))},
                      legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02,
                              "yanchor": "bottom"})
    return fig


def comparison_figure(predicted, measured) -> go.Figure:
    """Predicted (top) and measured (below) timelines stacked, on the same rows (one per
    device and stream, replicas not grouped: a measured run's replicas never run alike)
    and, when both clocks are in one unit, on one time axis; one legend by kind, outside
    the plot area."""
    from piper_nb.viz.timeline import COLORS, bar_span, legend_title, span_hover, timeline_data
    if predicted is None or measured is None:
        return placeholder_figure("predicted and measured timelines appear after a launch")
    sides = [timeline_data(predicted, group=False), timeline_data(measured, group=False)]
    rows = list(dict.fromkeys([*sides[0].rows, *sides[1].rows]))
    same_clock = sides[0].unit == sides[1].unit
    if same_clock:   # one scale for both, chosen by the longer step
        longer = max(predicted, measured, key=lambda t: t.step_time)
        scales = [time_scale(longer.step_time, longer.unit)] * 2
    else:
        scales = [d.time for d in sides]
    height = 220 + 2 * 24 * len(rows)
    # room between the halves for the upper axis's title (two clocks) and the lower title
    gap = (45 if same_clock else 90) / (height - 100)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=same_clock, vertical_spacing=gap,
                        subplot_titles=(
                            f"predicted: step {time_text(predicted.step_time, predicted.unit)}",
                            f"measured: step {time_text(measured.step_time, measured.unit)}"))
    shown: set[str] = set()
    for at, (data, (scale, tname)) in enumerate(zip(sides, scales, strict=True), start=1):
        for kind, bars in data.bars.items():
            fig.add_trace(go.Bar(
                orientation="h", name=kind, legendgroup=kind, showlegend=kind not in shown,
                marker_color=COLORS.get(kind, "#999999"), y=[b["row"] for b in bars],
                x=[b["duration"] * scale for b in bars], base=[b["start"] * scale for b in bars],
                width=[b["width"] for b in bars], offset=[b["offset"] for b in bars],
                text=[b["text"] for b in bars], textposition="inside", textangle=0,
                customdata=[[b["label"], *bar_span(b, scale)] for b in bars],
                hovertemplate="%{customdata[0]}: " + span_hover(1, tname) + "<extra></extra>"),
                row=at, col=1)
            shown.add(kind)
        fig.update_yaxes(type="category", categoryorder="array",
                         categoryarray=list(reversed(rows)), row=at, col=1)
        if not same_clock or at == 2:
            fig.update_xaxes(title_text=f"time ({tname})", showticklabels=True, row=at, col=1)
    fig.update_layout(barmode="overlay", bargap=0.1, height=height,
                      uniformtext={"minsize": 8, "mode": "hide"},
                      legend={"title": {"text": legend_title(sides[0].key)}, "x": 1.02,
                              "xanchor": "left"},
                      margin={"t": 60})
    return fig
