"""Simulating one replica per class: plans of thousands of devices in seconds.

The lowering stamps the replicas of a stage out of one template (`Plan.stamps`: the same
instructions but for the replica index, peers and tags). When the plan and the costs are
symmetric, every replica's simulated times are its template's, so `simulate` runs the
templates only and `CompactTrace` stands for the rest. Symmetric means (`replica_runs`):

- the map device -> template is a homomorphism of the point-to-point graph: for every
  SEND/RECV pair of nodes and every position, the template of the receiver is the peer of
  the sender's template, at the template's own position (so templates only talk to
  templates, and a replica's messages mirror its template's);
- a message between replicas costs what the templates' costs (`CostModel.link_time` of the
  two pairs); passes cost what their region and kind say, and a collective's group is
  one node's device list, the same on every member, the template being one of them;
- bucket groups hold a replica exactly when they hold its template; no routed rows
  (expert plans size buffers per device), no host model (per-device overheads, shared
  cores) and no per-communicator allowance (it counts each device's own peers);
- every message takes some time (positive latency, or `comm` > 0), or none does (`comm`
  = 0, the uniform model's default).

Why then the templates alone give the full simulation's times, event for event: the
simulator pops matched ops from a heap keyed by (ready time, the smallest (template,
instruction index) among its members, sequence). With positive message times an op
popped at time r resumes devices whose next ops are ready after r, so all ops ready at r
are in the heap before the first of them pops, and they pop in key order. A key names one
instruction of one class: the ops that share it are one collective (its members issue one
node, the template among them) or copies of one message between distinct replicas, which
share no stream, so their order changes nothing. A replica's ops get its template's ready
times and keys (by induction over the pops) and touch its own streams, whose free times
mirror its template's; a collective needs its simulated members only, and its stream
times on replicas equal those on the template, a member. So dropping the replicas changes
no template's times, nor, then, the memory ledger's samples (a function of the
instructions and their times). The key is the same on both paths, so the full simulation
orders ties as the fast one does.

When no message takes time the order of ties is moot instead. Every op then starts when
it is ready: ops pop in the order of their ready times (a device resumed by an op popped
at r has its pointer at r or later, so what it posts next is ready no sooner), so a
stream's last op ended by the time the next is ready, and it ends when it starts. A
device's times are then a function of its own instructions and the ends of the ops it
waits for, whatever the order the heap pops them in; the templates' ops are matched with
templates only (or are one collective, ready when its simulated members' posts are, as
every member posts at its template's time), so the templates alone give the same times.
`tests/sim/test_scale.py` compares both paths.

The Trace stands for the replicas (`CompactTrace`): its events and samples are the
templates', expanded to every device only when `events` or `memory` is read.

Uneven ZeRO shards. A replica's shards may keep other optimizer state than its template's:
the last shard of a bucket is short by its padding, and a shard is cut into pieces where
the parameter group changes (each piece its own state, with its scalar step). An update
costs what its region says whatever its shard, and every buffer a shard moves is padded to
the same size, so the replica's times are still its template's; its memory differs in the
optimizer state alone, by bytes that change only at its updates (`state_offsets`). The
Trace adds them to the template's samples, so a class of replicas whose shards differ in
size is simulated once.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from piper_nb.ir.kinds import COMM, COMPUTE, Op
from piper_nb.sim.analysis import over_capacity, peak_memory, step_window
from piper_nb.sim.memory_settings import DEFAULT_SETTINGS
from piper_nb.sim.trace import Event, MemorySample, Trace
from piper_nb.sim.update_state import state_levels, update_state

__all__ = ["replica_runs", "state_offsets", "CompactTrace"]

_TIMED = COMPUTE | COMM


def _positive_messages(cost) -> bool:
    if cost.comm is not None:
        return cost.comm > 0
    return (cost.latency > 0 and (cost.inter_latency is None or cost.inter_latency > 0)
            and all(fit[0] > 0 for fit in cost.links.values()))


def _pairs(dag) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The distinct (sender devices, receiver devices) of the SEND/RECV node pairs."""
    out = set()
    for n in dag.nodes:
        if n.op == Op.SEND:
            for e in dag.out_edges(n.id):
                m = dag[e.dst]
                if m.op == Op.RECV:
                    out.add((n.devices, m.devices))
    return out


