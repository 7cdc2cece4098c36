"""The NCCL check: a plan stepped through a model of how NCCL runs it on GPUs.

gloo matches point-to-point messages by tag, so a plan that the deadlock dry run accepts
runs on CPU whatever order its messages are posted in. NCCL does not (NVIDIA/nccl issues
479 and 783; PyTorch's ProcessGroupNCCL):

- every communicator has one CUDA stream per device, a FIFO: an operation starts when the
  ones queued before it on that communicator finished, and after the compute the stream
  was told to wait for (everything the host queued on the compute stream before it);
- point-to-point operations ignore tags: the k-th send from a to b meets the k-th
  receive on b from a, and both block until the other is there (a receive at a stream's
  head holds up everything queued behind it);
- a collective completes when every member's matching one (the k-th on that group's
  communicator) has started;
- the host does not wait: it queues operations and compute, and a WAIT only makes the
  compute stream wait; a forward token dispatch is the exception (the host exchanges the
  token counts with its group first, once its own compute has run).

`check_nccl(plan, channels=...)` replays the plan under that model. `channels="direction"`
is the runtime's layout (`runtime.comm`): one communicator per direction of each pair, one
per collective group. `"pair"` is the layout PyTorch gives by default (both directions of a
pair on one communicator); plans do not need to pass it. A send meeting a receive made for
another message (the values would land in the wrong buffers, silently), or no way forward
(a deadlock), is a PlanError printing the queues involved with the operations marked.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COMM, COMPUTE, P2P, Op
from piper_nb.plan.plan import Plan

__all__ = ["check_nccl"]



class _Op:
    __slots__ = ("dev", "idx", "chan", "pos", "c_dep", "key", "done")

    def __init__(self, dev: int, idx: int, chan: tuple, pos: int, c_dep: int, key: tuple):
        self.dev, self.idx, self.chan, self.pos = dev, idx, chan, pos
        self.c_dep = c_dep       # compute-stream entries that must be done before it starts
        self.key = key           # what it meets: (direction, k) or (communicator, k)
        self.done = False


@dataclass
class _Device:
    instrs: tuple
    host: int = 0            # next instruction the host queues
    stream: list = field(default_factory=list)   # compute stream: None, or the op waited on
    done: int = 0            # compute-stream entries finished
    queues: dict = field(default_factory=dict)   # channel -> its ops, in queue order
    heads: dict = field(default_factory=dict)    # channel -> position of the first not done
    counts: dict = field(default_factory=lambda: defaultdict(int))   # ops per side/channel
    meets: dict = field(default_factory=lambda: defaultdict(int))    # dispatches per group


def _channel(d: int, ins, channels: str) -> tuple:
    if ins.kind in P2P:
        src, dst = (d, ins.peer) if ins.kind == Op.SEND else (ins.peer, d)
        if channels == "pair":
            return ("pair", min(src, dst), max(src, dst))
        return ("p2p", src, dst)
    return ("group", tuple(ins.group))


class _Run:
    """The replay. Devices the lowering stamped from a template (`Plan.stamps`) are not
    replayed when all their point-to-point peers are: they queue and start what their
    template does, so a collective waits for its replayed members only."""

    def __init__(self, plan: Plan, channels: str, replicas: bool = True):
        self.plan, self.channels = plan, channels
        self.active = _replayed(plan) if replicas else [True] * plan.world
        self.devs = [_Device(dp.instrs if on else ()) for dp, on in zip(plan.devices, self.active,
                                                                      strict=True)]
        self.match: dict[tuple, dict[int, _Op]] = defaultdict(dict)   # key -> device -> op
        self.op_at: dict[tuple[int, int], _Op] = {}
        self.arrived: dict[tuple, set[int]] = defaultdict(set)   # token-count exchanges
        self.members: dict[tuple, int] = {}   # group -> members replayed

    def run(self) -> list[int]:
        todo = [d for d in range(len(self.devs)) if self.active[d]]
        queued = set(todo)
        while todo:
            d = todo.pop()
            queued.discard(d)
            for other in self.step(d):
                if other not in queued:
                    queued.add(other)
                    todo.append(other)
        return [d for d, dev in enumerate(self.devs) if self.active[d] and (
            dev.host < len(dev.instrs) or dev.done < len(dev.stream)
            or any(dev.heads[c] < len(q) for c, q in dev.queues.items()))]

    def step(self, d: int) -> set[int]:
        """Advance device d as far as it goes; the devices to look at again."""
        dev, woken = self.devs[d], set()
        while True:
            moved = self.queue(d, dev, woken)
            while dev.done < len(dev.stream):   # the compute stream
                e = dev.stream[dev.done]
                if e is not None and not e.done:
                    break
                dev.done += 1
                moved = True
            for chan, q in dev.queues.items():
                h = dev.heads[chan]
                if h < len(q) and dev.done >= q[h].c_dep:
                    started = self.start(q[h])
                    if started:
                        woken |= started
                        moved = True
            if not moved:
                woken.discard(d)
                return woken

    def queue(self, d: int, dev: _Device, woken: set[int]) -> bool:
        """The host queues instructions until a token-count exchange makes it wait."""
        moved = False
        while dev.host < len(dev.instrs):
            i, ins = dev.host, dev.instrs[dev.host]
            kind = ins.kind
            if kind in COMPUTE:
                dev.stream.append(None)
            elif kind == Op.WAIT:
                dev.stream.append(self.op_at[(d, ins.target)])
            elif kind in COMM:
                if ins.is_counted_dispatch:
                    # the host exchanges its own token counts (its compute must have run)
                    group = tuple(ins.group)
                    token = (group, dev.meets[group])
                    if dev.done < len(dev.stream):
                        break
                    if d not in self.arrived[token]:
                        self.arrived[token].add(d)
                        woken.update(group)
                    if len(self.arrived[token]) < self.replayed(group):
                        break
                    dev.meets[group] += 1
                self.post(d, dev, i, ins)
            dev.host += 1
            moved = True
        return moved

    def replayed(self, group: tuple) -> int:
        n = self.members.get(group)
        if n is None:
            n = self.members[group] = sum(1 for m in group if self.active[m])
        return n

    def post(self, d: int, dev: _Device, i: int, ins) -> None:
        chan = _channel(d, ins, self.channels)
        if ins.kind == Op.SEND or ins.kind == Op.RECV:
            src, dst = (d, ins.peer) if ins.kind == Op.SEND else (ins.peer, d)
            side = (src, dst, ins.kind)
            key = ("p2p", src, dst, dev.counts[side])
            dev.counts[side] += 1
        else:
            key = (chan, dev.counts[chan])
            dev.counts[chan] += 1
        q = dev.queues.get(chan)
        if q is None:
            q = dev.queues[chan] = []
            dev.heads[chan] = 0
        op = _Op(d, i, chan, len(q), len(dev.stream), key)
        q.append(op)
        self.op_at[(d, i)] = op
        self.match[key][d] = op

    def ready(self, op: _Op) -> bool:
        dev = self.devs[op.dev]
        return dev.heads[op.chan] == op.pos and dev.done >= op.c_dep

    def start(self, op: _Op) -> set[int]:
        """Start the head `op` with its counterparts, if they are there too."""
        members = self.match[op.key]
        ins = self.devs[op.dev].instrs[op.idx]
        if ins.kind == Op.SEND or ins.kind == Op.RECV:
            if len(members) < 2:
                return set()
            a, b = members.values()
            if not (self.ready(a) and self.ready(b)):
                return set()
            self.check_pair(a, b)
        elif (len(members) < self.replayed(tuple(ins.group))
              or not all(self.ready(o) for o in members.values())):
            return set()
        for o in members.values():
            o.done = True
            self.devs[o.dev].heads[o.chan] += 1
        return set(members)

    def check_pair(self, a: _Op, b: _Op) -> None:
        ia, ib = self.devs[a.dev].instrs[a.idx], self.devs[b.dev].instrs[b.idx]
        send, recv, s_ins, r_ins = (a, b, ia, ib) if ia.kind == Op.SEND else (b, a, ib, ia)
        if s_ins.tag != r_ins.tag:
            raise PlanError(
                f"NCCL would swap messages: device {send.dev}'s send {s_ins} meets device "
                f"{recv.dev}'s receive {r_ins}, posted for another message (NCCL matches a "
                "pair's messages by order, not tag): the values would land in the wrong "
                "buffers. Receives must be posted in the order their sender sends\n"
                + _queues(self, [send.dev, recv.dev], marked={send, recv}))


def _replayed(plan: Plan) -> list[bool]:
    """`Plan.replayed`: a replayed device then only meets replayed ones, or, in a
    collective, members that do what their replayed template does."""
    return plan.replayed()


def check_nccl(plan: Plan, channels: str = "direction", replicas: bool = True) -> None:
    """Raise PlanError unless the plan runs to its end under NCCL's semantics."""
    if channels not in ("direction", "pair"):
        raise ValueError(f"channels must be 'direction' or 'pair', got {channels!r}")
    run = _Run(plan, channels, replicas)
    stuck = run.run()
    if stuck:
        raise PlanError("NCCL deadlock: under NCCL's in-order streams no device can go on (gloo, "
                        "which matches messages by tag, hides this); the operations each one "
                        "waits on are marked\n" + _queues(run, stuck))


