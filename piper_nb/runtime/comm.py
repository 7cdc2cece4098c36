"""Communication for one worker: process groups, async issue, staged buffers, streams.

Every SEND/RECV and collective of a plan is issued asynchronously (`async_op=True`) and
returns a `Pending` that its WAIT completes, so transfers overlap the compute in between.
With gloo on CPU the transfer runs on gloo's threads; with NCCL each logical stream name
gets its own CUDA stream that first waits for the compute stream, and a WAIT makes the
compute stream wait for the transfer. Gloo with CUDA tensors (one GPU shared by several
ranks) stages buffers through host memory. Groups are created once, in one global order.
`gather_counts` (blocking) and `all_to_all` serve the token exchange of `exchange`.
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
    memory: str = "buffers"         # the MemorySample field its new buffers count in
    new: list[torch.Tensor] = field(default_factory=list)   # buffers it allocated
    meta: object = None             # what its WAIT needs to unpack the results (ALL_TO_ALL)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.new)


class Comm:
    def __init__(self, rank: int, device: torch.device, backend: str):
        self.rank, self.device, self.backend = rank, device, backend
        self.stage = device.type == "cuda" and backend == "gloo"
        self.groups: dict[tuple[int, ...], object] = {}
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.pool: dict[tuple, list[torch.Tensor]] = {}   # (shape, dtype) -> spare buffers
        self.lent: list[torch.Tensor] = []                # receive buffers of this step
        self.own_core = False   # pinned alone on a core: yield it after posting a message

    def ensure_groups(self, groups) -> None:
        """Create the process groups not made yet; every rank calls this with the same list."""
        for g in sorted(set(tuple(x) for x in groups)):
            if g in self.groups:
                continue
            if _SORT_RANKS:  # group rank i is g[i]: shard i belongs to the i-th listed device
                self.groups[g] = dist.new_group(list(g), sort_ranks=False)
            elif list(g) == sorted(g):
                self.groups[g] = dist.new_group(list(g))
            else:
                raise RuntimeError(f"this torch sorts group ranks; group {list(g)} must be "
                                   "listed in ascending order")

    def barrier(self) -> None:
        dist.barrier()

    def _posted(self) -> None:
        """A message was posted: let the threads that move it have this core first."""
        if self.own_core:
            os.sched_yield()

    @contextlib.contextmanager
    def on_stream(self, name: str):
        """Issue on the CUDA stream of logical stream `name` (no-op on CPU)."""
        if self.device.type != "cuda" or self.stage:
            yield
            return
        s = self.streams.get(name)
        if s is None:
            s = self.streams[name] = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            yield

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t.cpu() if self.stage else t

    def _buf(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu" if self.stage else self.device)

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int, stream: str) -> tuple:
        with self.on_stream(stream):
            bufs = [self._out(t) for t in tensors]
            works = [dist.isend(b, peer, tag=tag * 64 + k) for k, b in enumerate(bufs)]
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
        with self.on_stream(stream):
            bufs = [self._recv_buf(shape, dtype) for shape, dtype in specs]
            works = [dist.irecv(b, peer, tag=tag * 64 + k) for k, b in enumerate(bufs)]
        return works, bufs

    def all_reduce(self, flat: torch.Tensor, group: tuple, stream: str) -> tuple:
        with self.on_stream(stream):
            buf = self._out(flat)
            work = dist.all_reduce(buf, group=self.groups[tuple(group)], async_op=True)
        self._posted()
        return [work], [buf]

    def reduce_scatter(self, flat: torch.Tensor, group: tuple, stream: str) -> tuple:
        with self.on_stream(stream):
            src = self._out(flat)
            out = self._buf((flat.numel() // len(group),), flat.dtype)
            work = _RS(out, src, group=self.groups[tuple(group)], async_op=True)
        self._posted()
        return [work], [out, src]

    def all_gather(self, shard: torch.Tensor, group: tuple, stream: str) -> tuple:
        with self.on_stream(stream):
            src = self._out(shard)
            out = self._buf((shard.numel() * len(group),), shard.dtype)
            work = _AG(out, src, group=self.groups[tuple(group)], async_op=True)
        self._posted()
        return [work], [out, src]

    def gather_counts(self, counts: list[int], group: tuple, stream: str) -> list[list[int]]:
        """Blocking all-gather of a few int64 counts: one list per member, in group order."""
        with self.on_stream(stream):
            src = torch.tensor(counts, dtype=torch.int64, device=self._buf((0,), torch.int64).device)
            out = self._buf((len(counts) * len(group),), torch.int64)
            _AG(out, src, group=self.groups[tuple(group)])
            flat = out.tolist()
        k = len(counts)
        return [flat[i * k:(i + 1) * k] for i in range(len(group))]

    def all_to_all(self, flat: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: tuple, stream: str) -> tuple:
        """Piece i of `flat` (`in_splits[i]` elements) to member i; `out_splits[i]` from it."""
        with self.on_stream(stream):
            src = self._out(flat)
            out = self._buf((sum(out_splits),), flat.dtype)
            work = dist.all_to_all_single(out, src, out_splits, in_splits,
                                          group=self.groups[tuple(group)], async_op=True)
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
        """Block until `p` completes (the compute stream waits, on CUDA); results on device."""
        deadline = time.monotonic() + timeout
        for w in p.works:  # gloo raises when the time is up (and the pair is then unusable)
            w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        if self.stage:
            return [t.to(self.device) for t in p.tensors]
        if self.device.type == "cuda":  # made on a comm stream, used on the compute stream
            for t in p.tensors:
                t.record_stream(torch.cuda.current_stream(self.device))
        return p.tensors

