"""Discrete-event simulation of a Plan: the timed sibling of `compiler.checks.dry_run`.

Every device walks its instruction list in order with an instruction pointer (its time
`t`); a WAIT blocks the pointer until the op it names has finished, and so does a forward
token dispatch until its exchange starts (the runtime first all-gathers the token counts,
blocking: `cost.counts_time`). Each device has a
compute stream and one stream per communication stream name:

- a compute pass starts when the previous pass has finished and every preceding WAIT has
  passed; an overlap slot (passes with one `overlap` id, DualPipe's F&B) is one job of
  `cost.overlapped(...)` whose members share the span. WAITs between the members gate the
  slot; issues between them follow it.
- an issue posts its op at `t`; SEND and collectives also wait for the passes issued
  before them (they move what those produced), a RECV needs only its buffer. A
  SEND/RECV pair is matched when both sides have posted, a collective when every member
  has posted its k-th collective on the group. Matched ops start in the order they
  became ready, each when its stream is free on every member (FIFO per stream), and end
  together on all of them.
- FREE costs nothing; it happens once the passes before it have finished.
- host model (`cost.host`, a `HostModel`; None: none): every instruction then costs the
  host `host.overhead_of(d)` after it, an issue also `host.issue_time` (its call), a WAIT
  `host.issue["WAIT"]` once its op is done, and a collective `host.packing[(kind,
  bucket)]` before its call and after its wait; with `sync` the host waits for each pass
  (CPU workers) and an overlap slot runs its passes in list order; with `cores`, the
  devices computing at once share the cores (processor sharing, found by re-simulating
  with stretched durations until the step time settles, and time-slicing's jitter where
  devices outnumber cores: `sim.core_sharing`).
- contention (`cost.contention` > 0, GPU models): a pass runs slower while communication
  is in flight on its device, found the same way, by re-simulating with stretched
  durations until they settle (`sim.contention`).

Ops live in a heap keyed by ready time (ties: the smallest (template device, instruction
index) among the op's members, see `sim.replicas`), devices are indices and instructions
integer positions, so a step of a thousand devices simulates in seconds; when the replicas
of a plan are symmetric (`replicas.replica_runs`) only one per class is simulated and a
`CompactTrace` stands for the rest, so 16,384 devices do too.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COMM, COMPUTE, P2P, Op
from piper_nb.plan.plan import Plan
from piper_nb.sim.contention import contended
from piper_nb.sim.core_sharing import jittered, shared_cores
from piper_nb.sim.cost import CostModel
from piper_nb.sim.host_model import NO_HOST
from piper_nb.sim.replicas import CompactTrace, replica_runs, state_offsets
from piper_nb.sim.trace import Event, Trace

__all__ = ["simulate", "Timing", "run_timing", "overlap_steps"]

_NONE = (0.0, 0.0)


@dataclass
class Timing:
    """Per device and instruction: when the pointer posted it, when it started and ended.

    Compute: its span; issues: the op's span (posted = issue time); WAIT: when it passed;
    FREE: when it happened. -1 marks instructions never reached.
    """

    plan: Plan
    posted: list[list[float]]
    start: list[list[float]]
    end: list[list[float]]
    host_end: list[float] | None = None   # per device: when its host finished the list


def overlap_steps(instrs) -> list[int | tuple[int, ...]]:
    """The execution order: instruction indices, with each overlap slot as one tuple.

    WAITs between the members of a slot for ops posted before it move ahead of the slot;
    everything else between them moves after it.
    """
    if all(ins.overlap < 0 for ins in instrs):
        return list(range(len(instrs)))
    steps: list[int | tuple[int, ...]] = []
    n, i = len(instrs), 0
    while i < n:
        ins = instrs[i]
        if ins.overlap < 0:
            steps.append(i)
            i += 1
            continue
        members, between, j = [i], [], i + 1
        while j < n:
            x = instrs[j]
            if x.kind in COMPUTE:
                if x.overlap != ins.overlap:
                    break
                members.append(j)
            else:
                between.append(j)
            j += 1
        inner = [k for k in between if k < members[-1]]
        pre = [k for k in inner if instrs[k].kind == Op.WAIT and instrs[k].data.target < i]
        taken = set(pre)
        steps += pre
        steps.append(tuple(members) if len(members) > 1 else i)
        steps += [k for k in inner if k not in taken]
        i = members[-1] + 1
    return steps


class _Sim:
    def __init__(self, plan: Plan, cost: CostModel, stretch: list[dict[int, float]] | None = None,
                 counting: list[set[int]] | None = None, runs: list[bool] | None = None):
        self.plan, self.cost = plan, cost
        self.host = host = cost.host or NO_HOST
        # the devices simulated (`sim.replicas`: the others repeat their template's times);
        # a device that is not keeps its lazily stamped instructions unmade
        self.runs = runs = runs if runs is not None else [True] * plan.world
        self.instrs = [dp.instrs if on else () for dp, on in zip(plan.devices, runs, strict=True)]
        # ops ready at one time start in the order of their first member by (template,
        # instruction index): the same order whether a replica runs or repeats its template
        stamps = plan.stamps()
        self.rep = [stamps.get(d, d) for d in range(plan.world)]
        self.need: dict[tuple, int] = {}   # group -> members simulated
        self.sync = host.sync
        self.steps = [list(range(len(x))) if host.sync else overlap_steps(x)
                      for x in self.instrs]
        self.overhead = [host.overhead_of(dp.device) for dp in plan.devices]
        self.stretch = stretch or [{} for _ in self.instrs]
        w = plan.world
        self.pos, self.t, self.cfree = [0] * w, [0.0] * w, [0.0] * w
        self.blocked = [-1] * w
        self.posted = [[-1.0] * len(x) for x in self.instrs]
        self.start = [[-1.0] * len(x) for x in self.instrs]
        self.end = [[-1.0] * len(x) for x in self.instrs]
        self.sfree: dict[tuple[int, str], float] = defaultdict(float)
        self.p2p: dict[tuple, tuple[int, int, float]] = {}
        self.coll: dict[tuple, list[tuple[int, int, float]]] = {}
        self.coll_k = [defaultdict(int) for _ in range(w)]
        self.heap: list = []
        self.seq = 0
        # per device: forward dispatches, whose host first all-gathers token counts (blocking)
        self.counting = counting if counting is not None else [
            {i for i, x in enumerate(instrs) if x.is_counted_dispatch} for instrs in self.instrs]

    def _issue(self, d: int, i: int, ins, ready: float) -> None:
        if ins.kind in P2P:
            m = ins.data
            key = (d, m.peer, m.tag) if ins.kind == Op.SEND else (m.peer, d, m.tag)
            other = self.p2p.pop(key, None)
            if other is None:
                self.p2p[key] = (d, i, ready)
                return
            members = ((other[0], other[1]), (d, i))
            ready = max(ready, other[2])
        else:
            k = self.coll_k[d][ins.data.group]
            self.coll_k[d][ins.data.group] = k + 1
            posts = self.coll.setdefault((ins.data.group, k), [])
            posts.append((d, i, ready))
            need = self.need.get(ins.data.group)
            if need is None:
                need = self.need[ins.data.group] = sum(1 for m in ins.data.group if self.runs[m])
            if len(posts) < need:
                return
            del self.coll[(ins.data.group, k)]
            members = tuple((x[0], x[1]) for x in posts)
            ready = max(x[2] for x in posts)
        rep = self.rep
        self.seq += 1
        heapq.heappush(self.heap, (ready, min((rep[m], j) for m, j in members), self.seq,
                                   members))

    def run_device(self, d: int) -> None:
        instrs, steps, cost, counting = self.instrs[d], self.steps[d], self.cost, self.counting[d]
        posted, start, end = self.posted[d], self.start[d], self.end[d]
        p, t, cfree = self.pos[d], self.t[d], self.cfree[d]
        overhead, sync, stretch, plan = self.overhead[d], self.sync, self.stretch[d], self.plan
        wait, packing = self.host.issue_time(plan, Op.WAIT), self.host.packing
        issued = self.host.issue_time if self.host.issue else None
        while p < len(steps):
            s = steps[p]
            if s.__class__ is tuple:
                st = t if t > cfree else cfree
                cfree = st + cost.overlapped([instrs[k] for k in s]) * stretch.get(s[0], 1.0)
                for k in s:
                    posted[k], start[k], end[k] = t, st, cfree
                t += overhead * len(s)
                p += 1
                continue
            ins = instrs[s]
            kind = ins.kind
            if kind == Op.WAIT:
                e = end[ins.data.target]
                if e < 0:
                    self.blocked[d] = ins.data.target
                    break
                if e > t:
                    t = e
                posted[s] = start[s] = end[s] = t
                t += wait
                if packing:
                    src = instrs[ins.data.target]
                    t += packing.get((src.kind, src.bucket), _NONE)[1]
            elif kind in COMPUTE:
                st = t if t > cfree else cfree
                cfree = st + cost.compute(ins) * stretch.get(s, 1.0)
                posted[s], start[s], end[s] = t, st, cfree
                if sync:
                    t = cfree
            elif kind == Op.FREE:
                posted[s] = start[s] = end[s] = t if t > cfree else cfree
            elif s in counting:   # a forward dispatch: counts first, the host blocks
                if posted[s] < 0:
                    posted[s] = t
                    self._issue(d, s, ins, t if t > cfree else cfree)
                if start[s] < 0:
                    self.blocked[d] = s
                    break
                if start[s] > t:
                    t = start[s]
                if issued is not None:
                    t += issued(plan, ins)
            else:
                if packing:
                    t += packing.get((kind, ins.bucket), _NONE)[0]
                posted[s] = t
                self._issue(d, s, ins, t if kind == Op.RECV or t > cfree else cfree)
                if issued is not None:
                    t += issued(plan, ins)
            t += overhead
            p += 1
        self.pos[d], self.t[d], self.cfree[d] = p, t, cfree

    def run(self) -> None:
        for d in range(self.plan.world):
            if self.runs[d]:
                self.run_device(d)
        heap, sfree, cost, plan = self.heap, self.sfree, self.cost, self.plan
        while heap:
            ready, _, _, members = heapq.heappop(heap)
            d0, i0 = members[0]
            first = self.instrs[d0][i0]
            keys = [(d, self.instrs[d][i].stream) for d, i in members]
            if i0 in self.counting[d0]:   # the counts' all-gather comes before the tokens
                ready += cost.counts_time(first)
            st = max([ready] + [sfree[k] for k in keys])
            en = st + cost.message(plan, first, d0) * max(
                self.stretch[d].get(i, 1.0) for d, i in members)
            resume = []
            for (d, i), k in zip(members, keys, strict=True):
                sfree[k] = en
                self.start[d][i], self.end[d][i] = st, en
                if self.blocked[d] == i:
                    self.blocked[d] = -1
                    resume.append(d)
            for d in resume:
                self.run_device(d)
        stuck = [d for d in range(self.plan.world) if self.pos[d] < len(self.steps[d])]
        if stuck:
            raise PlanError("the simulation cannot finish: devices " + str(stuck) + " wait for "
                            "ops that never start\n" + self._stuck_text(stuck))

    def _stuck_text(self, stuck: list[int]) -> str:
        lines = []
        for d in stuck[:16]:
            ins = self.instrs[d][self.blocked[d]] if self.blocked[d] >= 0 else None
            lines.append(f"  dev{d}: wait({ins})" if ins is not None else f"  dev{d}: ?")
        return "\n".join(lines)


def run_timing(plan: Plan, cost: CostModel, runs: list[bool] | None = None) -> Timing:
    """Simulate `plan` under `cost`; the per-instruction times (see `Timing`). Only the
    devices in `runs` (default: all) are simulated, the others' lists left empty: see
    `sim.replicas` for when that is exact."""
    sim = _Sim(plan, cost, runs=runs)
    sim.run()
    host = cost.host or NO_HOST
    counting = sim.counting

    def resimulate(stretch: list[dict[int, float]]) -> _Sim:
        new = _Sim(plan, cost, stretch, counting, runs)
        new.run()
        return new
    if host.shares_cores(plan.world):   # the sharing pass finds whether the load exceeds them
        sim = shared_cores(plan, host, sim, resimulate)
        if host.jitter and plan.world > host.cores:
            sim = jittered(host, sim, resimulate)
    elif cost.contention > 0:   # GPUs: compute slowed by the communication beside it
        sim = contended(cost, sim, resimulate)
    return Timing(plan, sim.posted, sim.start, sim.end, list(sim.t))


_TIMED = COMPUTE | COMM


def _events(timing: Timing, runs: list[bool] | None = None) -> list[Event]:
    out: list[Event] = []
    append = out.append
    for dp in timing.plan.devices:
        if runs is not None and not runs[dp.device]:
            continue
        d, start, end = dp.device, timing.start[dp.device], timing.end[dp.device]
        for i, ins in enumerate(dp.instrs):
            if ins.kind in _TIMED:
                append(Event(d, ins.stream, ins.node, ins.kind, start[i], end[i], ins.mb,
                             ins.region, str(ins)))
    return out


def simulate(plan: Plan, cost_model: CostModel | None, *, memory=None) -> Trace:
    """Predict the timeline and memory of one training step of `plan` under `cost_model`.

    `memory` is a `MemorySettings` (bytes per parameter, gradient and optimizer state; for
    an expert plan, the routing that sizes its token buffers). The simulator never measures:
    `pn.simulate` (`piper_nb.profile.simulate`) is this with the profiled model as default.
    """
    from piper_nb.sim.memory import memory_samples
    if not isinstance(plan, Plan):
        raise PlanError("simulate takes the Plan returned by pn.compile(spec, program, batch)")
    if cost_model is None:
        raise PlanError("the simulator needs a cost model: pn.CostModel.uniform(), "
                        "pn.CostModel.analytic(plan, 'H100') or pn.CostModel.profile(plan) "
                        "(pn.simulate(plan) profiles by default)")
    cost = cost_model
    was_on = gc.isenabled()
    gc.disable()  # hundreds of thousands of small objects, no cycles: skip the GC passes
    try:
        runs = replica_runs(plan, cost, memory)   # None: every device is simulated
        timing = run_timing(plan, cost, runs)
        samples = memory_samples(timing, memory, runs)
        events = _events(timing, runs)
    finally:
        if was_on:
            gc.enable()
    meta = {"cost_model": cost.name, "world": plan.world, "microbatches": plan.microbatches,
            "host_end": max(timing.host_end, default=0.0)}   # when the last host finished
    if math.isfinite(cost.meta.get("memory_capacity", math.inf)):
        meta["memory_capacity"] = cost.meta["memory_capacity"]   # bytes per device
    if runs is not None:   # the replicas' events and samples are their templates'
        return CompactTrace(plan, tuple(events), tuple(samples), "simulated", cost.unit, meta,
                            offsets=state_offsets(plan, memory))
    return Trace(tuple(events), tuple(samples), "simulated", cost.unit, meta)
