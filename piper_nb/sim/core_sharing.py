"""Devices sharing a CPU host's cores, in the simulator: processor sharing as a fixed point.

Local CPU workers (`HostModel.cores`) compute on fewer cores than there are devices, with
`background` other runnable tasks beside them. A pass profiled at a slowdown of s((1 +
bg) / cores) runs at s((active + bg) / cores), active being the mean load during it: the
devices computing, itself included, plus `comm_cores` for each member of a collective in
flight and, on a receiver, for the share of a point-to-point message's span that reading
it off the socket takes. s(x) is max(1, x), times `slicing` once tasks outnumber cores
(`slicing.slicing_slowdown`). A collective runs at max(1, active / cores) over the load it
was profiled at (its members, plus the other processes of the link profile, which
computed meanwhile); a point-to-point message keeps its profiled time.

The load depends on the timeline and the timeline on the load, so `shared_cores` takes
the fixed point: stretch every pass and collective by its share (damped: the mean of the
new share and the last), re-simulate, and repeat until the step time settles. Where
devices outnumber cores, `jittered` then draws each stretched pass's factor from the
measured shape of time-slicing (`HostModel.jitter`: mostly full speed, now and then a
whole slice longer), keeping the mean: a message waits for its unluckiest member, which
the mean alone misses.

Both work on a simulated timeline (`simulate._Sim`: per device `instrs`, `start`, `end`,
`stretch`, and `t`, when each host finished) and a `resimulate(stretch)` that simulates
the plan again with new stretch factors (per device: instruction index -> factor), so that
this module needs nothing of the simulator itself.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable

from piper_nb.ir.kinds import COLLECTIVES, COMPUTE, Op
from piper_nb.plan.sizes import message_bytes
from piper_nb.sim.host_model import HostModel
from piper_nb.sim.time_slicing import slicing_slowdown

__all__ = ["shared_cores", "jittered", "JITTER_SAMPLES"]

JITTER_SAMPLES = 15

Stretch = list[dict[int, float]]   # per device: instruction index -> factor on its duration


def shared_cores(plan, host: HostModel, sim, resimulate: Callable[[Stretch], object],
                 rounds: int = 8):
    """The timeline once passes and collectives are stretched by their share of the cores
    (see the module docstring): stretch, re-simulate, and repeat until the step settles,
    at most `rounds` times."""
    measured_at = slicing_slowdown((1 + host.background) / host.cores, host.slicing)
    reading = _reader(plan, host)
    last = max(sim.t)
    for _ in range(rounds):
        integral = _load_integral(_load_changes(sim, host.comm_cores, reading))
        new = resimulate(_stretches(host, sim, integral, measured_at))
        done = abs(max(new.t) - last) <= 1e-3 * last
        sim, last = new, max(new.t)
        if done:
            break
    return sim


def _reader(plan, host: HostModel) -> Callable:
    """The load of receiving a message: its copy off the socket (timed at the rate the
    sender's call writes it) spread over its span; the whole span without that rate."""
    comm = host.comm_cores
    send = host.issue.get(Op.SEND)
    copy_rate = send[1] if isinstance(send, tuple) and 0 < send[1] < math.inf else None

    def reading(sim, d: int, i: int, ins) -> float:
        if copy_rate is None:
            return comm
        span = sim.end[d][i] - sim.start[d][i]
        return comm * min(1.0, message_bytes(plan, ins) / copy_rate / span)
    return reading


def _load_changes(sim, comm: float, reading: Callable) -> list[tuple[float, float]]:
    """(time, load change), sorted: busy compute streams, collectives and receives."""
    spans = []
    for d, instrs in enumerate(sim.instrs):
        start, end = sim.start[d], sim.end[d]
        for i, ins in enumerate(instrs):
            if end[i] > start[i]:
                if ins.kind in COMPUTE:
                    spans += [(start[i], 1.0), (end[i], -1.0)]
                elif comm and ins.kind in COLLECTIVES:
                    spans += [(start[i], comm), (end[i], -comm)]
                elif comm and ins.kind == Op.RECV:
                    load = reading(sim, d, i, ins)
                    spans += [(start[i], load), (end[i], -load)]
    spans.sort()
    return spans


def _load_integral(spans: list[tuple[float, float]]) -> Callable[[float], float]:
    """The integral of the load from time 0 to x, the load changing at `spans`."""
    times = [x[0] for x in spans]
    level, area, active = [], [], 0.0
    acc, prev = 0.0, None
    for tm, step in spans:   # cumulative area under active(t), at each change point
        if prev is not None:
            acc += active * (tm - prev)
        active += step
        prev = tm
        level.append(active)
        area.append(acc)

    def integral(x: float) -> float:
        k = bisect.bisect_right(times, x) - 1
        return 0.0 if k < 0 else area[k] + level[k] * (x - times[k])
    return integral


def _stretches(host: HostModel, sim, integral: Callable[[float], float],
               measured_at: float) -> Stretch:
    """Per device, the next stretch of each pass and collective: its share of the cores
    over the load it was profiled at, averaged with its last stretch (damped)."""
    bg, cores, comm, slicing = host.background, host.cores, host.comm_cores, host.slicing
    stretch: Stretch = []
    for d, instrs in enumerate(sim.instrs):
        own = {}
        for i, ins in enumerate(instrs):
            s0, s1 = sim.start[d][i], sim.end[d][i]
            if s1 <= s0:
                continue
            if ins.kind in COMPUTE:
                active = (integral(s1) - integral(s0)) / (s1 - s0)
                share = slicing_slowdown((active + bg) / cores, slicing) / measured_at
            elif comm and ins.kind in COLLECTIVES:
                n = len(ins.data.group)   # profiled while link_world - n processes computed
                profiled = max(1.0, (max(host.link_world - n, 0) + n * comm) / cores)
                share = max(1.0, (integral(s1) - integral(s0)) / (s1 - s0) / cores) / profiled
            else:
                continue
            own[i] = 0.5 * (share + sim.stretch[d].get(i, 1.0))   # damped
        stretch.append(own)
    return stretch


def jittered(host: HostModel, sim, resimulate: Callable[[Stretch], object],
             samples: int = JITTER_SAMPLES):
    """Time-slicing is not smooth: a pass mostly runs at full speed and now and then waits
    out other processes' slices (`host.jitter`: measured quantiles of a pass's time over
    its median). Each stretched pass draws its factor from that shape, rescaled to keep
    its processor-sharing mean; a message or collective waits for the unluckiest of its
    members, which the mean alone misses. Returns the sample of median step time among
    `samples` draws (seeded: the same cost model predicts the same step)."""
    rng = random.Random(0)
    mean = sum(host.jitter) / len(host.jitter)
    shape = [j / mean for j in host.jitter]
    runs = []
    for _ in range(samples):
        stretch = [{i: f * rng.choice(shape) if f > 1.0 and instrs[i].kind in COMPUTE else f
                    for i, f in base.items()}
                   for instrs, base in zip(sim.instrs, sim.stretch, strict=True)]
        runs.append(resimulate(stretch))
    runs.sort(key=lambda x: max(x.t))
    return runs[len(runs) // 2]
