"""Measuring a step: a clock aligned at the step start and a recorder of events and memory.

On CPU every time is `time.perf_counter()` minus the step start (taken right after the
barrier that starts the step on all workers). On CUDA, times are CUDA events on the stream
that did the work, resolved against an event recorded at the step start once the step has
synchronised, so kernels are timed where they run, not where they were launched. The
recorder turns instruction timings into `trace.Event`s and memory counts into
`MemorySample`s, the types the simulator produces, so both are drawn by the same code.
"""

from __future__ import annotations

import time

import torch

from piper_nb.plan.instr import Instr
from piper_nb.trace import Event, MemorySample

__all__ = ["Clock", "Recorder"]


class Clock:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.ref = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Host seconds since the step start."""
        return time.perf_counter() - self.t0

    def mark(self):
        """A point in time: a host time on CPU, an event on the current CUDA stream."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def resolve(self, mark) -> float:
        if mark is None or isinstance(mark, float):
            return mark
        return self.ref.elapsed_time(mark) / 1000.0

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


class Recorder:
    """Events and memory samples of one device for one step (resolved at the end)."""

    def __init__(self, device: int, clock: Clock):
        self.device, self.clock = device, clock
        self._events: list[tuple[Instr, object, object]] = []
        self._memory: list[tuple[object, tuple[int, ...]]] = []

    def event(self, ins: Instr, start, end) -> None:
        self._events.append((ins, start, end))

    def memory(self, mark, params: int, grads: int, optim: int, activations: int,
               buffers: int) -> None:
        self._memory.append((mark, (params, grads, optim, activations, buffers)))

    def resolve(self) -> tuple[list[Event], list[MemorySample]]:
        self.clock.finish()
        events = []
        for ins, start, end in self._events:
            s, e = self.clock.resolve(start), self.clock.resolve(end)
            events.append(Event(self.device, ins.stream, ins.node, ins.kind, s, max(e, s),
                                ins.mb, ins.region, str(ins)))
        memory = [MemorySample(self.device, self.clock.resolve(m), *counts)
                  for m, counts in self._memory]
        return events, memory