def _free_messages(cost) -> bool:
    """Whether no message takes time: each then starts when it is ready."""
    return cost.comm == 0


def _crossing(cost):
    """How a message's cost depends on its pair of devices: `CostModel.link_time` of a
    point-to-point message reads them only to tell whether they sit on two nodes, and not
    at all with a constant `comm`, a fitted "p2p" link or a single kind of link. None: not."""
    if cost.comm is not None or cost.inter_bandwidth is None or \
            any(k[0] == "p2p" for k in cost.links):
        return None
    size = cost.node_size
    return lambda a, b: a // size != b // size


Offsets = dict[int, tuple[tuple[int, float], ...]]


def _levels(plan, updates, d: int, held: dict, twins: dict, settings) -> list[float]:
    """Device `d`'s bytes of optimizer state before its first instruction and after each
    of `updates` (its template's U instructions, which it runs as its own: a bucket it is
    not in stands for its twin that it is in, the bucket of the same parameters another
    tensor-parallel rank updates)."""
    mine = held.get(d, {})
    states = []
    for _, ins in updates:
        own = tuple(b if b in mine else next((c for c in twins[b] if c in mine), b)
                    for b in ins.data.buckets)
        data = ins.data if own == ins.data.buckets else replace(ins.data, buckets=own)
        states.append(update_state(plan, SimpleNamespace(data=data), d, mine, settings))
    start, after = state_levels(states, settings.first_step)
    return [start, *after]


def state_offsets(plan, settings=None) -> Offsets:
    """Per replica whose ZeRO shards keep other optimizer state than its template's: the
    bytes of state it holds beyond the template's, as (instruction index, bytes from that
    instruction's sample on) steps in order (see "Uneven ZeRO shards" above); replicas
    that keep what their template keeps are left out."""
    settings = settings if settings is not None else DEFAULT_SETTINGS
    sharded = [b for b in plan.buckets if b.zero > 0]
    if not sharded:
        return {}
    held: dict[int, dict] = {}   # device -> its ZeRO buckets by index
    same: dict[tuple, list[int]] = {}   # parameters -> the buckets that hold them
    for b in sharded:
        same.setdefault(b.params, []).append(b.index)
        for d in b.group:
            held.setdefault(d, {})[b.index] = b
    twins = {b.index: same[b.params] for b in sharded}
    copies: dict[int, list[int]] = {}
    for d, t in plan.stamps().items():
        copies.setdefault(t, []).append(d)
    out: Offsets = {}
    for t, replicas in copies.items():
        updates = [(i, ins) for i, ins in enumerate(plan.devices[t].instrs) if ins.kind == Op.U]
        if not any(ins.data.buckets for _, ins in updates):
            continue
        mine, at = _levels(plan, updates, t, held, twins, settings), [0] + [i for i, _ in updates]
        for d in replicas:
            steps, last = [], 0.0
            for i, theirs, own in zip(at, _levels(plan, updates, d, held, twins, settings), mine,
                                      strict=True):
                if theirs - own != last:
                    last = theirs - own
                    steps.append((i, last))
            if steps:
                out[d] = tuple(steps)
    return out


def _mirrors(dag, rep: list[int], cost) -> bool:
    """Whether every replica's messages mirror its template's (see the module's words)."""
    crossing = _crossing(cost)
    for send, recv in _pairs(dag):
        if len(send) != len(recv):
            return False
        at_s = {d: k for k, d in enumerate(send)}
        at_r = {d: k for k, d in enumerate(recv)}
        for a, b in zip(send, recv, strict=True):
            ta, tb = rep[a], rep[b]
            if ta == a and tb == b:
                continue
            k = at_s.get(ta)
            if k is None or recv[k] != tb or at_r.get(tb) != k:
                return False
            if crossing is not None and crossing(a, b) != crossing(ta, tb):
                return False
    return True


