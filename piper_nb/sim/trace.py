"""Traces: timed events per device and stream, plus memory over time.

The simulator predicts a Trace and the runtime measures one: the same type, so predicted
and measured timelines are drawn and compared by the same code. Its events and memory
samples are the leaf types of `piper_nb.trace` (the runtime makes them too, without
importing the simulator). The analysis methods
delegate to `sim/analysis.py` (bubbles, peak memory, comparison) and the drawing ones to
`viz/` (plotly timeline, Chrome trace).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from piper_nb.trace import MEMORY_KINDS, Event, MemorySample

__all__ = ["Event", "MemorySample", "Trace", "MEMORY_KINDS"]

@dataclass(frozen=True)
class Trace:
    events: tuple[Event, ...]
    memory: tuple[MemorySample, ...] = ()
    source: str = "simulated"   # "simulated" | "measured"
    unit: str = "s"
    meta: dict = field(default_factory=dict)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted({e.device for e in self.events} | {m.device for m in self.memory}))

    @property
    def step_time(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def events_of(self, device: int) -> tuple[Event, ...]:
        """`device`'s events, in the trace's order (a trace standing for replicas expands
        that device alone)."""
        return tuple(e for e in self.events if e.device == device)

    def memory_of(self, device: int) -> tuple[MemorySample, ...]:
        """`device`'s memory samples, in the trace's order (as `events_of`)."""
        return tuple(m for m in self.memory if m.device == device)

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "unit": self.unit, "meta": self.meta,
                           "events": [asdict(e) for e in self.events],
                           "memory": [asdict(m) for m in self.memory]})

    # ---- analysis (sim/analysis.py) -------------------------------------------------
    def bubble(self, device: int) -> float:
        """Idle time of `device`'s compute stream between the step start and end."""
        from piper_nb.sim.analysis import bubble
        return bubble(self, device)

    def bubble_fraction(self, device: int | None = None) -> float:
        """bubble / step time for `device`; None: the mean over devices."""
        from piper_nb.sim.analysis import bubble_fraction
        return bubble_fraction(self, device)

    @property
    def peak_memory(self) -> dict[int, int]:
        """Device -> peak bytes over the step."""
        from piper_nb.sim.analysis import peak_memory
        return peak_memory(self)

    @property
    def memory_capacity(self) -> float | None:
        """Bytes of memory per device, when the cost model knew its hardware."""
        return self.meta.get("memory_capacity")

    def over_capacity(self, capacity: float | None = None) -> list[str]:
        """The devices whose peak exceeds `capacity` (default: `memory_capacity`), each
        with its peak and largest kind of memory; empty when the plan fits."""
        from piper_nb.sim.analysis import over_capacity
        return over_capacity(self, capacity)

    def fits(self, capacity: float | None = None) -> bool:
        """Whether every device's peak memory is within `capacity` (default: the hardware's)."""
        return not self.over_capacity(capacity)

    def live_stashes(self, device: int) -> int:
        """Peak count of activation stashes (region, microbatch) alive on `device`."""
        from piper_nb.sim.analysis import live_stashes
        return live_stashes(self, device)

    def compare(self, other: Trace):
        """Predicted vs measured per instruction and step time (a `Comparison`)."""
        from piper_nb.sim.analysis import compare
        return compare(self, other)

    # ---- drawing (viz/) ---------------------------------------------------------------
    def figure(self, devices=None, memory: bool = True, group: bool = True):
        """A plotly figure: one row per device (identical replicas share one row, with a
        count, unless `group=False`) and stream, memory over time beneath."""
        from piper_nb.viz.timeline import timeline_figure
        return timeline_figure(self, devices=devices, memory=memory, group=group)

    def to_chrome_trace(self, path=None) -> dict:
        """Chrome trace JSON (opens in Perfetto); written to `path` when given."""
        from piper_nb.viz.timeline import to_chrome_trace
        return to_chrome_trace(self, path)

    @classmethod
    def from_json(cls, text: str) -> Trace:
        obj = json.loads(text)
        return cls(tuple(Event(**e) for e in obj["events"]),
                   tuple(MemorySample(**m) for m in obj["memory"]), obj["source"], obj["unit"],
                   obj.get("meta", {}))
