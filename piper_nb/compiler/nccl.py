"""The NCCL check: a plan's stream program (`plan.streams()`, what the runtime executes on
GPUs) replayed under NCCL's rules.

gloo matches point-to-point messages by tag, so a plan that the deadlock dry run accepts
runs on CPU whatever order its messages are posted in. NCCL does not (NVIDIA/nccl issues
479 and 783; PyTorch's ProcessGroupNCCL), and a GPU runs the stream program, not the plan:

- the host launches each device's operations in order and blocks only at a host
  synchronisation (`sync`: until that stream ran everything launched on it so far) or a
  token-count exchange (`exchange`: until every member of the group is there);
- the operations on one CUDA stream complete in order; a `wait` blocks the stream that
  waits until its event is recorded;
- every communicator is a FIFO: a device's k-th operation on it starts after its (k-1)-th
  completed, and meets the k-th operation of the other members;
- point-to-point ignores tags: the k-th operation of a direction's communicator on the
  sender meets the k-th on the receiver, and both block until the other is there; a send
  meeting a send (one communicator for both directions) never completes;
- a collective completes when every member's k-th operation on that communicator has
  started, and they must be the same collective.

`check_nccl(plan)` replays `plan.streams()`. `channels="pair"` first gives both directions of
a pair one communicator, PyTorch's default layout without per-direction groups (plans do
not need to pass it). A send meeting a receive made for another message (the values would
land in the wrong buffers, silently), collectives that differ, or no way forward (a
deadlock) is a PlanError printing the streams involved with the operations marked.
Devices the lowering stamped from a template (`Plan.replayed`) are not replayed when all
their point-to-point peers are: a collective then waits for its replayed members only.
"""

from __future__ import annotations

from collections import defaultdict

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op
from piper_nb.plan.plan import Plan
from piper_nb.plan.streams import (
    DeviceStreams,
    Launch,
    Step,
    StreamProgram,
    comm_ranks,
)

__all__ = ["check_nccl", "paired"]


def paired(program: StreamProgram) -> StreamProgram:
    """`program` with both directions of each pair on one communicator (`pair:a,b`) and one
    stream: what PyTorch gives without a group per direction."""
    devices = {}
    for ds in program:
        launches = []
        for x in ds.launches:
            if x.comm.startswith("p2p:"):
                a, b = comm_ranks(x.comm)
                comm = f"pair:{min(a, b)},{max(a, b)}"
                x = Launch(x.step, f"nccl:{comm}", x.instr, x.event, comm)
            elif x.stream.startswith("nccl:p2p:"):
                a, b = comm_ranks(x.stream.removeprefix("nccl:"))
                x = Launch(x.step, f"nccl:pair:{min(a, b)},{max(a, b)}", x.instr, x.event, x.comm)
            launches.append(x)
        devices[ds.device] = DeviceStreams(ds.device, tuple(launches), ds.instrs)
    out = StreamProgram(program.plan, devices)
    out.world = program.world
    return out


class _Dev:
    __slots__ = ("ds", "host", "streams", "heads", "events", "comm_next", "comm_done", "ops",
                 "sync", "exchanges", "stuck_at")

    def __init__(self, ds: DeviceStreams | None):
        self.ds = ds
        self.host = 0
        self.streams: dict[str, list[Launch]] = defaultdict(list)
        self.heads: dict[str, int] = defaultdict(int)
        self.events: set[str] = set()
        self.comm_next: dict[str, int] = defaultdict(int)
        self.comm_done: dict[str, int] = defaultdict(int)
        self.ops: dict[tuple[str, int], tuple[str, int]] = {}   # (stream, pos) -> (comm, k)
        self.sync: tuple[str, int] | None = None     # the sync the host waits at
        self.exchanges: dict[str, int] = defaultdict(int)

    @property
    def launches(self) -> tuple[Launch, ...]:
        return self.ds.launches if self.ds is not None else ()

    def finished(self) -> bool:
        return self.host >= len(self.launches) and all(
            self.heads[s] >= len(q) for s, q in self.streams.items())


