"""Communication for one worker: communicators, transfers, staged and recycled buffers.

A `Transfer` is one communication instruction made ready on the host: its buffers (what
it sends, what it receives into), its communicator (`plan.streams.communicator`: `p2p:a>b`
for a direction of a pair, `group:r0,r1,...` for a collective) and what it needs besides
(peer, tag, all-to-all splits). `Comm.start` starts it asynchronously (`async_op=True`)
and returns its works; *where* it starts (which CUDA stream is current, which stream
waits for it) is the stream program's business, executed by `runtime.streams`.

Communicators, the way NCCL needs them (`compiler.nccl` checks stream programs against
this layout): one process group per collective group, and, on NCCL, one per *direction*
of each pair that exchanges messages, so a receive waiting at the head of one direction's
stream never holds up the other (gloo matches messages by tag: its point-to-point stays
on the default group, where extra groups would only add event-loop threads). Every rank
creates every group, in one global order (`plan.streams.communicators`), when a plan is
loaded, never in the middle of a step. On NCCL, groups are made by one `dist.split_group`
per *family* of disjoint groups (`plan.streams.families`): every rank takes part in each
split, members or not, so creation cannot hang, and it costs one world-wide call per
family instead of one per group (about 32,000 at PP 64 x DP 256). Each new communicator is
warmed up once with a one-element message, in the same global order on every rank.

`gather_counts` (the token counts of an expert dispatch, known on the host) goes over a
CPU (gloo) group, without draining the GPU. Receive buffers on CPU are recycled across
steps, as PyTorch's pipeline stages keep theirs: after a step (`recycle`), a buffer nothing
references any more is handed to the next receive of its shape instead of a fresh
allocation, whose page faults land on gloo's thread while compute runs. Gloo with CUDA
tensors (one GPU shared by several ranks) stages buffers through host memory.

A worker pinned to a core of its own (`own_core`) yields that core right after posting a
message: the rest of the transfer (gloo's threads, the kernel's loopback delivery) needs
the same core, and the next pass would otherwise hold it for up to a scheduler slice. A
1F1B stage's first activation reached the next stage 1.5-1.75 ms after its send, not 0.2.
"""

from __future__ import annotations

import datetime
import inspect
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from piper_nb.ir.kinds import Op
from piper_nb.plan.streams import comm_ranks, families
from piper_nb.trace import Memory

__all__ = ["Comm", "Pending", "Transfer", "BLOCKING_WAIT_ENV"]

_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
BLOCKING_WAIT_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def _unused(t: torch.Tensor) -> bool:
    """Nothing but `t` holds its storage (the query's own storage object counts one)."""
    return _USE_COUNT is not None and _USE_COUNT(t.untyped_storage()._cdata) <= 2


