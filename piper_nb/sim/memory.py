"""Memory model: bytes per device over one step, by kind (params, grads, optim,
activations, buffers), from a Plan and the times its instructions ran.

The rule, shared with the runtime's count (`runtime/stores.py`): **bytes actually held**
after each instruction of a steady-state step, in logical tensor bytes (numel x element
size), each tensor counted once from its allocation until its last holder lets go. One
sample per instruction, in program order, so a predicted and a measured trace compare
sample by sample (`tests/sim/test_memory_vs_runtime.py` checks they are equal). Per kind:

- params: parameters held in full (zero 0-2), the flat 1/N shard of a ZeRO-3 bucket
  (padded to a multiple of N, as the runtime lays it out), the full bucket while gathered
  (one buffer per bucket however many gathers overlap: a reference count, from the first
  gather's WAIT to the last `free(param:b)`), and a ZeRO-3 gather's receive buffer in flight;
- grads: a parameter's gradient from the first backward that makes it (B or BW) until it is
  consumed: a reduce-scatter takes it at issue, the update drops it (an all-reduce's WAIT
  swaps it for a view of the reduced bucket, the same size). Reduced gradient shards live
  from their reduce-scatter's WAIT to the update;
- optim: the optimizer state of what this device updates (full parameters, or its bucket
  shards); it persists across steps, so a steady-state step holds it throughout
  (`MemorySettings(first_step=True)`: only from the update on, as in a first step);
- activations: for each forward stash (region, microbatch) the bytes autograd saved
  (`plan.saved[region]`, as `pn.compile` measured them) from its F until its last backward
  (B, or BW when split); each value buffer (a forward's outputs, received activations and
  gradients, input gradients a backward makes) from its creation until it is freed *and*
  no live stash still refers to it (a stash keeps its inputs, its outputs and, between BI
  and BW, the output gradients); received buffers count from their RECV's issue;
- buffers: communication buffers in flight from issue to WAIT (an all-reduce's flat copy,
  a reduce-scatter's flat input and output shard, a ZeRO-1/2 gather's output) and the
  updated ZeRO-1/2 shards waiting for their gather.

Integer inputs and the batch itself are not counted (neither side counts them). Sizes come
from `plan.values` / `plan.params`; `MemorySettings` can override bytes per element of
parameters, gradients and optimizer state (what-if: mixed precision). An expert plan's
token buffers (routed rows, their indices and weights, what an expert saves) take their
size from a routing (`MemorySettings(tokens=...)`, `sim.tokens`): a member's own rows on
the replica side, the group's on the expert's owner; an ALL_TO_ALL holds what it sends and
what it gets from issue to WAIT, and its WAIT moves the rows as `runtime.exchange` does.

`model_states` / `zero_model_states` keep the ZeRO paper's steady-state accounting
(Rajbhandari et al. 2020): params, grads and optimizer state all allocated at once, so the
paper's 16 Psi / 4 Psi + 12 Psi/N / 2 Psi + 14 Psi/N / 16 Psi/N come out of this code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import BUCKET_COLLECTIVES, Memory
from piper_nb.ir.kinds import COMPUTE as _PASSES
from piper_nb.ir.kinds import PASSES as _REGION_PASSES
from piper_nb.sim.cost import _elem, value_bytes
from piper_nb.sim.tokens import Routing
from piper_nb.sim.trace import MemorySample

__all__ = ["MemorySettings", "Holding", "model_states", "device_model_states", "communicators",
           "zero_model_states", "memory_samples", "live_stashes", "MIXED_PRECISION_ADAM",
           "OPTIMIZER_BYTES"]

_BATCH = frozenset({"inputs", "targets"})   # capture.split's BATCH_INPUT, BATCH_TARGET
_LOSS = "loss"                              # capture.split's LOSS
_COLLECTIVES = frozenset(BUCKET_COLLECTIVES)
# bytes of optimizer state per parameter (fp32 state): SGD none, momentum 1x, Adam(W) 2x
OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "sgd_momentum": 4, "adam": 8, "adamw": 8}


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """Bytes per parameter element; None means the parameter's own dtype size."""

    param_bytes: float | None = None   # weights
    grad_bytes: float | None = None    # gradients
    optim_bytes: float | None = None   # optimizer state (None: from `optimizer`)
    optimizer: object = "sgd"          # a name in OPTIMIZER_BYTES or an optimizer object
    first_step: bool = False           # optimizer state appears at the update (step 1)
    tokens: dict | None = None         # routing, "value@mb" -> rows per member (sim.tokens)
    # GPU allowances beyond the tensors the runtime counts, added to "buffers" throughout:
    # a fixed share per device (allocator rounding and slack, kernels' workspaces) and a
    # share per communicator the device uses (NCCL's buffers; 0 on CPU). `for_cuda` gives
    # typical figures; a GPU run reports torch.cuda.max_memory_allocated to compare with.
    reserve_bytes: float = 0.0
    per_communicator: float = 0.0

    @classmethod
    def for_cuda(cls, *, reserve_bytes: float = 64 * 2**20, channels: int = 2,
                 buffer_bytes: float = 4 * 2**20, **kw) -> MemorySettings:
        """Settings with GPU allowances: `reserve_bytes` per device, and per communicator
        NCCL's `channels` x `buffer_bytes` (NCCL_BUFFSIZE, 4 MiB by default)."""
        return cls(reserve_bytes=reserve_bytes, per_communicator=channels * buffer_bytes, **kw)

    def optim_per_param(self) -> float:
        if self.optim_bytes is not None:
            return self.optim_bytes
        opt = self.optimizer
        if hasattr(opt, "state_bytes_per_param"):
            return float(opt.state_bytes_per_param)
        name = opt if isinstance(opt, str) else type(opt).__name__
        key = name.lower()
        if not isinstance(opt, str) and key == "sgd" and getattr(opt, "momentum", 0):
            key = "momentum"
        if key not in OPTIMIZER_BYTES:
            raise PlanError(f"unknown optimizer {name!r} for the memory model; use one of "
                            f"{', '.join(OPTIMIZER_BYTES)} or set optim_bytes=")
        return OPTIMIZER_BYTES[key]