def _queues(run: _Run, which, marked=frozenset(), context: int = 4) -> str:
    lines = []
    for d in which:
        dev = run.devs[d]
        lines.append(f"device {d}:")
        if dev.done < len(dev.stream):
            e = dev.stream[dev.done]
            lines.append(f"  compute stream at >wait({dev.instrs[e.idx]})<")
        if dev.host < len(dev.instrs):
            lines.append(f"  host at >{dev.instrs[dev.host]}< (exchanging token counts)")
        for chan, q in sorted(dev.queues.items(), key=lambda kv: str(kv[0])):
            at = dev.heads[chan]
            h = q[at] if at < len(q) else None
            if h is None and not any(o in marked for o in q):
                continue
            cells = []
            for o in q[max(0, at - context): at + context]:
                text = str(dev.instrs[o.idx])
                if o in marked or (not marked and o is h):
                    text = f">{text}<"
                elif o.done:
                    text = f"({text})"
                cells.append(text)
            lines.append(f"  {_chan_text(chan)}: " + " ".join(cells))
    return "\n".join(lines) + "\n(>x< marks the blocked or swapped operations; (x) are done)"


def _chan_text(chan: tuple) -> str:
    if chan[0] == "p2p":
        return f"stream {chan[1]}->{chan[2]}"
    if chan[0] == "pair":
        return f"stream {chan[1]}<->{chan[2]}"
    return f"group {list(chan[1])}"
