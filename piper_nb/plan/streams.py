"""The stream program: what a GPU runs for a device plan, the value the runtime executes and
the NCCL check replays (`plan.streams()`).

A device plan is a host's instruction list. On a GPU the host only *launches*: each
instruction puts operations at the end of CUDA streams, and what runs when is decided by
those streams, their events and NCCL's communicators. The stream program writes that
down, per device, as the host's launches in order (`Launch`): each names its stream, what
it does there (`Step`) and, for communication, its communicator.

- `compute` is the stream every pass (F, B, BI, BW, U) runs on, in plan order.
- Every communication op runs on its communicator's own stream, `nccl:<communicator>`,
  as ProcessGroupNCCL runs it: one communicator per collective group (`group:0,1`), and
  one per *direction* of each pair that exchanges messages (`p2p:0>1`), so a receive
  waiting at the head of one direction never holds up the other. Operations on one
  communicator complete in the order they were launched (its stream is a FIFO).
- An op first waits for what the compute stream held when the host launched it (NCCL's
  `syncStream`): the compute stream records `i<k>`, the communicator's stream waits for
  it. When the op is done its stream records `d<k>`; the instruction's WAIT makes the
  compute stream wait for `d<k>`, and the host goes on (`work.wait()` on NCCL).
- A host synchronisation (`Step.SYNC`) stops the host until a stream has run everything
  launched on it so far: before a forward token dispatch (the host needs the token counts
  the router computed, and exchanges them with its group: `Step.EXCHANGE`), and at the
  end of the step (the loss and the gradient norm are read once, there).

Nothing about streams is decided anywhere else: the runtime executes these launches
(`runtime.streams`: on CUDA through PyTorch's streams and ProcessGroupNCCL, on CPU as one
thread per stream over gloo, `LocalCluster(comm="nccl-emulated")`), and `compiler.nccl`
replays them under NCCL's rules. The text form (`print(plan.streams())`, one line per
stream) reads back with `StreamProgram.from_text`:

    dev0
      compute: r0:F0 rec(i2) r0:F1 rec(i4) wait(d2) r1:F0 ...
      nccl:p2p:0>1: wait(i2) r0:SEND_F0>1 rec(d2) ...
      host: sync(compute)@end
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from piper_nb.ir.kinds import COMM, COMPUTE, Op

__all__ = ["Step", "Launch", "DeviceStreams", "StreamProgram", "COMPUTE_STREAM", "HOST",
           "communicator", "comm_stream", "lower_streams", "communicators", "families"]

COMPUTE_STREAM = "compute"
HOST = "host"            # not a stream: what the host itself does (syncs, count exchanges)
END = -1                 # the instruction index of the step's end


class Step(StrEnum):
    """What a launch does on its stream (or, for SYNC and EXCHANGE, on the host)."""

    RUN = "run"            # a compute instruction (a pass or the update)
    COMM = "comm"          # a communication op, on its communicator's stream
    RECORD = "rec"         # record an event
    WAIT = "wait"          # the stream waits for an event
    SYNC = "sync"          # the host waits until `stream` ran all launched on it so far
    EXCHANGE = "exchange"  # the host exchanges token counts with `comm`'s group (blocking)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Launch:
    """One thing the host launches, in host order."""

    step: Step
    stream: str                 # the stream it goes on (SYNC: the stream waited for)
    instr: int = END            # the device plan's instruction it belongs to
    event: str = ""             # RECORD / WAIT: the event
    comm: str = ""              # COMM / EXCHANGE: the communicator

    def text(self, instrs=None) -> str:
        """The launch in the text form: an instruction's own text for RUN and COMM, `rec(e)`,
        `wait(e)` (with `@k` when it belongs to another instruction than the one that
        records `e`), `sync(stream)@k`, `exchange(comm)@k` (`@end`: the step's end)."""
        if self.step == Step.RUN or self.step == Step.COMM:
            return str(instrs[self.instr]) if instrs is not None else f"{self.step}#{self.instr}"
        where = "@end" if self.instr == END else f"@{self.instr}"
        if self.step == Step.SYNC:
            return f"sync({self.stream}){where}"
        if self.step == Step.EXCHANGE:
            return f"exchange({self.comm}){where}"
        if self.step == Step.WAIT and event_instr(self.event) != self.instr:
            return f"wait({self.event}){where}"
        return f"{self.step}({self.event})"


def event_instr(event: str) -> int:
    """The instruction that records `event`: events are named by a letter and its index
    (`i3`: the compute stream's state when instruction 3 was launched, `d3`: instruction
    3's op done)."""
    digits = event.lstrip("abcdefghijklmnopqrstuvwxyz")
    return int(digits) if digits.isdigit() else END


def communicator(device: int, ins) -> str:
    """The communicator a communication instruction of `device` runs on: `p2p:src>dst` for
    point-to-point (one per direction), `group:r0,r1,...` for a collective (ranks in group
    order)."""
    if ins.kind == Op.SEND:
        return f"p2p:{device}>{ins.data.peer}"
    if ins.kind == Op.RECV:
        return f"p2p:{ins.data.peer}>{device}"
    return "group:" + ",".join(map(str, ins.data.group))


def comm_stream(comm: str) -> str:
    """The stream a communicator's operations run on."""
    return f"nccl:{comm}"


def comm_ranks(comm: str) -> tuple[int, ...]:
    """The ranks of a communicator, in its order (`p2p:a>b`: (a, b))."""
    kind, _, rest = comm.partition(":")
    if kind == "p2p":
        a, _, b = rest.partition(">")
        return int(a), int(b)
    return tuple(int(r) for r in rest.split(","))


@dataclass(frozen=True)
class DeviceStreams:
    """One device's launches, in host order, and the instructions they belong to."""

    device: int
    launches: tuple[Launch, ...]
    instrs: tuple = field(default=(), compare=False, repr=False)

    def streams(self) -> dict[str, tuple[Launch, ...]]:
        """Stream -> its launches in order (host steps under `host`)."""
        out: dict[str, list[Launch]] = {}
        for x in self.launches:
            name = HOST if x.step in (Step.SYNC, Step.EXCHANGE) else x.stream
            out.setdefault(name, []).append(x)
        return {k: tuple(v) for k, v in out.items()}

    def by_instr(self) -> dict[int, tuple[Launch, ...]]:
        """Instruction index -> the launches it makes (END: the step's end)."""
        out: dict[int, list[Launch]] = {}
        for x in self.launches:
            out.setdefault(x.instr, []).append(x)
        return {k: tuple(v) for k, v in out.items()}

    def text(self) -> str:
        """`dev0`, then one line per stream (and `host:` for the host's own steps)."""
        instrs = self.instrs or None
        lines = [f"dev{self.device}"]
        for name, launches in self.streams().items():
            lines.append(f"  {name}: " + " ".join(x.text(instrs) for x in launches))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


class StreamProgram:
    """Every device's `DeviceStreams` (lowered on first use: a plan of thousands of replicas
    lowers only the devices asked for)."""

    def __init__(self, plan, devices: dict[int, DeviceStreams] | None = None):
        self.plan = plan
        self.world = plan.world if plan is not None else len(devices or {})
        self._made: dict[int, DeviceStreams] = dict(devices or {})

    def __getitem__(self, device: int) -> DeviceStreams:
        made = self._made.get(device)
        if made is None:
            made = self._made[device] = lower_streams(self.plan, device)
        return made

    def __iter__(self) -> Iterator[DeviceStreams]:
        return (self[d] for d in range(self.world))

    def __len__(self) -> int:
        return self.world

    def __eq__(self, other) -> bool:
        return isinstance(other, StreamProgram) and self.world == other.world and all(
            self[d].launches == other[d].launches for d in range(self.world))

    def text(self) -> str:
        return "\n".join(self[d].text() for d in range(self.world))

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"StreamProgram({self.world} devices)"

    def __reduce__(self):
        """Pickled as the launches of every device (lowered now), without the plan."""
        made = {d: (self[d].device, self[d].launches) for d in range(self.world)}
        return (_rebuilt, (self.world, made))

    def to_json(self) -> list:
        return [[_launch_json(x) for x in self[d].launches] for d in range(self.world)]

    @classmethod
    def from_json(cls, obj: list, plan=None) -> StreamProgram:
        devices = {d: DeviceStreams(d, tuple(_launch_from(x) for x in launches),
                                    plan.devices[d].instrs if plan is not None else ())
                   for d, launches in enumerate(obj)}
        out = cls(plan, devices)
        out.world = len(devices)
        return out

    @classmethod
    def from_text(cls, text: str, plan) -> StreamProgram:
        """The program `text()` wrote, read against `plan` (whose instructions name the RUN
        and COMM launches). Each stream keeps its order; the host order is rebuilt
        instruction by instruction: its host steps, then its stream launches, a stream
        taking its turn (compute first) unless its next launch waits for an event not
        recorded yet."""
        devices: dict[int, DeviceStreams] = {}
        lines: dict[str, list[str]] = {}
        current = None
        for line in [*text.splitlines(), "dev-1"]:
            if line.startswith("dev"):
                if current is not None:
                    devices[current] = _read_device(current, lines, plan)
                current, lines = int(line[3:]), {}
            elif line.strip():
                name, _, body = line.strip().partition(": ")
                lines[name] = body.split(" ") if body else []
        out = cls(plan, devices)
        out.world = len(devices)
        return out


def _rebuilt(world: int, made: dict) -> StreamProgram:
    out = StreamProgram(None, {d: DeviceStreams(dev, launches) for d, (dev, launches) in made.items()})
    out.world = world
    return out


def _launch_json(x: Launch) -> dict:
    out = {"step": str(x.step), "stream": x.stream, "instr": x.instr}
    if x.event:
        out["event"] = x.event
    if x.comm:
        out["comm"] = x.comm
    return out


def _launch_from(obj: dict) -> Launch:
    return Launch(Step(obj["step"]), obj["stream"], obj.get("instr", END), obj.get("event", ""),
                  obj.get("comm", ""))


def _read_device(device: int, lines: dict[str, list[str]], plan) -> DeviceStreams:
    instrs = plan.devices[device].instrs
    where: dict[str, list[int]] = {}
    for k, ins in enumerate(instrs):
        where.setdefault(str(ins), []).append(k)
    taken: dict[str, int] = {}
    per_instr: dict[int, dict[str, list[Launch]]] = {}
    for name, tokens in lines.items():
        for tok in tokens:
            x = _token(name, tok, where, taken)
            per_instr.setdefault(x.instr, {}).setdefault(
                HOST if name == HOST else x.stream, []).append(x)
    out: list[Launch] = []
    recorded: set[str] = set()
    for k in sorted(per_instr, key=lambda k: (k == END, k)):
        streams = per_instr[k]
        out += streams.pop(HOST, [])
        order = sorted(streams, key=lambda s: (s != COMPUTE_STREAM, s))
        heads = dict.fromkeys(order, 0)
        while any(heads[s] < len(streams[s]) for s in order):
            for s in order:
                if heads[s] < len(streams[s]):
                    x = streams[s][heads[s]]
                    if x.step == Step.WAIT and x.event not in recorded and \
                            any(y.event == x.event and y.step == Step.RECORD
                                for t in order for y in streams[t][heads[t]:]):
                        continue
                    heads[s] += 1
                    out.append(x)
                    if x.step == Step.RECORD:
                        recorded.add(x.event)
                    break
            else:
                raise ValueError(f"device {device}: the launches of instruction {k} wait for "
                                 "events nothing records")
    return DeviceStreams(device, tuple(out), instrs)


def _token(stream: str, tok: str, where: dict, taken: dict) -> Launch:
    head, _, at = tok.partition(")@")
    instr = END if at == "end" else int(at) if at else None
    if stream == HOST:
        if head.startswith("sync("):
            return Launch(Step.SYNC, head[5:], instr)
        return Launch(Step.EXCHANGE, HOST, instr, comm=head[9:])
    if tok.startswith(("rec(", "wait(")):
        step = Step.RECORD if tok.startswith("rec(") else Step.WAIT
        event = head[head.index("(") + 1:].rstrip(")")
        return Launch(step, stream, instr if instr is not None else event_instr(event), event)
    k = where[tok][taken.get(tok, 0)]
    taken[tok] = taken.get(tok, 0) + 1
    if stream == COMPUTE_STREAM:
        return Launch(Step.RUN, stream, k)
    return Launch(Step.COMM, stream, k, comm=stream.removeprefix("nccl:"))


def lower_streams(plan, device: int) -> DeviceStreams:
    """Device `device`'s launches: the layout the runtime executes (module docstring)."""
    instrs = plan.devices[device].instrs
    out: list[Launch] = []
    for k, ins in enumerate(instrs):
        if ins.kind in COMPUTE:
            out.append(Launch(Step.RUN, COMPUTE_STREAM, k))
        elif ins.kind in COMM:
            comm = communicator(device, ins)
            stream = comm_stream(comm)
            if ins.is_counted_dispatch:   # the token counts: on the host, then exchanged
                out.append(Launch(Step.SYNC, COMPUTE_STREAM, k))
                out.append(Launch(Step.EXCHANGE, HOST, k, comm=comm))
            out += [Launch(Step.RECORD, COMPUTE_STREAM, k, f"i{k}"),
                    Launch(Step.WAIT, stream, k, f"i{k}"),
                    Launch(Step.COMM, stream, k, comm=comm),
                    Launch(Step.RECORD, stream, k, f"d{k}")]
        elif ins.kind == Op.WAIT:
            out.append(Launch(Step.WAIT, COMPUTE_STREAM, k, f"d{ins.data.target}"))
    streams = {COMPUTE_STREAM, *(x.stream for x in out)}
    out += [Launch(Step.SYNC, s, END) for s in sorted(streams, key=lambda s: (s != COMPUTE_STREAM, s))]
    return DeviceStreams(device, tuple(out), instrs)


def communicators(plan) -> list[str]:
    """Every communicator the plan's devices use, in one order every rank computes alike."""
    found: set[str] = set()
    for dp in plan.devices:
        instrs = dp.stamped() if hasattr(dp, "stamped") else dp.instrs   # stamped: not kept
        for ins in instrs:
            if ins.kind in COMM:
                found.add(communicator(dp.device, ins))
    return sorted(found, key=_comm_sort)


def _comm_sort(comm: str) -> tuple:
    return (not comm.startswith("group:"), comm_ranks(comm), comm)


def families(comms: list[str]) -> list[list[str]]:
    """The communicators in families of pairwise disjoint rank sets (first fit, in order): a
    family is made by one split of the world (`dist.split_group`), so creating them costs
    one world-wide call per family instead of one per communicator. Both directions of a
    pair share their ranks, so they fall in different families."""
    out: list[tuple[set[int], list[str]]] = []
    for c in comms:
        ranks = set(comm_ranks(c))
        for used, fam in out:
            if not (used & ranks):
                used |= ranks
                fam.append(c)
                break
        else:
            out.append((set(ranks), [c]))
    return [fam for _, fam in out]
