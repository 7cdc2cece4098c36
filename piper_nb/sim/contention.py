"""Compute slowed by the communication it overlaps, in the simulator (`contended`).

On a GPU, NCCL's kernels take SMs and memory bandwidth from the compute running beside
them: a pass runs `1 + c` times slower while a collective or a message is in flight on its
device (`CostModel.contention` = c, the topology's; `sim.topology` says where its value
comes from). A pass of w seconds overlapped for o of them then takes w + o c / (1 + c):
during the overlap it advances at 1 / (1 + c).

The overlap depends on the timeline and the timeline on the stretch, so `contended` takes
the fixed point as `sim.core_sharing` does: stretch every pass by its overlap on the last
timeline, simulate again, and stop when no factor moves. A pass's factor moves at most
c / (1 + c) times as far as its span, so the rounds contract. Communication keeps its own
durations.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from piper_nb.ir.kinds import COMM, COMPUTE

__all__ = ["contended"]


def contended(cost, sim, resimulate: Callable, rounds: int = 6):
    """The timeline once every pass is stretched by the communication it overlaps (see
    the module docstring), at most `rounds` re-simulations."""
    c = cost.contention
    factors: list[dict[int, float]] = [{} for _ in sim.instrs]
    for _ in range(rounds):
        new = [_stretches(cost, sim, d, c) for d in range(len(sim.instrs))]
        if all(_close(a, b) for a, b in zip(new, factors, strict=True)):
            break
        factors = new
        sim = resimulate(factors)
    return sim


def _close(a: dict[int, float], b: dict[int, float], tol: float = 2e-3) -> bool:
    return all(abs(a.get(k, 1.0) - b.get(k, 1.0)) <= tol for k in a.keys() | b.keys())


def _busy(sim, d: int) -> tuple[list[float], list[float], list[float]]:
    """The merged spans during which communication is in flight on device d: their starts,
    ends, and the busy time before each start."""
    spans = sorted((sim.start[d][i], sim.end[d][i]) for i, ins in enumerate(sim.instrs[d])
                   if ins.kind in COMM and sim.end[d][i] > sim.start[d][i])
    starts: list[float] = []
    ends: list[float] = []
    for a, b in spans:
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    before, total = [], 0.0
    for a, b in zip(starts, ends, strict=True):
        before.append(total)
        total += b - a
    return starts, ends, before


def _covered(busy, x: float) -> float:
    """Busy time before x."""
    starts, ends, before = busy
    k = bisect.bisect_right(starts, x) - 1
    if k < 0:
        return 0.0
    return before[k] + min(x, ends[k]) - starts[k]


def _stretches(cost, sim, d: int, c: float) -> dict[int, float]:
    """Per compute step of device d (its first instruction's index): the factor on its
    duration given the overlap on the last timeline."""
    busy = _busy(sim, d)
    if not busy[0]:
        return {}
    instrs, out = sim.instrs[d], {}
    for s in sim.steps[d]:
        members = s if s.__class__ is tuple else (s,)
        ins = instrs[members[0]]
        if s.__class__ is not tuple and ins.kind not in COMPUTE:
            continue
        a, b = sim.start[d][members[0]], sim.end[d][members[0]]
        work = cost.overlapped([instrs[k] for k in members]) if len(members) > 1 \
            else cost.compute(ins)
        if b <= a or work <= 0:
            continue
        o = _covered(busy, b) - _covered(busy, a)
        if o > 0:
            out[members[0]] = 1 + o * c / (1 + c) / work
    return out
