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
- activations: for each forward stash (region, microbatch) the bytes autograd saved outside
  the region's inputs and outputs (`plan.saved[region]`, as `pn.compile` measured them)
  from its F until its last backward (B, or BW when split), or for a recomputed region
  (`pn.recompute`) none until its BI ran the forward again (a B runs and drops it within
  the instruction); each value buffer (a forward's outputs, received activations and
  gradients, input gradients a backward makes) from its creation until it is freed *and*
  no live stash still refers to it (a stash keeps the input and output buffers autograd
  saved, `plan.kept`; a recomputed forward's stash its inputs until its backward; between
  BI and BW, the output gradients); received buffers count from their RECV's issue;
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

import math
from dataclasses import dataclass

from piper_nb.ir.kinds import COMM, COMPUTE
from piper_nb.plan.sizes import element_size
from piper_nb.plan.streams import communicator
from piper_nb.sim.ledger import Ledger
from piper_nb.sim.ledger_params import param_numel
from piper_nb.sim.memory_settings import (
    DEFAULT_SETTINGS,
    MIXED_PRECISION_ADAM,
    OPTIMIZER_BYTES,
    MemorySettings,
)
from piper_nb.sim.tokens import Routing
from piper_nb.trace import MemorySample

__all__ = ["MemorySettings", "Holding", "model_states", "device_model_states", "communicators",
           "zero_model_states", "memory_samples", "MIXED_PRECISION_ADAM",
           "OPTIMIZER_BYTES"]

@dataclass(frozen=True)
class Holding:
    """Parameters a device holds as one unit: `numel` elements, ZeRO level, group size."""

    numel: int
    zero: int = 0
    group: int = 1
    elem: int = 4     # dtype bytes, used when the settings do not say
    trainable: bool = True   # frozen parameters hold no gradient and no optimizer state


def model_states(holdings, settings: MemorySettings = DEFAULT_SETTINGS) -> dict[str, float]:
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
            out.append(Holding(param_numel(plan, p), 0, 1, element_size(plan.params[p][1]),
                               trainable=p not in plan.frozen))
        elif b.index not in seen:
            seen.add(b.index)
            numel = sum(param_numel(plan, q) for q in b.params)
            out.append(Holding(numel, b.zero, len(b.group), element_size(plan.params[p][1])))
    return out


def device_model_states(plan, d: int, settings: MemorySettings = DEFAULT_SETTINGS) -> dict:
    """The ZeRO paper's steady-state model states of device `d` (all allocated at once)."""
    return model_states(device_holdings(plan, d), settings)


def communicators(plan, d: int) -> int:
    """Communicators device d uses: one per collective group, one per direction of each
    pair it exchanges messages with (the stream program's layout, `plan.streams`)."""
    return len({communicator(d, ins) for ins in plan.devices[d].instrs if ins.kind in COMM})


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
        samples += Ledger(timing.plan, d, settings, routing).run(_sample_times(timing, d), d,
                                                                  extra)
    return samples
