"""Traces: timed events per device and stream, plus memory over time.

The simulator predicts a Trace and the runtime measures one: the same type, so predicted
and measured timelines are drawn and compared by the same code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["Event", "MemorySample", "Trace", "MEMORY_KINDS"]

MEMORY_KINDS = ("params", "grads", "optim", "activations", "buffers")


@dataclass(frozen=True, slots=True)
class Event:
    device: int
    stream: str
    node: str       # DAG node id
    kind: str       # instruction kind: F, B, BI, BW, U, SEND, RECV, ALL_REDUCE, ...
    start: float    # seconds (or cost-model units) from the step start
    end: float
    mb: int = -1
    region: int = -1
    label: str = ""  # the instruction's text form, e.g. 0F1

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class MemorySample:
    device: int
    time: float
    params: int = 0
    grads: int = 0
    optim: int = 0
    activations: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.activations + self.buffers


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

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "unit": self.unit, "meta": self.meta,
                           "events": [asdict(e) for e in self.events],
                           "memory": [asdict(m) for m in self.memory]})

    @classmethod
    def from_json(cls, text: str) -> Trace:
        obj = json.loads(text)
        return cls(tuple(Event(**e) for e in obj["events"]),
                   tuple(MemorySample(**m) for m in obj["memory"]), obj["source"], obj["unit"],
                   obj.get("meta", {}))
