"""Communication for one worker: process groups, async issue, staged buffers, streams.

Every SEND/RECV and collective of a plan is issued asynchronously (`async_op=True`) and
returns a `Pending` that its WAIT completes, so transfers overlap the compute in between.
With gloo on CPU the transfer runs on gloo's threads; with NCCL each logical stream name
gets its own CUDA stream that first waits for the compute stream, and a WAIT makes the
compute stream wait for the transfer without blocking the host (the process group's
watchdog owns the timeout). Gloo with CUDA tensors (one GPU shared by several ranks)
stages buffers through host memory.

Communicators, the way NCCL needs them (`compiler.nccl` checks plans against this layout):
one process group per collective device group, and, on NCCL, one per *direction* of each
pair that exchanges messages, so a receive waiting at the head of one direction's stream
never holds up the other direction (gloo matches messages by tag: its point-to-point stays
on the default group, where extra groups would only add event-loop threads); within a
direction, receives are posted in the sender's order (`compiler.p2p`). All are created
when a plan is loaded, in one global order on every rank, and each is warmed up once then
with a one-element message, so none is first created in the middle of a step (where two
ranks could create two of them in opposite orders).
`gather_counts` (the token counts of an expert dispatch, known on the host) goes over a
CPU (gloo) group, without draining the GPU; `all_to_all` serves the token exchange.
Receive buffers on CPU are recycled across steps, as PyTorch's pipeline stages keep
theirs: after a step (`recycle`), a buffer nothing references any more is handed to the
next receive of its shape instead of a fresh allocation, whose page faults land on gloo's
thread while compute runs.

A worker pinned to a core of its own (`own_core`) yields that core right after posting a
message: the rest of the transfer (gloo's threads, the kernel's loopback delivery) needs
the same core, and the next pass would otherwise hold it for up to a scheduler slice. A
1F1B stage's first activation reached the next stage 1.5-1.75 ms after its send, not 0.2.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from piper_nb.trace import Memory

__all__ = ["Comm", "Pending"]

_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _unused(t: torch.Tensor) -> bool:
    """Nothing but `t` holds its storage (the query's own storage object counts one)."""
    return _USE_COUNT is not None and _USE_COUNT(t.untyped_storage()._cdata) <= 2


@dataclass
class Pending:
    """An issued communication until its WAIT."""

    index: int                      # the issuing instruction's index
    works: list
    tensors: list[torch.Tensor]     # buffers in flight (results for RECV / collectives)
    start: float
    end: float | None = None        # first time it was seen complete
    memory: Memory = Memory.BUFFERS  # the kind its new buffers count as
    new: list[torch.Tensor] = field(default_factory=list)   # buffers it allocated
    meta: object = None             # what its WAIT needs to unpack the results (ALL_TO_ALL)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.new)


class Comm:
    def __init__(self, rank: int, device: torch.device, backend: str,
                 per_direction: bool | None = None):
        self.rank, self.device, self.backend = rank, device, backend
        # one group per direction of each pair: what NCCL needs; gloo matches messages by
        # tag on the default group, and every extra gloo group costs an event-loop thread
        self.per_direction = backend != "gloo" if per_direction is None else per_direction
        self.stage = device.type == "cuda" and backend == "gloo"
        self.cuda = device.type == "cuda" and not self.stage   # NCCL on GPU tensors
        self.groups: dict[tuple[int, ...], object] = {}
        self.pairs: dict[tuple[int, int], object] = {}      # (src, dst) -> its direction's group
        self.cpu_groups: dict[tuple[int, ...], object] = {}  # token counts (NCCL plans)
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.pool: dict[tuple, list[torch.Tensor]] = {}   # (shape, dtype) -> spare buffers
        self.lent: list[torch.Tensor] = []                # receive buffers of this step
        self.own_core = False   # pinned alone on a core: yield it after posting a message

    def ensure_groups(self, groups, pairs=(), counted=()) -> None:
        """Create the process groups not made yet, and warm each new one up: collective
        `groups`, one group per direction of `pairs` ((src, dst)), CPU groups for the token
        counts of `counted` groups. Every rank calls this with the same lists."""
        new_groups = [g for g in sorted(set(tuple(x) for x in groups)) if g not in self.groups]
        for g in new_groups:
            self.groups[g] = self._new_group(g)
        new_pairs = [p for p in sorted(set(pairs)) if p not in self.pairs] \
            if self.per_direction else []
        for src, dst in new_pairs:
            self.pairs[(src, dst)] = dist.new_group(sorted((src, dst)))
        for g in sorted(set(tuple(x) for x in counted)):
            if g not in self.cpu_groups:
                self.cpu_groups[g] = (self._new_group(g, "gloo") if self.backend != "gloo"
                                      else self.groups.get(g) or self._new_group(g))
        self._warm_up(new_groups, new_pairs)

    def _new_group(self, g: tuple[int, ...], backend: str | None = None):
        if _SORT_RANKS:  # group rank i is g[i]: shard i belongs to the i-th listed device
            return dist.new_group(list(g), sort_ranks=False, backend=backend)
        if list(g) == sorted(g):
            return dist.new_group(list(g), backend=backend)
        raise RuntimeError(f"this torch sorts group ranks; group {list(g)} must be listed in "
                           "ascending order")

    def _warm_up(self, groups: list[tuple[int, ...]], pairs: list[tuple[int, int]]) -> None:
        """One blocking one-element operation per new communicator, in the same global order
        on every rank (NCCL creates a communicator on its first use)."""
        one = torch.zeros(1, device="cpu" if self.stage else self.device)
        for g in groups:
            if self.rank in g:
                dist.all_reduce(one, group=self.groups[g])
        for src, dst in pairs:
            if self.rank == src:
                dist.send(one, dst, group=self.pairs[(src, dst)])
            elif self.rank == dst:
                dist.recv(one, src, group=self.pairs[(src, dst)])
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        dist.barrier()

    def _posted(self) -> None:
        """A message was posted: let the threads that move it have this core first."""
        if self.own_core:
            os.sched_yield()

    @contextlib.contextmanager
    def on_stream(self, name: str):
        """Issue on the CUDA stream of logical stream `name` (no-op on CPU). The block
        appends what it issued to `self.issued`; on CUDA the stream then waits for it
        (the host does not) and `take_span()` gives the events that bracket the transfer
        on that stream, not on the compute stream (which overlaps it)."""
        self.issued: list = []
        if not self.cuda:
            yield
            return
        s = self.streams.get(name)
        if s is None:
            s = self.streams[name] = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            for w in self.issued:
                w.wait()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.span = (start, end)

    def take_span(self):
        """(start, end) CUDA events of the last issue's transfer, or None (CPU)."""
        span, self.span = getattr(self, "span", None), None
        return span

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t.cpu() if self.stage else t

    def _buf(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu" if self.stage else self.device)

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int, stream: str) -> tuple:
        group = self.pairs.get((self.rank, peer))
        with self.on_stream(stream):
            bufs = [self._out(t) for t in tensors]
            works = [dist.isend(b, peer, group=group, tag=tag * 64 + k)
                     for k, b in enumerate(bufs)]
            self.issued += works
        self._posted()
        return works, bufs

    def _recv_buf(self, shape, dtype) -> torch.Tensor:
        if self.device.type != "cpu":   # CUDA has its caching allocator
            return self._buf(shape, dtype)
        spare = self.pool.get((shape, dtype))
        while spare:
            buf = spare.pop()
            if _unused(buf):   # else something still holds it: let it go
                self.lent.append(buf)
                return buf
        buf = self._buf(shape, dtype)
        self.lent.append(buf)
        return buf

    def recycle(self) -> None:
        """Step over: this step's receive buffers become spares for the next one."""
        for buf in self.lent:
            self.pool.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
        self.lent = []

    def recv(self, specs: list[tuple], peer: int, tag: int, stream: str) -> tuple:
        group = self.pairs.get((peer, self.rank))
        with self.on_stream(stream):
            bufs = [self._recv_buf(shape, dtype) for shape, dtype in specs]
            works = [dist.irecv(b, peer, group=group, tag=tag * 64 + k)
                     for k, b in enumerate(bufs)]
            self.issued += works
        return works, bufs

    def all_reduce(self, flat: torch.Tensor, group: tuple, stream: str) -> tuple:
        with self.on_stream(stream):
            buf = self._out(flat)
            work = dist.all_reduce(buf, group=self.groups[tuple(group)], async_op=True)
            self.issued.append(work)
        self._posted()
        return [work], [buf]

    def reduce_scatter(self, flat: torch.Tensor, group: tuple, stream: str) -> tuple:
        with self.on_stream(stream):
            src = self._out(flat)
            out = self._buf((flat.numel() // len(group),), flat.dtype)
            work = _RS(out, src, group=self.groups[tuple(group)], async_op=True)
            self.issued.append(work)
        self._posted()
        return [work], [out, src]

    def all_gather(self, shard: torch.Tensor, group: tuple, stream: str) -> tuple:
        with self.on_stream(stream):
            src = self._out(shard)
            out = self._buf((shard.numel() * len(group),), shard.dtype)
            work = _AG(out, src, group=self.groups[tuple(group)], async_op=True)
            self.issued.append(work)
        self._posted()
        return [work], [out, src]

    def gather_counts(self, counts: list[int], group: tuple, stream: str) -> list[list[int]]:
        """Blocking all-gather of a few int64 counts the host knows: one list per member, in
        group order, over a CPU group (on NCCL plans, a gloo group: the GPU keeps running)."""
        g = tuple(group)
        cpu = self.cpu_groups.get(g) or self.groups[g]
        src = torch.tensor(counts, dtype=torch.int64)
        out = torch.empty(len(counts) * len(g), dtype=torch.int64)
        _AG(out, src, group=cpu)
        flat = out.tolist()
        k = len(counts)
        return [flat[i * k:(i + 1) * k] for i in range(len(g))]

    def all_to_all(self, flat: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: tuple, stream: str) -> tuple:
        """Piece i of `flat` (`in_splits[i]` elements) to member i; `out_splits[i]` from it."""
        with self.on_stream(stream):
            src = self._out(flat)
            out = self._buf((sum(out_splits),), flat.dtype)
            work = dist.all_to_all_single(out, src, out_splits, in_splits,
                                          group=self.groups[tuple(group)], async_op=True)
            self.issued.append(work)
        self._posted()
        return [work], [out, src]

    def watch(self, p: Pending, clock) -> None:
        """Record the completion time by callback where the backend supports it."""
        if self.device.type == "cuda":
            return  # CUDA times are events, marked at the WAIT (see timing.Clock)
        try:
            futs = [w.get_future() for w in p.works]
        except RuntimeError:  # gloo point-to-point: polled instead
            return
        left = [len(futs)]

        def done(_fut, p=p, left=left):
            left[0] -= 1
            if left[0] == 0 and p.end is None:
                p.end = clock.now()
        for f in futs:
            f.then(done)

    def poll(self, p: Pending, clock) -> None:
        if self.device.type != "cuda" and p.end is None and all(w.is_completed() for w in p.works):
            p.end = clock.now()

    def wait(self, p: Pending, timeout: float) -> list[torch.Tensor]:
        """Until `p` completes: the host blocks (gloo, with `timeout`), or on NCCL the
        compute stream waits for the transfer and the host goes on; results on device."""
        if self.cuda:
            for w in p.works:   # no timeout: NCCL's would block the host and poll
                w.wait()
            for t in p.tensors:  # made on a comm stream, used on the compute stream
                t.record_stream(torch.cuda.current_stream(self.device))
            return p.tensors
        deadline = time.monotonic() + timeout
        for w in p.works:  # gloo raises when the time is up (and the pair is then unusable)
            w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        if self.stage:
            return [t.to(self.device) for t in p.tensors]
        return p.tensors

