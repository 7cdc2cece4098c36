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
  (B, or BW when split), or for a recomputed region (`pn.recompute`) none until its BI ran
  the forward again (that BI's new outputs replace the forward's in the stash; a B runs
  and drops it within the instruction); each value buffer (a forward's outputs, received activations and
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

This module holds the public face (settings, model states, samples over a step); the walk
through one device's instructions, handler by handler as the worker runs them, is the
ledger's (`sim.ledger`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COMPUTE, Op
from piper_nb.optim import OptimizerSpec, check_optimizer
from piper_nb.sim.cost import _elem
from piper_nb.sim.ledger import _Ledger, _numel
from piper_nb.sim.tokens import Routing
from piper_nb.sim.trace import MemorySample

__all__ = ["MemorySettings", "Holding", "model_states", "device_model_states", "communicators",
           "zero_model_states", "memory_samples", "live_stashes", "MIXED_PRECISION_ADAM",
           "OPTIMIZER_BYTES"]

# bytes of optimizer state per parameter (fp32 state): SGD none, momentum 1x, Adam(W) 2x
OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "sgd_momentum": 4, "adam": 8, "adamw": 8}


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """Bytes per parameter element; None means the parameter's own dtype size."""

    param_bytes: float | None = None   # weights
    grad_bytes: float | None = None    # gradients
    optim_bytes: float | None = None   # optimizer state (None: from `optimizer`)
    optimizer: object = "sgd"          # a name in OPTIMIZER_BYTES, or as pn.train takes it
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

    @functools.cached_property
    def spec(self) -> OptimizerSpec | None:
        """The optimizer as `pn.train` builds it (None: sized by name or `optim_bytes`)."""
        opt = self.optimizer
        if self.optim_bytes is not None or isinstance(opt, str):
            return None
        return check_optimizer(opt, "MemorySettings")

    def optim_per_param(self) -> float:
        """Optimizer state bytes per parameter element (the analytic figure)."""
        if self.optim_bytes is not None:
            return self.optim_bytes
        if self.spec is not None:
            return self.spec.per_element()
        key = self.optimizer.lower()
        if key not in OPTIMIZER_BYTES:
            raise PlanError(f"unknown optimizer {self.optimizer!r} for the memory model; use one "
                            f"of {', '.join(OPTIMIZER_BYTES)}, an optimizer factory as pn.train "
                            "takes it, or set optim_bytes=")
        return OPTIMIZER_BYTES[key]

    def optim_state(self, shape: tuple[int, ...], dtype: str, group: int = 0) -> float:
        """Bytes of state one updated tensor keeps: what the optimizer really allocates for
        that shape (its scalar `step` included), or the per-element figure."""
        if self.spec is not None:
            return self.spec.state_bytes(shape, dtype, group)
        return math.prod(shape) * self.optim_per_param()

    def group_of(self, name: str) -> int:
        return self.spec.group_of(name) if self.spec is not None else 0


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


def device_holdings(plan, d: int) -> list[Holding]:
    regions = {i.region for i in plan.devices[d].instrs
               if i.kind in COMPUTE and 0 <= i.region < len(plan.regions)}
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


def communicators(plan, d: int) -> int:
    """Communicators device d uses: one per collective group, one per direction of each
    pair it exchanges messages with (the runtime's layout, `runtime.comm`)."""
    seen = set()
    for ins in plan.devices[d].instrs:
        if ins.kind == Op.SEND:
            seen.add((d, ins.peer))
        elif ins.kind == Op.RECV:
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


def memory_samples(timing, settings: MemorySettings | None = None,
                   runs: list[bool] | None = None) -> list[MemorySample]:
    """Memory over the step: one sample per device (in `runs`, default all) and
    instruction, after it ran."""
    settings = settings or MemorySettings()
    routing = Routing(timing.plan, settings.tokens)
    samples = []
    for d in range(timing.plan.world):
        if runs is not None and not runs[d]:
            continue
        extra = settings.reserve_bytes + (settings.per_communicator
                                          * communicators(timing.plan, d)
                                          if settings.per_communicator else 0)
        samples += _Ledger(timing.plan, d, settings, routing).run(_sample_times(timing, d), d,
                                                                  extra)
    return samples


def live_stashes(trace, device: int) -> int:
    """Peak number of (region, microbatch) activation stashes alive on `device`: each lives
    from the start of its F to the end of its last backward (B, or BW when split)."""
    born, last = {}, {}
    rank = {Op.BI: 0, Op.B: 1, Op.BW: 1}
    for e in trace.events:
        if e.device != device or e.stream != "compute":
            continue
        key = (e.region, e.mb)
        if e.kind == Op.F:
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