@dataclass
class Transfer:
    """One communication instruction, ready to start: `bufs` are what it sends (SEND),
    receives into (RECV), or its (output, input) buffers (collectives)."""

    kind: Op
    comm: str                       # its communicator
    bufs: list[torch.Tensor]
    peer: int = -1
    tag: int = -1
    splits: tuple = ()              # ALL_TO_ALL: (out_splits, in_splits)
    index: int = -1                 # the instruction's index in the device plan
    text: str = ""                  # the instruction's text, for errors

    @property
    def outputs(self) -> list[torch.Tensor]:
        """What the instruction's WAIT hands on: received buffers, or a collective's output."""
        return self.bufs


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
                 per_direction: bool | None = None, emulated: bool = False):
        self.rank, self.device, self.backend = rank, device, backend
        # NCCL's semantics on CPU (`runtime.emulation`): a gloo group per communicator, and
        # the host's own exchanges on groups of their own
        self.emulated = emulated
        # one group per direction of each pair: what NCCL needs; gloo matches messages by
        # tag on the default group, and every extra gloo group costs an event-loop thread
        self.per_direction = (backend != "gloo" or emulated) if per_direction is None \
            else per_direction
        self.stage = device.type == "cuda" and backend == "gloo"
        self.cuda = device.type == "cuda" and not self.stage   # NCCL on GPU tensors
        if (self.cuda or emulated) and any(os.environ.get(k, "0") not in ("", "0")
                                           for k in BLOCKING_WAIT_ENV):
            raise RuntimeError(
                "TORCH_NCCL_BLOCKING_WAIT is set: every WAIT of the plan would block the host "
                "right after its communication is issued, so no transfer would overlap "
                "compute and the stream program piper_nb checked would not be the one that "
                "runs. Unset it; piper_nb bounds every step with the cluster's timeout")
        self.groups: dict[tuple[int, ...], object] = {}
        self.pairs: dict[tuple[int, int], object] = {}      # (src, dst) -> its direction's group
        self.cpu_groups: dict[tuple[int, ...], object] = {}  # token counts (NCCL plans)
        self.bn_groups: dict[tuple[int, ...], object] = {}   # SyncedBatchNorm's own groups
        self.pool: dict[tuple, list[torch.Tensor]] = {}   # (shape, dtype) -> spare buffers
        self.lent: list[torch.Tensor] = []                # receive buffers of this step
        self.own_core = False   # pinned alone on a core: yield it after posting a message
        self.created: list[tuple[str, int]] = []          # (how, groups) per creation call

    # ---- communicators -----------------------------------------------------------------
    def ensure_groups(self, comms=(), counted=(), batchnorm=()) -> None:
        """Create the communicators not made yet (`comms`: keys in one global order), CPU
        groups for the token counts of `counted` groups and SyncedBatchNorm's groups
        (`batchnorm`), and warm each new one up. Every rank calls this with the same lists."""
        new = [c for c in comms if self._held(c) is None and not self._elsewhere(c)]
        for fam in self._families(new):
            self._create(fam)
        for g in sorted(set(tuple(x) for x in counted)):
            if g not in self.cpu_groups:
                self.cpu_groups[g] = (self._new_group(g, "gloo")
                                      if self.backend != "gloo" or self.emulated
                                      else self.groups.get(g) or self._new_group(g))
        for g in sorted(set(tuple(x) for x in batchnorm)):
            if g not in self.bn_groups:   # never shared with the plan's own collectives
                self.bn_groups[g] = self._new_group(g)
        self._warm_up(new)

    def _elsewhere(self, comm: str) -> bool:
        """A direction that travels on the default group (gloo, no groups per direction)."""
        return comm.startswith("p2p:") and not self.per_direction

    def _held(self, comm: str):
        ranks = comm_ranks(comm)
        return self.pairs.get(ranks) if comm.startswith("p2p:") else self.groups.get(ranks)

    def _families(self, comms: list[str]) -> list[list[str]]:
        if self.backend == "nccl" and hasattr(dist, "split_group"):
            return families(comms)
        return [[c] for c in comms]

    def _create(self, fam: list[str]) -> None:
        """One family's groups: one `split_group` on NCCL (groups listed in rank order),
        else one `new_group` each, on every rank."""
        ranked = [sorted(set(comm_ranks(c))) for c in fam]
        if len(fam) > 1 and all(list(comm_ranks(c)) == r or c.startswith("p2p:")
                                for c, r in zip(fam, ranked, strict=True)):
            mine = dist.split_group(split_ranks=ranked)
            self.created.append(("split_group", len(fam)))
            for c, r in zip(fam, ranked, strict=True):
                if self.rank in r:
                    self._keep(c, mine)
            return
        for c in fam:
            ranks = comm_ranks(c)
            group = (dist.new_group(sorted(ranks)) if c.startswith("p2p:")
                     else self._new_group(ranks))
            self.created.append(("new_group", 1))
            self._keep(c, group)

    def _keep(self, comm: str, group) -> None:
        ranks = comm_ranks(comm)
        (self.pairs if comm.startswith("p2p:") else self.groups)[ranks] = group

    def _new_group(self, g: tuple[int, ...], backend: str | None = None):
        if _SORT_RANKS:  # group rank i is g[i]: shard i belongs to the i-th listed device
            return dist.new_group(list(g), sort_ranks=False, backend=backend)
        if list(g) == sorted(g):
            return dist.new_group(list(g), backend=backend)
        raise RuntimeError(f"this torch sorts group ranks; group {list(g)} must be listed in "
                           "ascending order")

    def group_of(self, comm: str):
        """The process group of communicator `comm` (None: the default group)."""
        if self._elsewhere(comm):
            return None
        group = self._held(comm)
        if group is None:
            raise RuntimeError(f"device {self.rank} has no communicator {comm}: the plan's "
                               "groups are made when it is loaded")
        return group

    def _warm_up(self, comms: list[str]) -> None:
        """One blocking one-element operation per new communicator, in the same global order
        on every rank (a communicator is connected on its first use)."""
        one = torch.zeros(1, device="cpu" if self.stage else self.device)
        for c in comms:
            ranks = comm_ranks(c)
            if self.rank not in ranks or self._elsewhere(c):
                continue
            group = self.group_of(c)
            if c.startswith("p2p:"):
                if self.rank == ranks[0]:
                    dist.send(one, ranks[1], group=group)
                else:
                    dist.recv(one, ranks[0], group=group)
            else:
                dist.all_reduce(one, group=group)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        dist.barrier()

    def _posted(self) -> None:
        """A message was posted: let the threads that move it have this core first."""
        if self.own_core:
            os.sched_yield()

    # ---- transfers: made on the host, started where the stream program says -------------
    def _out(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t.cpu() if self.stage else t

    def _buf(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu" if self.stage else self.device)

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

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int, comm: str) -> Transfer:
        return Transfer(Op.SEND, comm, [self._out(t) for t in tensors], peer=peer, tag=tag)

    def recv(self, specs: list[tuple], peer: int, tag: int, comm: str) -> Transfer:
        return Transfer(Op.RECV, comm, [self._recv_buf(shape, dtype) for shape, dtype in specs],
                        peer=peer, tag=tag)

    def all_reduce(self, flat: torch.Tensor, comm: str) -> Transfer:
        return Transfer(Op.ALL_REDUCE, comm, [self._out(flat)])

    def reduce_scatter(self, flat: torch.Tensor, n: int, comm: str) -> Transfer:
        return Transfer(Op.REDUCE_SCATTER, comm,
                        [self._buf((flat.numel() // n,), flat.dtype), self._out(flat)])

    def all_gather(self, shard: torch.Tensor, n: int, comm: str) -> Transfer:
        return Transfer(Op.ALL_GATHER, comm,
                        [self._buf((shard.numel() * n,), shard.dtype), self._out(shard)])

    def all_to_all(self, flat: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   comm: str) -> Transfer:
        """Piece i of `flat` (`in_splits[i]` elements) to member i; `out_splits[i]` from it."""
        return Transfer(Op.ALL_TO_ALL, comm, [self._buf((sum(out_splits),), flat.dtype),
                                              self._out(flat)],
                        splits=(list(out_splits), list(in_splits)))

    def start(self, t: Transfer) -> list:
        """Start `t` asynchronously on its communicator; its works."""
        group = self.group_of(t.comm)
        if t.kind == Op.SEND:
            works = [dist.isend(b, t.peer, group=group, tag=t.tag * 64 + k)
                     for k, b in enumerate(t.bufs)]
        elif t.kind == Op.RECV:
            return [dist.irecv(b, t.peer, group=group, tag=t.tag * 64 + k)
                    for k, b in enumerate(t.bufs)]
        elif t.kind == Op.ALL_REDUCE:
            works = [dist.all_reduce(t.bufs[0], group=group, async_op=True)]
        elif t.kind == Op.REDUCE_SCATTER:
            works = [_RS(t.bufs[0], t.bufs[1], group=group, async_op=True)]
        elif t.kind == Op.ALL_GATHER:
            works = [_AG(t.bufs[0], t.bufs[1], group=group, async_op=True)]
        elif t.kind == Op.ALL_TO_ALL:
            out_splits, in_splits = t.splits
            works = [dist.all_to_all_single(t.bufs[0], t.bufs[1], out_splits, in_splits,
                                            group=group, async_op=True)]
        else:
            raise NotImplementedError(f"{t.kind} is not a communication")
        self._posted()
        return works

    def run_blocking(self, t: Transfer, group) -> None:
        """A collective `t`, run to its end on `group` (the NCCL emulation's streams)."""
        if t.kind == Op.ALL_REDUCE:
            dist.all_reduce(t.bufs[0], group=group)
        elif t.kind == Op.REDUCE_SCATTER:
            _RS(t.bufs[0], t.bufs[1], group=group)
        elif t.kind == Op.ALL_GATHER:
            _AG(t.bufs[0], t.bufs[1], group=group)
        elif t.kind == Op.ALL_TO_ALL:
            dist.all_to_all_single(t.bufs[0], t.bufs[1], *t.splits, group=group)
        else:
            raise NotImplementedError(f"{t.kind} is not a collective")

    def gather_counts(self, counts: list[int], group: tuple) -> list[list[int]]:
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

    # ---- completion --------------------------------------------------------------------
    def watch(self, p: Pending, clock) -> None:
        """Record the completion time by callback where the backend supports it."""
        if self.device.type == "cuda":
            return  # CUDA times are events (see runtime.streams)
        try:
            futs = [w.get_future() for w in p.works]
        except (RuntimeError, AttributeError):  # gloo point-to-point: polled instead
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

    def wait_works(self, works: list, timeout: float) -> None:
        """Until `works` complete: the host blocks (gloo, with `timeout`); on NCCL the
        current stream waits for them and the host goes on."""
        if self.cuda:
            for w in works:   # no timeout: NCCL's would block the host and poll
                w.wait()
            return
        deadline = time.monotonic() + timeout
        for w in works:  # gloo raises when the time is up (and the pair is then unusable)
            w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))

    def results(self, p: Pending) -> list[torch.Tensor]:
        """A completed transfer's buffers, on the device."""
        if self.stage:
            return [t.to(self.device) for t in p.tensors]
        return p.tensors