# the ZeRO paper's mixed-precision Adam: fp16 weights and grads, 12 bytes of fp32 state
MIXED_PRECISION_ADAM = MemorySettings(param_bytes=2, grad_bytes=2, optim_bytes=12)


@dataclass(frozen=True)
class Holding:
    """Parameters a device holds as one unit: `numel` elements, ZeRO level, group size."""

    numel: int
    zero: int = 0
    group: int = 1
    elem: int = 4     # dtype bytes, used when the settings do not say
    trainable: bool = True   # frozen parameters hold no gradient and no optimizer state


def model_states(holdings, settings: MemorySettings = MemorySettings()) -> dict[str, float]:
    """Steady-state bytes of params, grads and optimizer state for these holdings."""
    out = {"params": 0.0, "grads": 0.0, "optim": 0.0}
    ob = settings.optim_per_param()
    for h in holdings:
        pb = settings.param_bytes if settings.param_bytes is not None else h.elem
        gb = settings.grad_bytes if settings.grad_bytes is not None else h.elem
        shard = math.ceil(h.numel / h.group)
        out["params"] += pb * (shard if h.zero >= 3 else h.numel)
        if h.trainable:
            out["grads"] += gb * (shard if h.zero >= 2 else h.numel)
            out["optim"] += ob * (shard if h.zero >= 1 else h.numel)
    return out


def zero_model_states(psi: int, n: int, zero: int,
                      settings: MemorySettings = MIXED_PRECISION_ADAM) -> float:
    """Model-state bytes per device for Psi parameters replicated over n with ZeRO `zero`."""
    return sum(model_states([Holding(psi, zero, n)], settings).values())


def _numel(plan, p: str) -> int:
    return math.prod(plan.params[p][0])