class _Run:
    def __init__(self, plan: Plan, program: StreamProgram, replicas: bool = True):
        self.plan = plan
        self.active = plan.replayed() if replicas else [True] * plan.world
        self.devs = [_Dev(program[d] if on else None) for d, on in enumerate(self.active)]
        self.match: dict[tuple[str, int], dict[int, tuple[str, int]]] = defaultdict(dict)
        self.arrived: dict[tuple[str, int], set[int]] = defaultdict(set)
        self.members: dict[str, int] = {}

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
        return [d for d, dev in enumerate(self.devs) if self.active[d] and not dev.finished()]

    def replayed(self, comm: str) -> int:
        n = self.members.get(comm)
        if n is None:
            n = self.members[comm] = sum(1 for m in set(comm_ranks(comm)) if self.active[m])
        return n

    def step(self, d: int) -> set[int]:
        """Advance device d as far as it goes; the devices to look at again."""
        dev, woken = self.devs[d], set()
        while True:
            moved = self.push(d, dev, woken)
            for s, q in dev.streams.items():
                while dev.heads[s] < len(q):
                    x = q[dev.heads[s]]
                    if x.step == Step.WAIT and x.event not in dev.events:
                        break
                    if x.step == Step.COMM:
                        started = self.start(*dev.ops[(s, dev.heads[s])])
                        if not started:
                            break
                        woken |= started
                        moved = True
                        continue
                    if x.step == Step.RECORD:
                        dev.events.add(x.event)
                    dev.heads[s] += 1
                    moved = True
            if not moved:
                woken.discard(d)
                return woken

    def push(self, d: int, dev: _Dev, woken: set[int]) -> bool:
        """The host launches until a sync or an exchange holds it."""
        moved = False
        launches = dev.launches
        while dev.host < len(launches):
            x = launches[dev.host]
            if x.step == Step.SYNC:
                if dev.sync is None:
                    dev.sync = (x.stream, len(dev.streams[x.stream]))
                if dev.heads[x.stream] < dev.sync[1]:
                    return moved
                dev.sync = None
            elif x.step == Step.EXCHANGE:
                token = (x.comm, dev.exchanges[x.comm])
                if d not in self.arrived[token]:
                    self.arrived[token].add(d)
                    woken.update(m for m in comm_ranks(x.comm) if self.active[m])
                if len(self.arrived[token]) < self.replayed(x.comm):
                    return moved
                dev.exchanges[x.comm] += 1
            else:
                q = dev.streams[x.stream]
                if x.step == Step.COMM:
                    k = dev.comm_next[x.comm]
                    dev.comm_next[x.comm] = k + 1
                    dev.ops[(x.stream, len(q))] = (x.comm, k)
                    self.match[(x.comm, k)][d] = (x.stream, len(q))
                q.append(x)
            dev.host += 1
            moved = True
        return moved

    def at_head(self, d: int, comm: str, k: int) -> bool:
        dev = self.devs[d]
        s, pos = self.match[(comm, k)][d]
        return dev.heads[s] == pos and dev.comm_done[comm] == k

    def start(self, comm: str, k: int) -> set[int]:
        """Start the k-th op of `comm` with its counterparts, if they are there too."""
        members = self.match[(comm, k)]
        need = 2 if not comm.startswith("group:") else self.replayed(comm)
        if len(members) < need or not all(self.at_head(m, comm, k) for m in members):
            return set()
        if not self.compatible(comm, k, members):
            return set()
        for m, (s, _) in members.items():
            dev = self.devs[m]
            dev.heads[s] += 1
            dev.comm_done[comm] += 1
        return set(members)

    def instr(self, d: int, comm: str, k: int):
        dev = self.devs[d]
        s, pos = self.match[(comm, k)][d]
        return dev.ds.instrs[dev.streams[s][pos].instr]

    def compatible(self, comm: str, k: int, members) -> bool:
        """Point-to-point: a send meets a receive (a send meeting a send never completes)
        of the same message; a collective: the same collective on every member."""
        ops = {m: self.instr(m, comm, k) for m in members}
        if not comm.startswith("group:"):
            (a, ia), (b, ib) = ops.items()
            if {ia.kind, ib.kind} != {Op.SEND, Op.RECV}:
                return False
            (sd, s_ins), (rd, r_ins) = sorted(ops.items(), key=lambda kv: kv[1].kind != Op.SEND)
            if s_ins.data.tag != r_ins.data.tag:
                raise PlanError(
                    f"NCCL would swap messages: device {sd}'s send {s_ins} meets device {rd}'s "
                    f"receive {r_ins}, posted for another message (NCCL matches a pair's "
                    "messages by order, not tag): the values would land in the wrong buffers. "
                    "Receives must be posted in the order their sender sends\n"
                    + _streams(self, [sd, rd], marked={(sd, comm, k), (rd, comm, k)}))
            return True
        sig = {m: (i.kind, i.bucket, i.purpose, len(i.data.values)) for m, i in ops.items()}
        if len(set(sig.values())) > 1:
            shown = ", ".join(f"device {m}: {ops[m]}" for m in sorted(ops))
            raise PlanError(f"NCCL would run different collectives together as operation {k} of "
                            f"communicator {comm} ({shown}): every member must issue its "
                            "collectives on a group in one order\n"
                            + _streams(self, sorted(ops), marked={(m, comm, k) for m in ops}))
        return True


def check_nccl(plan: Plan, channels: str = "direction", replicas: bool = True,
               program: StreamProgram | None = None) -> None:
    """Raise PlanError unless the stream program (`plan.streams()`, or `program`) runs to its
    end under NCCL's semantics."""
    if channels not in ("direction", "pair"):
        raise ValueError(f"channels must be 'direction' or 'pair', got {channels!r}")
    program = program if program is not None else plan.streams()
    if channels == "pair":
        program = paired(program)
    run = _Run(plan, program, replicas)
    stuck = run.run()
    if stuck:
        raise PlanError("NCCL deadlock: under NCCL's in-order streams no device can go on (gloo, "
                        "which matches messages by tag, hides this); the operations each stream "
                        "waits on are marked\n" + _streams(run, stuck))


def _streams(run: _Run, which, marked=frozenset(), context: int = 4) -> str:
    lines = []
    for d in which:
        dev = run.devs[d]
        instrs = dev.ds.instrs
        lines.append(f"device {d}:")
        if dev.host < len(dev.launches):
            lines.append(f"  host at >{dev.launches[dev.host].text(instrs)}<")
        mark_pos = {run.match[(c, k)][m] for m, c, k in marked if m == d}
        for s, q in sorted(dev.streams.items()):
            at = dev.heads[s]
            if at >= len(q) and not any((s, p) in mark_pos for p in range(len(q))):
                continue
            cells = []
            for p in range(max(0, at - context), min(len(q), at + context)):
                text = q[p].text(instrs)
                if (s, p) in mark_pos or (not mark_pos and p == at):
                    text = f">{text}<"
                elif p < at:
                    text = f"({text})"
                cells.append(text)
            lines.append(f"  {s}: " + " ".join(cells))
    return "\n".join(lines) + "\n(>x< marks the blocked or swapped operations; (x) are done)"
