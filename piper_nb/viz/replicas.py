"""What a timeline shows at scale: devices grouped into identical replicas, and the mark
each bar carries (its microbatch, and its chunk or direction where the schedule has them).

Both read only a Trace's public face (`events`, `memory`, `devices`), however the trace
stores them.

Grouping: a data-parallel replica of a pipeline stage runs the same instructions at the
same times as its peers, with only device ids (peers, groups) differing. Devices whose
events agree on (stream, kind, start, end, microbatch, region) and whose memory agrees on
every sample collapse into one `DeviceGroup`, drawn as one row labelled
"devices 0,8,16,...,120 (x16)".

Marks, as in the schedule pictures of DualPipe (deepseek-ai/DualPipe) and PyTorch's
pipelining docs, where each cell carries its microbatch: a bar's text is its microbatch;
on a device holding several regions a compute bar adds its chunk, the region's rank among
the device's regions ("3c1"; in interleaved 1F1B and DualPipeV, the pipeline chunk; the
hover names the region itself, which a trace knows by index only); when microbatches enter the
pipeline at different devices (full DualPipe's two directions) a compute bar adds its
direction instead, down from the lower device or up from the higher ("3\u2193" and
"3\u2191", arrows down and up).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from piper_nb.ir.kinds import PASSES, Op

__all__ = ["DeviceGroup", "group_replicas", "group_label", "Marks", "bar_marks"]

_PASSES = frozenset(k.value for k in PASSES)
_ARROWS = ("\u2193", "\u2191")      # down (entered at the lower device), up


@dataclass(frozen=True)
class DeviceGroup:
    """Devices drawn as one row; `devices[0]` is the one whose events are drawn."""

    devices: tuple[int, ...]

    @property
    def label(self) -> str:
        return group_label(self.devices)


def group_label(devices: tuple[int, ...]) -> str:
    """"dev3" for one device, "devices 0,8,16,...,120 (x16)" for several."""
    if len(devices) == 1:
        return f"dev{devices[0]}"
    shown = devices if len(devices) <= 4 else (*devices[:3], "...", devices[-1])
    return f"devices {','.join(map(str, shown))} (x{len(devices)})"


def _signatures(trace, devices: set[int]) -> dict[int, tuple]:
    step = max(trace.step_time, 1e-30)
    q = step * 1e-9               # times equal to 1e-9 of the step count as the same
    events: dict[int, list] = defaultdict(list)
    for e in trace.events:
        if e.device in devices:
            events[e.device].append((e.stream, e.kind, round(e.start / q), round(e.end / q),
                                     e.mb, e.region))
    memory: dict[int, list] = defaultdict(list)
    for m in trace.memory:
        if m.device in devices:
            memory[m.device].append((round(m.time / q), m.total))
    return {d: (tuple(sorted(events[d])), tuple(sorted(memory[d]))) for d in devices}


def group_replicas(trace, devices=None, group: bool = True) -> list[DeviceGroup]:
    """The devices of `trace` (or `devices`), in order of their first device; identical
    ones share a group when `group`."""
    chosen = sorted(trace.devices if devices is None else set(devices) & set(trace.devices))
    if not group:
        return [DeviceGroup((d,)) for d in chosen]
    members: dict[tuple, list[int]] = {}
    for d, sig in sorted(_signatures(trace, set(chosen)).items()):
        members.setdefault(sig, []).append(d)
    return sorted((DeviceGroup(tuple(ds)) for ds in members.values()),
                  key=lambda g: g.devices[0])


@dataclass(frozen=True)
class Marks:
    """Per device, its regions in order (chunks); per microbatch, its direction (or none)."""

    chunks: dict[int, tuple[int, ...]]
    directions: dict[int, int]

    def text(self, e) -> str:
        """The bar's mark: microbatch, then chunk or direction for a compute pass."""
        if e.mb < 0:
            return ""
        if e.kind not in _PASSES:
            return str(e.mb)
        if self.directions:
            return f"{e.mb}{_ARROWS[self.directions.get(e.mb, 0)]}"
        stages = self.chunks.get(e.device, ())
        return f"{e.mb}c{stages.index(e.region)}" if len(stages) > 1 and e.region in stages \
            else str(e.mb)

    def key(self) -> str:
        """What the marks on the bars mean, for a line of the legend."""
        if self.directions:
            return (f"bar text: microbatch, {_ARROWS[0]} entered at the first device, "
                    f"{_ARROWS[1]} at the last")
        if any(len(c) > 1 for c in self.chunks.values()):
            return "bar text: microbatch, c and the chunk (1c0: microbatch 1, first chunk)"
        return "bar text: microbatch"

    def words(self, e) -> str:
        """The same in words, for the hover: "microbatch 3, chunk 1, region 9"."""
        parts = [f"microbatch {e.mb}"] if e.mb >= 0 else []
        if e.mb >= 0 and e.kind in _PASSES and self.directions:
            parts.append("down" if self.directions.get(e.mb, 0) == 0 else "up")
        elif e.mb >= 0 and e.kind in _PASSES and len(self.chunks.get(e.device, ())) > 1:
            parts.append(f"chunk {self.chunks[e.device].index(e.region)}")
        return ", ".join(parts + ([f"region {e.region}"] if e.region >= 0 else []))


def bar_marks(trace) -> Marks:
    """The chunks of every device and, with two entry points, each microbatch's direction."""
    stages: dict[int, set[int]] = defaultdict(set)
    first = min((e.region for e in trace.events if e.kind == Op.F and e.region >= 0), default=-1)
    entry: dict[int, int] = {}
    for e in trace.events:
        if e.kind in _PASSES and e.region >= 0:
            stages[e.device].add(e.region)
            if e.kind == Op.F and e.region == first and e.mb >= 0:
                entry[e.mb] = min(entry.get(e.mb, e.device), e.device)
    chunks = {d: tuple(sorted(s)) for d, s in stages.items()}
    entries = sorted(set(entry.values()))
    directions = {mb: entries.index(d) for mb, d in entry.items()} if len(entries) == 2 else {}
    return Marks(chunks, directions)
