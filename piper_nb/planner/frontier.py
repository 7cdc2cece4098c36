"""The search's trade-off as a picture: each candidate's step time against its peak memory.

`pareto` finds the candidates no other beats on both (faster and lighter); `points` lists
what the figure draws in a fixed order, so a point's index (its `customdata`) names its
candidate; `figure` draws them: one colour per schedule, simulated candidates filled and
estimated ones hollow, the Pareto frontier as a line through its points, the device's
memory as a vertical line (in the title when it lies far beyond every point), and refused
candidates that have a time (refused by the estimate's or the memory model's peak) in
grey with their reason on hover. The step axis frames the candidates that fit (refused
ones far off it are a double-click away). Walk, then draw: values first, figure last.
"""

from __future__ import annotations

import math

from piper_nb.planner.candidate import Candidate, Status
from piper_nb.planner.knobs import Schedule
from piper_nb.viz.units import bytes_scale, bytes_text, time_scale, time_text

__all__ = ["pareto", "points", "figure", "REFUSED_SHOWN", "SCHEDULE_COLOURS"]

# refused candidates drawn at most (the lightest first: those closest to fitting); a 70B
# search refuses thousands, which would only hide the ones that fit
REFUSED_SHOWN = 300
# the device's memory is drawn as a line when within this factor of the heaviest point
CAPACITY_REACH = 2.0
SCHEDULE_COLOURS = {Schedule.NONE: "#4c78a8", Schedule.GPIPE: "#f58518",
                    Schedule.ONE_F_ONE_B: "#54a24b", Schedule.INTERLEAVED: "#b279a2",
                    Schedule.ZB1P: "#e45756", Schedule.DUALPIPEV: "#72b7b2"}
_NAMES = {Schedule.NONE: "no pipeline", Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B",
          Schedule.INTERLEAVED: "interleaved", Schedule.ZB1P: "ZB1P",
          Schedule.DUALPIPEV: "DualPipeV"}
_GREY = "#b0b0b0"


def _timed(c: Candidate) -> bool:
    return (c.step is not None and c.peak is not None and math.isfinite(c.step)
            and math.isfinite(c.peak))


def pareto(candidates) -> list[Candidate]:
    """The candidates no other is both faster and lighter than, lightest first."""
    out, fastest = [], math.inf
    for c in sorted((c for c in candidates if _timed(c)), key=lambda c: (c.peak, c.step)):
        if c.step < fastest:
            out.append(c)
            fastest = c.step
    return out


def points(result) -> list[Candidate]:
    """What the figure draws, in order: the ranked, the estimated, then the refused that
    have a time (at most `REFUSED_SHOWN`, lightest first)."""
    refused = sorted((c for c in result.refused if _timed(c)), key=lambda c: c.peak)
    return ([c for c in result.ranked + result.estimated if _timed(c)]
            + refused[:REFUSED_SHOWN])


def _hover(c: Candidate, unit: str) -> str:
    text = (f"{c.knobs.label()}<br>step {time_text(c.step, unit)}, peak "
            f"{bytes_text(c.peak)}<br>{c.status}")
    return text + (f": {c.reason}" if c.reason else "")


def figure(result, *, unit: str = "s", height: int = 440):
    """Step time against peak memory for the candidates of `result` (a `SearchResult`;
    see the module docstring); each marker's `customdata` is its index in `points(result)`."""
    import plotly.graph_objects as go
    drawn = points(result)
    fig = go.Figure()
    if not drawn:
        fig.update_layout(height=height, title="no candidate has a time to draw",
                          xaxis={"visible": False}, yaxis={"visible": False})
        return fig
    cap = result.capacity
    heaviest = max(c.peak for c in drawn)
    # the device's memory as a line where it is near the points; far above them (a small
    # model on a large GPU) it would squash every point against the axis: said in the title
    near = math.isfinite(cap) and cap <= CAPACITY_REACH * heaviest
    bdiv, bname = bytes_scale(max(heaviest, cap) if near else heaviest)
    tfac, tname = time_scale(max(c.step for c in drawn), unit)
    x = lambda c: c.peak / bdiv           # noqa: E731
    y = lambda c: c.step * tfac           # noqa: E731
    grey = [i for i, c in enumerate(drawn) if c.status is Status.REFUSED]
    if grey:
        shown = len(grey)
        total = sum(_timed(c) for c in result.refused)
        fig.add_trace(go.Scatter(
            x=[x(drawn[i]) for i in grey], y=[y(drawn[i]) for i in grey], mode="markers",
            name=f"refused ({shown} of {total})" if total > shown else "refused",
            marker={"color": _GREY, "size": 7, "symbol": "x", "opacity": 0.7},
            customdata=grey, hovertext=[_hover(drawn[i], unit) for i in grey],
            hoverinfo="text"))
    for schedule in Schedule:
        mine = [i for i, c in enumerate(drawn)
                if c.status is not Status.REFUSED and c.knobs.schedule is schedule]
        if not mine:
            continue
        fig.add_trace(go.Scatter(
            x=[x(drawn[i]) for i in mine], y=[y(drawn[i]) for i in mine], mode="markers",
            name=_NAMES[schedule], customdata=mine, hoverinfo="text",
            hovertext=[_hover(drawn[i], unit) for i in mine],
            marker={"color": SCHEDULE_COLOURS[schedule], "size": 10, "line": {"width": 2},
                    "symbol": ["circle" if drawn[i].status is Status.SIMULATED
                               else "circle-open" for i in mine]}))
    front = pareto(c for c in drawn if c.status is not Status.REFUSED)
    if len(front) > 1:
        fig.add_trace(go.Scatter(x=[x(c) for c in front], y=[y(c) for c in front],
                                 mode="lines", name="Pareto frontier", hoverinfo="skip",
                                 line={"color": "#333", "dash": "dot", "shape": "hv"}))
    # the step axis frames the candidates that fit; refused ones far off it stay a
    # double-click (autoscale) away rather than squash them
    fitting = [y(c) for c in drawn if c.status is not Status.REFUSED] or [y(c) for c in drawn]
    pad = max(0.1 * (max(fitting) - min(fitting)), 0.02 * max(fitting))
    lo, hi = min(fitting) - pad, max(fitting) + pad
    hidden = sum(not lo <= y(c) <= hi for c in drawn)
    if near:
        fig.add_trace(go.Scatter(x=[cap / bdiv] * 2, y=[lo, hi], mode="lines",
                                 name=f"device memory {bytes_text(cap)}", hoverinfo="skip",
                                 line={"color": "#c00", "width": 1.5}))
    fig.update_layout(
        height=height, margin={"l": 60, "r": 10, "t": 40, "b": 50},
        title={"text": f"{len(drawn)} candidates: filled simulated, hollow estimated"
                       + (f"; a device holds {bytes_text(cap)}"
                          if math.isfinite(cap) and not near else "")
                       + (f"; {hidden} refused off the axis: double-click" if hidden
                          else ""),
               "x": 0, "xref": "paper", "xanchor": "left", "font": {"size": 13}},
        xaxis_title=f"peak memory per device ({bname})", yaxis_title=f"step time ({tname})",
        yaxis_range=[lo, hi],
        legend={"title": {"text": "schedule"}}, hovermode="closest",
        template="plotly_white")
    return fig
