"""The atoms of a timeline, shared by the simulator and the runtime: `Event` (one timed
instruction on a device and stream) and `MemorySample` (bytes held per kind after an
instruction). A leaf: the runtime records them and the simulator predicts them without
either importing the other; `sim.trace.Trace` holds a step's worth of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Event", "MemorySample", "Memory", "MEMORY_KINDS"]


class Memory(IntEnum):
    """The kinds of bytes a device holds: `MemorySample`'s fields, in order (`.field`)."""

    PARAMS = 0
    GRADS = 1
    OPTIM = 2
    ACTIVATIONS = 3
    BUFFERS = 4

    @property
    def field(self) -> str:
        """The `MemorySample` field that counts this kind (`params`, `grads`, ...)."""
        return self.name.lower()


MEMORY_KINDS = tuple(m.field for m in Memory)   # the field names, in Memory's order


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
