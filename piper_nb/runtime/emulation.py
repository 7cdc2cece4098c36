"""NCCL on CPU: a device's stream program run the way a GPU runs it, so that CI fails where a
GPU cluster would hang (`pn.LocalCluster(n, comm="nccl-emulated")`).

- The host is the compute stream: a pass runs when the host reaches it, and a `wait` on
  the compute stream blocks the host until its event is recorded (on a GPU the host would
  go on launching, but everything it launches after that first waits for the compute
  stream, so nothing can start sooner).
- Every other stream is a thread that executes its launches in order: a `wait` blocks that
  thread, a `rec` sets an event, a communication op runs *blocking*, on a gloo group of
  its own per communicator. So each communicator is a FIFO, and a stream that waits for a
  transfer (the old `on_stream` coupling) holds up everything queued behind it.
- Point-to-point meets as NCCL's does, by order and not by tag: the receiver first sends
  the sender what it expects (its tag), the sender checks it, then sends; both block until
  the other is there, and a mismatch is an error naming both messages. A collective first
  all-gathers what each member is about to run and refuses to run different collectives.
- A tensor given to a communication op must be one a CUDA worker would hold on its GPU:
  `HostTensors` tracks, during the step, the tensors a CUDA worker would make on the host
  (factories without a device, `.cpu()`, and what is computed only from those), and a
  transfer of one is an error (NCCL refuses CPU tensors).
- A host that waits longer than the cluster's timeout raises, naming every stream that is
  stuck and on what (`EmulationStuck`).

Every thread records what it executed (`log`), which `tests/runtime/test_streams_run.py`
compares with the program.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from piper_nb.ir.kinds import Op
from piper_nb.plan.streams import COMPUTE_STREAM, DeviceStreams, Launch, Step, event_instr

__all__ = ["EmulatedStreams", "EmulationStuck", "HostTensors"]

_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_KIND_CODE = {k: i for i, k in enumerate(Op)}


class EmulationStuck(RuntimeError):
    """The emulated NCCL program cannot go on: a GPU cluster would hang here."""


class HostTensors(TorchFunctionMode):
    """The tensors a CUDA worker would hold on the host, tracked while the step runs."""

    FACTORIES = frozenset({torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full,
                           torch.arange, torch.rand, torch.randn, torch.randint,
                           torch.linspace, torch.as_tensor, torch.scalar_tensor})

    def __init__(self):
        super().__init__()
        self.host: dict[int, weakref.ref] = {}    # id -> a weak reference to the tensor

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def clear(self) -> None:
        self.host = {}

    def _mark(self, t: torch.Tensor, host: bool) -> None:
        key, table = id(t), self.host
        if host:
            table[key] = weakref.ref(t, lambda _r, key=key, table=table: table.pop(key, None))
        else:
            table.pop(key, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        where = self._where(func, args, kwargs)
        if where is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark(t, where)
        return out

    def _where(self, func, args, kwargs) -> bool | None:
        """True: on the host; False: on the device; None: not a tensor made here."""
        if func is torch.Tensor.cpu:
            return True
        moved = kwargs.get("device") is not None or (
            func in (torch.Tensor.to, torch.Tensor.cuda)
            and any(isinstance(a, (torch.device, str)) for a in args[1:]))
        if moved or func is torch.Tensor.cuda:
            return False
        if func in self.FACTORIES:
            return True
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not ins:
            return None
        return all(self.is_host(t) for t in ins)


def _event(events: dict, name: str) -> threading.Event:
    """The step's event `name`, made by whichever thread asks first (`setdefault` is atomic:
    two threads asking at once get the same event, so no wake-up is lost)."""
    ev = events.get(name)
    return ev if ev is not None else events.setdefault(name, threading.Event())


class _Work:
    """A transfer run by a stream thread: done when its thread recorded it."""

    def __init__(self):
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Thread:
    """One stream: a thread executing its launches in order."""

    def __init__(self, name: str, owner: EmulatedStreams):
        self.name, self.owner = name, owner
        self.queue: queue.Queue = queue.Queue()
        self.at: tuple[Launch, float] | None = None    # what it is executing, since when
        self.left = 0                                  # launches put and not yet executed
        self.drained = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=f"stream {name}", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        with self.drained:
            self.left += 1
        self.queue.put(item)

    def drain(self, timeout: float) -> bool:
        """Until everything put so far ran (False: not within `timeout` s)."""
        with self.drained:
            return self.drained.wait_for(lambda: self.left == 0, timeout)

    def _loop(self) -> None:
        while True:
            x, events, payload = self.queue.get()
            self.at = (x, time.monotonic())
            try:
                self.owner.execute(self.name, x, events, payload)
            except BaseException as err:   # the host raises it at its next wait
                self.owner.failed = self.owner.failed or (self.name, x, err)
            self.at = None
            with self.drained:
                self.left -= 1
                self.drained.notify_all()


class EmulatedStreams:
    """Runs a device's stream program with NCCL's semantics over gloo (module docstring)."""

    def __init__(self, comm, program: DeviceStreams, timeout: float):
        self.comm, self.timeout, self.program = comm, timeout, program
        self.launches = program.by_instr()
        self.threads: dict[str, _Thread] = {}
        self.events: dict[str, threading.Event] = {}
        self.works: dict[str, _Work] = {}
        self.log: dict[str, list[Launch]] = defaultdict(list)
        self.lock = threading.Lock()
        self.failed = None
        self.recording = False
        self.tracker = HostTensors()
        self.instrs = program.instrs

    # ---- the host ----------------------------------------------------------------------
    def begin_step(self, record: bool = False) -> None:
        self.events = {}
        self.works = {}
        self.log = defaultdict(list)
        self.recording = record
        self.failed = None
        self.tracker.clear()

    def _note(self, stream: str, x: Launch) -> None:
        if self.recording:
            with self.lock:
                self.log[stream].append(x)

    def launch(self, k: int, run=None, transfer=None, exchange=None):
        work = None
        for x in self.launches.get(k, ()):
            if x.step == Step.SYNC:
                self._note("host", x)
                self._drain(x.stream, x)
            elif x.step == Step.EXCHANGE:
                self._note("host", x)
                exchange()
            elif x.stream == COMPUTE_STREAM:
                self._note(COMPUTE_STREAM, x)
                if x.step == Step.RUN:
                    run()
                elif x.step == Step.RECORD:
                    _event(self.events, x.event).set()
                elif x.step == Step.WAIT:
                    self._wait_host(_event(self.events, x.event), x)
                else:
                    raise RuntimeError(f"{x.step} cannot run on the compute stream")
            else:
                payload = None
                if x.step == Step.COMM:
                    t = transfer()
                    self._check_device(t)
                    work = _Work()
                    payload = (t, work)
                elif x.step == Step.RECORD and work is not None:
                    self.works[x.event] = work
                elif x.step == Step.RUN:
                    raise RuntimeError(f"a pass on stream {x.stream!r}: the emulation runs "
                                       "passes on the compute stream only")
                self._thread(x.stream).put((x, self.events, payload))
        return [work] if work is not None else None

    def end_step(self) -> None:
        for x in self.launches.get(-1, ()):
            self._note("host", x)
            self._drain(x.stream, x)

    def _thread(self, name: str) -> _Thread:
        t = self.threads.get(name)
        if t is None:
            t = self.threads[name] = _Thread(name, self)
        return t

    def _wait_host(self, event: threading.Event, x: Launch) -> None:
        deadline = time.monotonic() + self.timeout
        while not event.wait(0.02):
            self._raise_failed()
            if time.monotonic() > deadline:
                raise self._stuck(f"the compute stream, for {self._event_text(x.event)}")
        self._raise_failed()

    def _drain(self, stream: str, x: Launch) -> None:
        if stream == COMPUTE_STREAM or stream not in self.threads:
            return
        deadline = time.monotonic() + self.timeout
        while not self.threads[stream].drain(0.02):
            self._raise_failed()
            if time.monotonic() > deadline:
                raise self._stuck(f"the host at {x.text(self.instrs)}")
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self.failed is not None:
            name, x, err = self.failed
            raise RuntimeError(f"stream {name} at {x.text(self.instrs)}: {err}") from err

    def _stuck(self, where: str) -> EmulationStuck:
        lines = [f"NCCL emulation: device {self.comm.rank} cannot go on after {self.timeout:g} s "
                 f"(a GPU cluster would hang here); it waits at {where}; its streams:"]
        now = time.monotonic()
        for name, th in sorted(self.threads.items()):
            at = th.at
            if at is None and th.left == 0:
                continue
            doing = at[0].text(self.instrs) if at else "idle"
            what = self._blocked_on(at[0]) if at else ""
            since = f" for {now - at[1]:.1f} s" if at else ""
            lines.append(f"  {name}: at {doing}{what}{since}, {th.queue.qsize()} launches queued")
        return EmulationStuck("\n".join(lines))

    def _blocked_on(self, x: Launch) -> str:
        if x.step == Step.WAIT:
            return f" (waiting for {self._event_text(x.event)})"
        if x.step == Step.COMM:
            ins = self.instrs[x.instr]
            who = f"device {ins.data.peer}" if ins.kind in (Op.SEND, Op.RECV) else \
                f"group {list(ins.data.group)}"
            return f" (waiting for {who} to run its matching operation on {x.comm})"
        return ""

    def _event_text(self, event: str) -> str:
        """What an event stands for: `d5` is instruction 5's transfer done, `i5` (or any
        other letter) the state of the stream that recorded it when 5 was launched."""
        k = event_instr(event)
        ins = self.instrs[k] if 0 <= k < len(self.instrs) else f"#{k}"
        return f"{ins} to complete" if event.startswith("d") else f"{event}, at {ins}'s launch"

    def _check_device(self, t) -> None:
        for b in t.bufs:
            if self.tracker.is_host(b):
                ins = self.instrs[t.index] if 0 <= t.index < len(self.instrs) else t.text
                raise RuntimeError(
                    f"{ins} on device {self.comm.rank} hands NCCL a tensor a CUDA worker would "
                    f"hold on the host (shape {tuple(b.shape)}, {b.dtype}): NCCL refuses CPU "
                    "tensors. Move it to the device before it is sent")

    # ---- the stream threads ------------------------------------------------------------
    def execute(self, stream: str, x: Launch, events, payload) -> None:
        if x.step == Step.WAIT:
            _event(events, x.event).wait()
        elif x.step == Step.RECORD:
            _event(events, x.event).set()
        elif x.step == Step.COMM:
            t, work = payload
            self._run(t)
            work.done.set()
        self._note(stream, x)

    def _run(self, t) -> None:
        """One transfer, blocking, as NCCL runs it on its communicator."""
        group = self.comm.group_of(t.comm)
        if t.kind == Op.SEND:
            want = torch.zeros(2, dtype=torch.int64)
            dist.recv(want, t.peer, group=group)     # the receiver is there, expecting...
            if int(want[0]) != t.tag or int(want[1]) != len(t.bufs):
                raise RuntimeError(
                    f"NCCL would swap messages on {t.comm}: this send ({t.text}, tag {t.tag}) "
                    f"meets a receive posted for message {int(want[0])} (NCCL matches a "
                    "pair's messages by order, not tag)")
            for b in t.bufs:
                dist.send(b, t.peer, group=group)
        elif t.kind == Op.RECV:
            dist.send(torch.tensor([t.tag, len(t.bufs)], dtype=torch.int64), t.peer, group=group)
            for b in t.bufs:
                dist.recv(b, t.peer, group=group)
        else:
            self._same_collective(t, group)
            self.comm.run_blocking(t, group)

    def _same_collective(self, t, group) -> None:
        n = dist.get_world_size(group)
        mine = torch.tensor([_KIND_CODE[t.kind], t.bufs[-1].numel()], dtype=torch.int64)
        every = torch.empty(2 * n, dtype=torch.int64)
        _AG(every, mine, group=group)
        got = every.view(n, 2).tolist()
        if any(g[0] != got[0][0] for g in got):
            kinds = [list(Op)[g[0]].value for g in got]
            raise RuntimeError(f"NCCL would run different collectives together on {t.comm}: "
                               f"{kinds} (this device: {t.text})")
