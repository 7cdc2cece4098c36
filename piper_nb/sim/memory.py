"""Memory model: bytes per device over one step, by kind (params, grads, optim,
activations, buffers), from a Plan and the times its instructions ran.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020) per bucket a
device holds: parameters are full for zero 0-2 and a 1/N shard for zero 3 (plus the full
bucket while a gathered "param:<bucket>" is alive); gradients are full for zero 0-1 and a
shard for zero 2-3; optimizer state covers the shard when zero >= 1. Activations are the
bytes autograd saves for a pass (`plan.saved[region]`) from its F until its last backward
(B, or BW when split), plus each "act:"/"grad:" buffer while its key is alive; comm
buffers are the full gradients a ZeRO-2/3 reduce-scatter reads and all-to-all payloads.
`zero_model_states` runs the same accounting on one bucket of Psi parameters, so the
paper's 16 Psi / 4 Psi + 12 Psi/N / 2 Psi + 14 Psi/N / 16 Psi/N come out of this code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.sim.cost import _elem, value_bytes
from piper_nb.sim.trace import MemorySample

__all__ = ["MemorySettings", "Holding", "model_states", "device_model_states",
           "zero_model_states", "memory_samples", "live_stashes", "MIXED_PRECISION_ADAM",
           "OPTIMIZER_BYTES"]

_PASSES = frozenset({"F", "B", "BI", "BW", "U"})
# bytes of optimizer state per parameter (fp32 state): SGD none, momentum 1x, Adam(W) 2x
OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "sgd_momentum": 4, "adam": 8, "adamw": 8}


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """Bytes per parameter element; None means the parameter's own dtype size."""

    param_bytes: float | None = None   # weights
    grad_bytes: float | None = None    # gradients
    optim_bytes: float | None = None   # optimizer state (None: from `optimizer`)
    optimizer: object = "sgd"          # a name in OPTIMIZER_BYTES or an optimizer object

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


def model_states(holdings, settings: MemorySettings = MemorySettings()) -> dict[str, float]:
    """Steady-state bytes of params, grads and optimizer state for these holdings."""
    out = {"params": 0.0, "grads": 0.0, "optim": 0.0}
    ob = settings.optim_per_param()
    for h in holdings:
        pb = settings.param_bytes if settings.param_bytes is not None else h.elem
        gb = settings.grad_bytes if settings.grad_bytes is not None else h.elem
        shard = math.ceil(h.numel / h.group)
        out["params"] += pb * (shard if h.zero >= 3 else h.numel)
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
            out.append(Holding(_numel(plan, p), 0, 1, _elem(plan.params[p][1])))
        elif b.index not in seen:
            seen.add(b.index)
            numel = sum(_numel(plan, q) for q in b.params)
            out.append(Holding(numel, b.zero, len(b.group), _elem(plan.params[p][1])))
    return out


def device_model_states(plan, d: int, settings: MemorySettings = MemorySettings()) -> dict:
    return model_states(device_holdings(plan, d), settings)


def _bucket_numel_bytes(plan, b: int, per: float | None) -> float:
    bk = plan.buckets[b]
    return sum(_numel(plan, p) * (per if per is not None else _elem(plan.params[p][1]))
               for p in bk.params)


def _zero(plan, ins) -> int:
    return plan.buckets[ins.bucket].zero if 0 <= ins.bucket < len(plan.buckets) else 0


def _deltas(timing, d: int, settings: MemorySettings) -> list[tuple[float, int, float]]:
    """(time, kind index, delta) for one device; kinds: 3 activations, 4 buffers, 0 params."""
    plan, instrs = timing.plan, timing.plan.devices[d].instrs
    posted, start, end = timing.posted[d], timing.start[d], timing.end[d]
    freeable = {k for i in instrs if i.kind == "FREE" for k in i.keys}
    last_bwd: dict[tuple[int, int], int] = {}
    for i, ins in enumerate(instrs):
        if ins.kind in ("B", "BI", "BW"):
            prev = last_bwd.get((ins.region, ins.mb))
            if prev is None or ins.kind != "BI" or instrs[prev].kind == "BI":
                last_bwd[(ins.region, ins.mb)] = i
    regions = plan.regions
    vbytes = {k: value_bytes(v) for k, v in plan.values.items()}
    alive: dict[str, float] = {}
    gathered: dict[str, list[float]] = {}
    out: list[tuple[float, int, float]] = []

    def make(key: str, nbytes: float, t: float) -> None:
        if key in freeable and key not in alive:
            alive[key] = nbytes
            out.append((t, 3, nbytes))

    for i, ins in enumerate(instrs):
        k = ins.kind
        known = 0 <= ins.region < len(regions)
        if k == "F" and known:
            out.append((start[i], 3, plan.saved.get(ins.region, 0)))
            for v in regions[ins.region].outputs:
                if v in plan.values:
                    make(f"act:{v}@{ins.mb}", vbytes[v], start[i])
        if k in ("B", "BI") and known:
            for v in regions[ins.region].inputs:
                if v in plan.values:
                    make(f"grad:{v}@{ins.mb}", vbytes[v], start[i])
        if k in ("B", "BI", "BW") and last_bwd.get((ins.region, ins.mb)) == i:
            out.append((end[i], 3, -plan.saved.get(ins.region, 0)))
        elif k == "RECV":
            for v in ins.values:
                make(f"{'grad' if ins.grad else 'act'}:{v}@{ins.mb}", vbytes[v],
                     posted[i])
        elif k == "ALL_GATHER" and ins.purpose == "param" and _zero(plan, ins) >= 3:
            nbytes = _bucket_numel_bytes(plan, ins.bucket, settings.param_bytes)
            gathered.setdefault(f"param:{ins.bucket}", []).append(nbytes)
            out.append((posted[i], 0, nbytes))
        elif k == "REDUCE_SCATTER" and _zero(plan, ins) >= 2:
            nbytes = _bucket_numel_bytes(plan, ins.bucket, settings.grad_bytes)
            out += [(posted[i], 4, nbytes), (end[i], 4, -nbytes)]
        elif k == "ALL_TO_ALL":
            nbytes = sum(vbytes[v] for v in ins.values if v in plan.values)
            out += [(posted[i], 4, nbytes), (end[i], 4, -nbytes)]
        elif k == "FREE":
            for key in ins.keys:
                if key in alive:
                    out.append((start[i], 3, -alive.pop(key)))
                elif gathered.get(key):
                    out.append((start[i], 0, -gathered[key].pop(0)))
    return out


def memory_samples(timing, settings: MemorySettings | None = None) -> list[MemorySample]:
    """Memory over the step, one sample per device whenever its usage changes."""
    settings = settings or MemorySettings()
    samples = []
    for d in range(timing.plan.world):
        base = device_model_states(timing.plan, d, settings)
        level = [base["params"], base["grads"], base["optim"], 0.0, 0.0]
        samples.append(MemorySample(d, 0.0, *(int(x) for x in level)))   # before the step
        deltas = sorted(_deltas(timing, d, settings), key=lambda x: (x[0], x[2] > 0))
        for j, (t, kind, delta) in enumerate(deltas):
            level[kind] += delta
            if j + 1 == len(deltas) or deltas[j + 1][0] != t:
                samples.append(MemorySample(d, t, *(int(x) for x in level)))
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