def replica_runs(plan, cost, settings=None) -> list[bool] | None:
    """Per device, whether `simulate` must run it: the templates, when every replica's
    times are provably its template's (see the module docstring); None: run them all."""
    if (cost.host is not None or plan.rows or plan.dag is None
            or (settings is not None and settings.per_communicator)):
        return None
    stamps = plan.stamps()
    if not stamps or not (_positive_messages(cost) or _free_messages(cost)):
        return None
    dag = plan.dag
    if any(n.op == Op.ALL_TO_ALL for n in dag.nodes):
        return None
    rep = [stamps.get(d, d) for d in range(plan.world)]
    copies: dict[int, list[int]] = {}
    for d, t in stamps.items():
        copies.setdefault(t, []).append(d)
    groups = {b.group for b in plan.buckets}
    lead = {m: (g[0], k) for g in plan.tp_groups for k, m in enumerate(g)}

    def tp_copy(group) -> bool:
        """Rank k's copy of a bucket of the groups' first devices (`tp.widen`): it mirrors
        that bucket, rank for rank, on devices the simulation stands for."""
        firsts = tuple(lead.get(d, (None, 0))[0] for d in group)
        return None not in firsts and firsts in groups and len({lead[d][1] for d in group}) == 1
    for group in groups:   # holds a replica iff its template
        held = set(group)
        if all(rep[d] != d for d in group) and tp_copy(group):
            continue   # a tensor-parallel rank's copy of a bucket: no member runs
        same_rank = (lambda d, c: lead.get(c, (0, 0))[1] == lead.get(d, (0, 0))[1])
        if any(rep[d] not in held for d in group) or \
                any(not held.issuperset(c for c in copies.get(d, ()) if same_rank(d, c))
                    for d in group if rep[d] == d):
            return None
    if not _mirrors(dag, rep, cost):
        return None
    return [d not in stamps for d in range(plan.world)]