def device_holdings(plan, d: int) -> list[Holding]:
    regions = {i.region for i in plan.devices[d].instrs
               if i.kind in _PASSES and 0 <= i.region < len(plan.regions)}
    names = list(dict.fromkeys(p for r in sorted(regions) for p in plan.regions[r].params))
    sharded = {p: b for b in plan.buckets if b.zero > 0 and d in b.group for p in b.params}
    out, seen = [], set()
    for p in names:
        b = sharded.get(p)
        if b is None:
            out.append(Holding(_numel(plan, p), 0, 1, _elem(plan.params[p][1]),
                               trainable=p not in plan.frozen))
        elif b.index not in seen:
            seen.add(b.index)
            numel = sum(_numel(plan, q) for q in b.params)
            out.append(Holding(numel, b.zero, len(b.group), _elem(plan.params[p][1])))
    return out


def device_model_states(plan, d: int, settings: MemorySettings = MemorySettings()) -> dict:
    """The ZeRO paper's steady-state model states of device `d` (all allocated at once)."""
    return model_states(device_holdings(plan, d), settings)


# ---- the timeline: one device's instruction list walked the way the worker runs it ---------

class _Buf:
    """One allocated value buffer: counted while at least one holder keeps it."""

    __slots__ = ("nbytes", "holders")

    def __init__(self, nbytes: int):
        self.nbytes, self.holders = nbytes, 0


class _Stash:
    __slots__ = ("saved", "leaves", "refs", "out_grads")

    def __init__(self, saved: int, leaves: list[str], refs: list[_Buf]):
        self.saved, self.leaves, self.refs, self.out_grads = saved, leaves, refs, []


