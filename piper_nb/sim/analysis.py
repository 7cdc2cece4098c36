"""What a Trace says: bubbles, peak memory, and predicted-vs-measured comparison.

Definitions (the ones the tests and the DualPipe table use): the step spans from the
earliest event start to the latest event end over all devices; a device's bubble is the
time inside that span its compute stream is idle (the span minus the union of its
compute events, overlapped F&B slots counted once); the bubble fraction is bubble / span,
and the overall fraction is the mean over devices.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op
from piper_nb.trace import MEMORY_KINDS

__all__ = ["live_stashes", "step_window", "busy_time", "bubble", "bubble_fraction", "peak_memory",
           "over_capacity", "compare",
           "Comparison"]


def step_window(trace) -> tuple[float, float]:
    if not trace.events:
        return 0.0, 0.0
    return min(e.start for e in trace.events), max(e.end for e in trace.events)


def busy_time(trace, device: int, stream: str = "compute") -> float:
    """Length of the union of `device`'s events on `stream`."""
    return _union([(e.start, e.end) for e in trace.events
                   if e.device == device and e.stream == stream])


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the (start, end) `spans`."""
    spans = sorted(spans)
    total, lo, hi = 0.0, None, None
    for s, e in spans:
        if hi is None or s > hi:
            if hi is not None:
                total += hi - lo
            lo, hi = s, e
        elif e > hi:
            hi = e
    return total + (hi - lo if hi is not None else 0.0)


def bubble(trace, device: int) -> float:
    """Idle time of `device`'s compute stream between the step start and the step end."""
    t0, t1 = step_window(trace)
    return (t1 - t0) - busy_time(trace, device)


def bubble_fraction(trace, device: int | None = None) -> float:
    t0, t1 = step_window(trace)
    if t1 <= t0:
        return 0.0
    if device is not None:
        return bubble(trace, device) / (t1 - t0)
    spans: dict[int, list] = defaultdict(list)   # one pass over the events, not one a device
    for e in trace.events:
        if e.stream == "compute":
            spans[e.device].append((e.start, e.end))
    if not spans:
        return 0.0
    idle = sum((t1 - t0) - _union(spans[d]) for d in sorted(spans))
    return idle / len(spans) / (t1 - t0)


def peak_memory(trace) -> dict[int, int]:
    out: dict[int, int] = {}
    for m in trace.memory:
        out[m.device] = max(out.get(m.device, 0), m.total)
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def over_capacity(trace, capacity: float | None = None) -> list[str]:
    """One line per device whose peak exceeds `capacity` bytes (default: the trace's
    `memory_capacity`, set by a cost model that knows its hardware): the device, its peak
    and the largest kind of memory at the peak."""
    capacity = trace.meta.get("memory_capacity") if capacity is None else capacity
    if capacity is None:
        raise PlanError("this trace knows no device memory: simulate with "
                        "pn.CostModel.analytic(plan, 'H100') or pass capacity= in bytes")
    peaks: dict[int, object] = {}
    for m in trace.memory:
        if m.device not in peaks or m.total > peaks[m.device].total:
            peaks[m.device] = m
    out = []
    for d, m in sorted(peaks.items()):
        if m.total > capacity:
            kind = max(MEMORY_KINDS, key=lambda k: getattr(m, k))
            out.append(f"device {d} peaks at {gib(m.total)} of {gib(capacity)} "
                       f"(largest: {kind} {gib(getattr(m, kind))})")
    return out


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured durations per instruction, and the step-time ratio."""

    rows: tuple[tuple[int, str, float, float, float], ...]  # device, label, pred, meas, ratio
    predicted_step: float
    measured_step: float
    unmatched: int = 0

    @property
    def step_ratio(self) -> float:
        return self.measured_step / self.predicted_step if self.predicted_step else float("inf")

    def worst(self, n: int = 10) -> list[tuple]:
        """The n rows whose measured/predicted ratio is furthest from 1."""
        def off(r):
            return abs(r[4] - 1) if r[4] == r[4] and r[4] != float("inf") else float("inf")
        return sorted(self.rows, key=off, reverse=True)[:n]

    def table(self, limit: int | None = 20) -> str:
        """Markdown: one row per instruction (`limit` rows, the worst first; None: all)."""
        rows = self.worst(limit) if limit is not None else list(self.rows)
        lines = ["| device | instruction | predicted | measured | measured/predicted |",
                 "|---|---|---|---|---|"]
        lines += [f"| {d} | {lab} | {p:.6g} | {m:.6g} | {r:.3g} |" for d, lab, p, m, r in rows]
        lines.append(f"| all | step | {self.predicted_step:.6g} | {self.measured_step:.6g} | "
                     f"{self.step_ratio:.3g} |")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.table()

    def __str__(self) -> str:
        return self.table()


def _keyed(trace) -> dict[tuple, float]:
    seen: dict[tuple, int] = defaultdict(int)
    out = {}
    for e in sorted(trace.events, key=lambda e: (e.device, e.start, e.end)):
        k = seen[(e.device, e.label or e.node)]
        seen[(e.device, e.label or e.node)] = k + 1
        out[(e.device, e.label or e.node, k)] = e.duration
    return out


def compare(predicted, measured) -> Comparison:
    """Match events by (device, label, occurrence); a simulated trace is the prediction."""
    if predicted.source == "measured" and measured.source == "simulated":
        predicted, measured = measured, predicted
    a, b = _keyed(predicted), _keyed(measured)
    rows = []
    for key in sorted(a.keys() & b.keys()):
        p, m = a[key], b[key]
        rows.append((key[0], key[1], p, m, m / p if p else (1.0 if not m else float("inf"))))
    return Comparison(tuple(rows), predicted.step_time, measured.step_time,
                      len(a.keys() ^ b.keys()))


def live_stashes(trace, device: int) -> int:
    """Peak number of (region, microbatch) activation stashes alive on `device`: each lives
    from the start of its F to the end of its last backward (B, or BW when split)."""
    born, last = {}, {}
    rank = {Op.BI: 0, Op.B: 1, Op.BW: 1}
    for e in trace.events:
        if e.device != device or e.stream != "compute":
            continue
        key = (e.region, e.mb)
        if e.kind == Op.F:
            born[key] = e.start
        elif e.kind in rank:
            old = last.get(key)
            if old is None or (rank[e.kind], e.end) >= (rank[old[0]], old[1]):
                last[key] = (e.kind, e.end)
    marks = [(t, 1) for t in born.values()] + [(v[1], -1) for k, v in last.items() if k in born]
    peak = alive = 0
    for _, step in sorted(marks):
        alive += step
        peak = max(peak, alive)
    return peak