class CompactTrace(Trace):
    """A simulated Trace that holds the events and memory samples of the simulated devices
    (one template per class of replicas) and stands for the replicas: `events` and
    `memory` expand them on first use (each replica's copy of its template's, with its own
    device and labels), in the order the full simulation gives; the step time, peaks,
    bubbles, fits and stashes answer from the templates without expanding. A replica
    whose shards keep other optimizer state has its template's samples with `offsets`
    (`state_offsets`) added. Equal to the Trace the full simulation returns."""

    def __init__(self, plan, events: tuple[Event, ...], memory: tuple[MemorySample, ...],
                 source: str = "simulated", unit: str = "s", meta: dict | None = None,
                 offsets: Offsets | None = None):
        stamps = plan.stamps()
        fields = {"source": source, "unit": unit, "meta": meta or {}, "_plan": plan,
                  "_rep": [stamps.get(d, d) for d in range(plan.world)],
                  "_own": Trace(events, memory, source, unit, meta or {}),
                  "_offsets": offsets or {}, "_peaks": {},
                  "_events": None, "_memory": None}
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    # ---- the full tuples, on demand ----------------------------------------------------
    @property
    def events(self) -> tuple[Event, ...]:
        if self._events is None:
            object.__setattr__(self, "_events", self._expand_events())
        return self._events

    @property
    def memory(self) -> tuple[MemorySample, ...]:
        if self._memory is None:
            object.__setattr__(self, "_memory", self._expand_memory())
        return self._memory

    def _by_device(self, items) -> dict[int, list]:
        out: dict[int, list] = {}
        for x in items:
            out.setdefault(x.device, []).append(x)
        return out

    def _expand_events(self) -> tuple[Event, ...]:
        own, out = self._by_device(self._own.events), []
        for d, t in enumerate(self._rep):
            out += self._copy(d, own.get(t, ()))
        return tuple(out)

    def _copy(self, d: int, template: list[Event]) -> list[Event]:
        """Device `d`'s events: its template's, with its own device and labels."""
        if self._rep[d] == d:
            return list(template)
        dp = self._plan.devices[d]
        instrs = dp.stamped() if hasattr(dp, "stamped") else dp.instrs
        labels = [str(ins) for ins in instrs if ins.kind in _TIMED]
        return [Event(d, e.stream, e.node, e.kind, e.start, e.end, e.mb, e.region, label)
                for e, label in zip(template, labels, strict=True)]

    def events_of(self, device: int) -> tuple[Event, ...]:
        """`device`'s events, in order, without expanding the other replicas."""
        if self._events is not None or not 0 <= device < len(self._rep):
            return super().events_of(device)
        t = self._rep[device]
        return tuple(self._copy(device, [e for e in self._own.events if e.device == t]))

    def _expand_memory(self) -> tuple[MemorySample, ...]:
        own, out = self._by_device(self._own.memory), []
        for d, t in enumerate(self._rep):
            out += own.get(d, ()) if t == d else self._samples(d, own.get(t, ()))
        return tuple(out)

    def _samples(self, d: int, template) -> list[MemorySample]:
        """Device `d`'s samples: its template's, with its own optimizer state."""
        steps, out = self._offsets.get(d, ()), []
        j, extra = 0, 0.0
        for k, m in enumerate(template):
            while j < len(steps) and steps[j][0] <= k:
                extra = steps[j][1]
                j += 1
            out.append(MemorySample(d, m.time, m.params, m.grads, m.optim + extra,
                                    m.activations, m.buffers) if extra else
                       MemorySample(d, m.time, m.params, m.grads, m.optim, m.activations,
                                    m.buffers))
        return out

    def memory_of(self, device: int) -> tuple[MemorySample, ...]:
        """`device`'s memory samples, in order, without expanding the other replicas."""
        if self._memory is not None or not 0 <= device < len(self._rep):
            return super().memory_of(device)
        t = self._rep[device]
        return tuple(self._samples(device, [m for m in self._own.memory if m.device == t]))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return ((self.events, self.memory, self.source, self.unit, self.meta)
                == (other.events, other.memory, other.source, other.unit, other.meta))

    __hash__ = Trace.__hash__

    def __repr__(self) -> str:
        return (f"CompactTrace({len(self._own.events)} events of {len(set(self._rep))} "
                f"simulated devices standing for {len(self._rep)}, unit={self.unit!r})")

    # ---- answers from the templates ----------------------------------------------------
    def _present(self, items) -> list[int]:
        """Devices with an item in the expanded tuple, in device order."""
        have = {x.device for x in items}
        return [d for d, t in enumerate(self._rep) if t in have]

    @property
    def devices(self) -> tuple[int, ...]:
        have = {e.device for e in self._own.events} | {m.device for m in self._own.memory}
        return tuple(d for d, t in enumerate(self._rep) if t in have)

    @property
    def step_time(self) -> float:
        return self._own.step_time

    def bubble(self, device: int) -> float:
        return self._own.bubble(self._rep[device] if 0 <= device < len(self._rep) else device)

    def bubble_fraction(self, device: int | None = None) -> float:
        if device is not None:
            return self._own.bubble_fraction(self._rep[device])
        t0, t1 = step_window(self._own)
        if t1 <= t0:
            return 0.0
        devices = self._present([e for e in self._own.events if e.stream == "compute"])
        per = {t: self._own.bubble(t) for t in set(self._rep[d] for d in devices)}
        return (sum(per[self._rep[d]] for d in devices) / len(devices) / (t1 - t0)
                if devices else 0.0)

    def _peak(self, d: int) -> MemorySample | None:
        """Device `d`'s first sample at its peak (None: no samples), one per template and
        state offsets."""
        t = self._rep[d]
        key = (t, self._offsets.get(d, ()))
        if key not in self._peaks:
            if not self._peaks:   # the templates' own, in one pass
                for m in self._own.memory:
                    at = (m.device, ())
                    if at not in self._peaks or m.total > self._peaks[at].total:
                        self._peaks[at] = m
            if key not in self._peaks:
                template = [m for m in self._own.memory if m.device == t]
                self._peaks[key] = max(self._samples(d, template), key=lambda m: m.total,
                                       default=None)
        return self._peaks.get(key)

    def _peaks_of(self) -> list[MemorySample]:
        """Each device's first sample at its peak, as its own, in device order."""
        out = []
        for d in range(len(self._rep)):
            m = self._peak(d)
            if m is not None:
                out.append(m if m.device == d else
                           MemorySample(d, m.time, m.params, m.grads, m.optim,
                                        m.activations, m.buffers))
        return out

    @property
    def peak_memory(self) -> dict[int, int]:
        if not self._offsets:
            peaks = peak_memory(self._own)
            return {d: peaks[self._rep[d]] for d in self._present(self._own.memory)}
        return {m.device: max(m.total, 0) for m in self._peaks_of()}

    def over_capacity(self, capacity: float | None = None) -> list[str]:
        return over_capacity(SimpleNamespace(meta=self.meta, memory=self._peaks_of()),
                             capacity)

    def live_stashes(self, device: int) -> int:
        from piper_nb.sim.analysis import live_stashes
        return live_stashes(self._own, self._rep[device] if 0 <= device < len(self._rep)
                            else device)