class _Device:
    """Bytes held on device `d`, instruction by instruction: the worker's bookkeeping
    (`runtime.worker`, `runtime.stores`) over sizes instead of tensors, with running totals
    so a sample costs O(1)."""

    def __init__(self, plan, d: int, settings: MemorySettings, routing: Routing):
        self.plan, self.instrs, self.d = plan, plan.devices[d].instrs, d
        self.frozen = frozenset(plan.frozen)
        self.vbytes = {k: value_bytes(v) for k, v in plan.values.items()}
        self.routing = routing
        self.pb, self.gb = settings.param_bytes, settings.grad_bytes
        regions = sorted({i.region for i in self.instrs if i.kind in _REGION_PASSES
                          and 0 <= i.region < len(plan.regions)})
        names = dict.fromkeys(p for r in regions for p in plan.regions[r].params)
        names.update(dict.fromkeys(p for i in self.instrs if i.kind == "U" for p in i.params))
        self.names = {n: None for n in names if n in plan.params}
        self.gsize = {n: _numel(plan, n) * (self.gb if self.gb is not None else self._elem(n))
                      for n in self.names}
        self.buckets = {b.index: b for b in plan.buckets
                        if d in b.group and any(n in names for n in b.params)}
        zero3 = [b for b in self.buckets.values() if b.zero == 3]
        sharded = {n for b in zero3 for n in b.params}
        base = sum(_numel(plan, n) * (self.pb if self.pb is not None else self._elem(n))
                   for n in self.names if n not in sharded)
        base += sum(self._shard(b.index, self.pb) for b in zero3)
        ob = settings.optim_per_param()
        self.ustate: dict[int, dict] = {}         # U index -> the state it keeps, by key
        for i, ins in enumerate(self.instrs):
            if ins.kind == "U":
                st = {n: _numel(plan, n) * ob for n in ins.params if n in plan.params}
                st.update({("b", b): self._shard(b, ob) for b in ins.buckets if b in self.buckets})
                self.ustate[i] = st
        self.optim_state: dict = {}               # key -> bytes: state that exists now
        if not settings.first_step:
            for st in self.ustate.values():
                self.optim_state.update(st)
        # running totals: params, grads, optim, activations, buffers
        self.level = [base, 0, sum(self.optim_state.values()), 0, 0]
        self.grads: dict[str, None] = {}          # parameters with a gradient (ordered set)
        self.grad_shards: dict[int, float] = {}   # bucket -> reduced shard bytes
        self.refs: dict[int, int] = {}            # ZeRO-3 bucket -> gathers in use
        self.pending: dict[int, tuple[int, float]] = {}   # issue index -> (kind, bytes)
        self.zero_shards: dict[int, float] = {}   # ZeRO-1/2 updated shards before the gather
        self.acts: dict[tuple[str, int], _Buf] = {}
        self.vgrads: dict[tuple[str, int], _Buf] = {}
        self.stash: dict[tuple[int, int], _Stash] = {}

    # -- sizes --
    def _elem(self, name: str) -> int:
        return _elem(self.plan.params[name][1])

    def _shard(self, b: int, per: float | None) -> float:
        """Bytes of one padded shard of bucket b (`per` bytes per element, None: dtype)."""
        bk = self.plan.buckets[b]
        total = sum(_numel(self.plan, n) for n in bk.params)
        per = per if per is not None else self._elem(bk.params[0])
        return -(-total // len(bk.group)) * per

    def _padded(self, b: int, per: float | None) -> float:
        return self._shard(b, per) * len(self.plan.buckets[b].group)

    # -- holders of value buffers --
    def _hold(self, buf: _Buf) -> None:
        buf.holders += 1
        if buf.holders == 1:
            self.level[Memory.ACTIVATIONS] += buf.nbytes

    def _let_go(self, buf: _Buf | None) -> None:
        if buf is None:
            return
        buf.holders -= 1
        if buf.holders == 0:
            self.level[Memory.ACTIVATIONS] -= buf.nbytes

    def _put(self, table: dict, key: tuple[str, int], buf: _Buf) -> None:
        self._hold(buf)
        self._let_go(table.get(key))
        table[key] = buf

    def _vb(self, v: str, mb: int, expert: bool = False) -> int:
        """Bytes of value v's buffer for microbatch mb; routed rows per `self.routing`
        (`expert`: made inside an expert, on its owner, so with the group's rows)."""
        if v in self.plan.rows:
            return self.routing.value_bytes(v, mb, self.d, expert)
        return self.vbytes.get(v, 0)

    def _add_grad(self, v: str, mb: int, expert: bool = False) -> None:
        """A new gradient buffer (the sum with an earlier one is a new tensor too)."""
        self._put(self.vgrads, (v, mb), _Buf(self._vb(v, mb, expert)))

    def _param_grads(self, names) -> None:
        for n in names:
            if n in self.names and n not in self.grads and n not in self.frozen:
                self.grads[n] = None
                self.level[Memory.GRADS] += self.gsize[n]

    def _drop_grads(self, names) -> None:
        for n in names:
            if n in self.grads:
                del self.grads[n]
                self.level[Memory.GRADS] -= self.gsize[n]

    def _leaves(self, region: int, mb: int) -> list[str]:
        """The inputs a forward detaches into autograd leaves: floats that need a gradient."""
        out = []
        for v in self.plan.regions[region].inputs:
            info = self.plan.values.get(v)
            if v not in _BATCH and (v, mb) in self.acts and (
                    info is None or (info.dtype.startswith(("float", "bfloat"))
                                     and info.requires_grad)):
                out.append(v)
        return out

    def _drop_stash(self, key: tuple[int, int]) -> None:
        st = self.stash.pop(key)
        self.level[Memory.ACTIVATIONS] -= st.saved
        for buf in st.refs:
            self._let_go(buf)
        for buf in st.out_grads:
            self._let_go(buf)

    def _issue(self, i: int, kind: int, nbytes: float) -> None:
        self.pending[i] = (kind, nbytes)
        self.level[kind] += nbytes

    # -- one instruction --
    def step(self, i: int, ins) -> None:
        k, plan = ins.kind, self.plan
        if k in _REGION_PASSES and not 0 <= ins.region < len(plan.regions):
            return   # a hand-written plan without region tables: nothing to count
        if k == "F":
            info = plan.regions[ins.region]
            leaves = self._leaves(ins.region, ins.mb)
            refs = [self.acts[(v, ins.mb)] for v in leaves]
            expert = ins.region in self.routing.experts
            for v in info.outputs:
                buf = _Buf(self._vb(v, ins.mb, expert))
                refs.append(buf)
                if v != _LOSS:
                    self._put(self.acts, (v, ins.mb), buf)
            for buf in refs:
                self._hold(buf)
            saved = self.routing.saved(ins.region, ins.mb, self.d)
            self.level[Memory.ACTIVATIONS] += saved
            key = (ins.region, ins.mb)
            if key in self.stash:
                self._drop_stash(key)
            self.stash[key] = _Stash(saved, leaves, refs)
        elif k in ("B", "BI", "BW"):
            key = (ins.region, ins.mb)
            st = self.stash.get(key)
            if st is None:
                return
            if k != "BI":
                self._param_grads(plan.regions[ins.region].params)
                self._drop_stash(key)
            else:  # BI keeps the output gradients (and a fresh loss gradient) until BW
                outs = plan.regions[ins.region].outputs
                grads = [self.vgrads[(v, ins.mb)] for v in outs
                         if v != _LOSS and (v, ins.mb) in self.vgrads]
                if _LOSS in outs:
                    grads.append(_Buf(self.vbytes.get(_LOSS, 0)))
                for buf in grads:
                    self._hold(buf)
                st.out_grads = grads
            if k != "BW":
                expert = ins.region in self.routing.experts
                for v in st.leaves:
                    self._add_grad(v, ins.mb, expert)
        elif k == "U":
            self._drop_grads(ins.params)
            for b in ins.buckets:
                if b in self.buckets and self.buckets[b].zero != 3 and b not in self.zero_shards:
                    self.zero_shards[b] = self._shard(b, self.pb)
                    self.level[Memory.BUFFERS] += self.zero_shards[b]
                self.level[Memory.GRADS] -= self.grad_shards.pop(b, 0)
            for key, nbytes in self.ustate[i].items():
                self.level[Memory.OPTIM] += nbytes - self.optim_state.get(key, 0)
                self.optim_state[key] = nbytes
        elif k == "RECV":
            self._issue(i, Memory.ACTIVATIONS, sum(self._vb(v, ins.mb) for v in ins.values))
        elif k == "ALL_TO_ALL":
            self._issue(i, Memory.BUFFERS, self._exchanged(ins))
        elif k in _COLLECTIVES and ins.bucket in self.buckets:
            b = ins.bucket
            if k == "ALL_REDUCE":
                self._issue(i, Memory.BUFFERS, self._padded(b, self.gb))
            elif k == "REDUCE_SCATTER":  # a flat copy of the gradients and the output shard
                self._issue(i, Memory.BUFFERS, self._padded(b, self.gb) + self._shard(b, self.gb))
                self._drop_grads(self.buckets[b].params)
            else:
                self._issue(i, Memory.PARAMS if self.buckets[b].zero == 3 else Memory.BUFFERS,
                            self._padded(b, self.pb))
        elif k == "WAIT":
            self._wait(ins.target)
        elif k == "FREE":
            for key in ins.keys:
                kind, _, rest = key.partition(":")
                if kind == "param":
                    b = int(rest)
                    if self.refs.get(b, 0) > 0:
                        self.refs[b] -= 1
                        if self.refs[b] == 0:
                            self.level[Memory.PARAMS] -= self._padded(b, self.pb)
                else:
                    value, _, mb = rest.rpartition("@")
                    table = self.acts if kind == "act" else self.vgrads
                    self._let_go(table.pop((value, int(mb)), None))

    # -- the token exchange (runtime.exchange) --
    def _exchanged(self, ins) -> int:
        """Bytes an ALL_TO_ALL has in flight here: what this member sends plus what it gets
        (a dispatch sends own rows to each owner, which gets the group's; a combine the
        reverse)."""
        return sum(self._vb(v, ins.mb) + (self._vb(v, ins.mb, expert=True) if owner == self.d
                                          else 0)
                   for v, owner in zip(ins.values, ins.owners, strict=True))

    def _exchange_done(self, ins) -> None:
        """An exchange's WAIT: what was sent is let go, what came is held (acts or grads)."""
        table = self.vgrads if ins.grad else self.acts
        dispatch = ins.purpose == "dispatch"
        for v, owner in zip(ins.values, ins.owners, strict=True):
            key, mine = (v, ins.mb), owner == self.d
            if dispatch or mine:
                self._let_go(table.pop(key, None))
            if mine or not dispatch:   # the owner gets the group's rows, each member its own
                buf = _Buf(self._vb(v, ins.mb, expert=dispatch))
                if ins.grad:
                    self._put(self.vgrads, key, buf)
                else:
                    self._put(self.acts, key, buf)

    def _wait(self, target: int) -> None:
        kind, nbytes = self.pending.pop(target, (0, 0))
        self.level[kind] -= nbytes
        src = self.instrs[target]
        k, b = src.kind, src.bucket
        if k == "RECV":
            for v in src.values:
                if src.grad:
                    self._add_grad(v, src.mb)
                else:
                    self._put(self.acts, (v, src.mb), _Buf(self._vb(v, src.mb)))
        elif k == "ALL_TO_ALL":
            self._exchange_done(src)
        elif k not in _COLLECTIVES or b not in self.buckets:
            return
        elif k == "ALL_REDUCE":   # the gradients become views of the reduced flat bucket
            self._param_grads(self.buckets[b].params)
        elif k == "REDUCE_SCATTER":
            shard = self._shard(b, self.gb)
            self.level[Memory.GRADS] += shard - self.grad_shards.get(b, 0)
            self.grad_shards[b] = shard
        elif k == "ALL_GATHER":
            if self.buckets[b].zero == 3:
                self.refs[b] = self.refs.get(b, 0) + 1
                if self.refs[b] == 1:
                    self.level[Memory.PARAMS] += self._padded(b, self.pb)
            elif b in self.zero_shards:
                self.level[Memory.BUFFERS] -= self.zero_shards.pop(b)

    def run(self, times: list[float], device: int, extra: float = 0.0) -> list[MemorySample]:
        out = []
        level = self.level
        for i, ins in enumerate(self.instrs):
            self.step(i, ins)
            held = [int(x) for x in level]
            held[Memory.BUFFERS] = int(level[Memory.BUFFERS] + extra)
            out.append(MemorySample(device, times[i], *held))
        return out


def communicators(plan, d: int) -> int:
    """Communicators device d uses: one per collective group, one per direction of each
    pair it exchanges messages with (the runtime's layout, `runtime.comm`)."""
    seen = set()
    for ins in plan.devices[d].instrs:
        if ins.kind == "SEND":
            seen.add((d, ins.peer))
        elif ins.kind == "RECV":
            seen.add((ins.peer, d))
        elif ins.group:
            seen.add(tuple(ins.group))
    return len(seen)


def _sample_times(timing, d: int) -> list[float]:
    """When each instruction of device d is done: compute at its end, an issue when posted,
    WAIT when it passes, FREE when it happens; never before the previous instruction."""
    instrs = timing.plan.devices[d].instrs
    posted, end = timing.posted[d], timing.end[d]
    out, now = [], 0.0
    for i, ins in enumerate(instrs):
        t = posted[i] if ins.is_issue else end[i]
        if t > now:
            now = t
        out.append(now)
    return out


def memory_samples(timing, settings: MemorySettings | None = None) -> list[MemorySample]:
    """Memory over the step: one sample per device and instruction, after it ran."""
    settings = settings or MemorySettings()
    routing = Routing(timing.plan, settings.tokens)
    samples = []
    for d in range(timing.plan.world):
        extra = settings.reserve_bytes + (settings.per_communicator
                                          * communicators(timing.plan, d)
                                          if settings.per_communicator else 0)
        samples += _Device(timing.plan, d, settings, routing).run(_sample_times(timing, d), d,
                                                                  extra)
    return samples


def live_stashes(trace, device: int) -> int:
    """Peak number of (region, microbatch) activation stashes alive on `device`: each lives
    from the start of its F to the end of its last backward (B, or BW when split)."""
    born, last = {}, {}
    rank = {"BI": 0, "B": 1, "BW": 1}
    for e in trace.events:
        if e.device != device or e.stream != "compute":
            continue
        key = (e.region, e.mb)
        if e.kind == "F":
            born[key] = e.start
        elif e.kind in rank:
            old = last.get(key)
            if old is None or (rank[e.kind], e.end) >= (rank[old[0]], old[1]):
                last[key] = (e.kind, e.end)
    marks = [(t, 1) for t in born.values()] + [(v[1], -1) for k, v in last.items() if k in born]
    peak = alive = 0
    for _, step in sorted(marks):
        alive += step
        peak = max(peak, alive)
    return peak
