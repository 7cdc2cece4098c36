"""Plans: one instruction list per device, the only thing the runtime executes.

An `Instr` is a small immutable value with a compact text form in PyTorch's spirit:
`0F1` (region 0 forward, microbatch 1), `1I0`/`1W0` (backward for inputs / weights),
`0U` (update), `0SEND_F1>2` (send region 0's activations of microbatch 1 to device 2),
`1RECV_B0<3` (receive gradients from device 3), `AR0`, `RS0@1`, `AG0@1` (collectives over
bucket 0, microbatch 1), `wait(AR0)`, `free(act:x@1)`. Communication is issued on its own
logical stream and waited for right before its consumer, so it overlaps compute.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from piper_nb.ir.kinds import COMM, COMPUTE, LETTER, P2P, SHORT

__all__ = ["Instr", "DevicePlan", "Plan"]


@dataclass(frozen=True, slots=True)
class Instr:
    kind: str                       # F B BI BW U SEND RECV ALL_* REDUCE_SCATTER WAIT FREE
    node: str = ""                  # the DAG node it comes from
    stream: str = "compute"
    region: int = -1
    mb: int = -1
    replica: int = 0                # position of this device in the region's replica group
    replicas: int = 1
    peer: int = -1                  # SEND / RECV
    tag: int = -1                   # SEND / RECV message tag
    group: tuple[int, ...] = ()     # collectives
    bucket: int = -1                # collectives over parameter buckets
    values: tuple[str, ...] = ()    # SEND / RECV / ALL_TO_ALL: value names
    grad: bool = False              # SEND / RECV carry gradients
    purpose: str = ""               # collectives: "grad" | "param" | "a2a"
    target: int = -1                # WAIT: index of the issue it waits for
    keys: tuple[str, ...] = ()      # FREE: buffers released ("act:x@1", "grad:x@1", "param:0")
    params: tuple[str, ...] = ()    # U: parameters this device updates here
    buckets: tuple[int, ...] = ()   # U: sharded buckets this device updates here
    overlap: int = -1               # passes sharing an overlap slot (F&B)
    owners: tuple[int, ...] = ()    # ALL_TO_ALL: per value, the device holding its expert
    split_by: tuple[str, ...] = ()  # ALL_TO_ALL: per value, the dispatched value whose
                                    # per-replica token counts size its pieces
    recompute: bool = False         # F / B / BI of a recomputed region (`pn.recompute`)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_issue(self) -> bool:
        return self.kind in COMM

    def __str__(self) -> str:
        k = self.kind
        if k in LETTER:
            return f"{self.region}{LETTER[k]}{self.mb if self.mb >= 0 else ''}"
        if k == "U":
            return f"{self.region}U"
        if k in P2P:
            arrow = ">" if k == "SEND" else "<"
            mb = self.mb if self.mb >= 0 else ""
            return f"{self.region}{k}_{'B' if self.grad else 'F'}{mb}{arrow}{self.peer}"
        if k in SHORT:
            core = f"{SHORT[k]}{self.bucket if self.bucket >= 0 else ''}"
            return core + (f"@{self.mb}" if self.mb >= 0 else "")
        if k == "FREE":
            return "free(" + ",".join(self.keys) + ")"
        return k

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Instr:
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in obj.items()}
        return cls(**kw)


@dataclass(frozen=True)
class DevicePlan:
    device: int
    instrs: tuple[Instr, ...]
    # (template's instrs, own instrs) when the lowering stamped these instructions out of
    # another replica's (equal but for replica, peers and tags); the claim holds only while
    # `instrs` is still that very tuple (see `Plan.stamps`)
    stamp: tuple | None = field(default=None, compare=False, repr=False)

    def text(self, waits: bool = False) -> list[str]:
        out = []
        for ins in self.instrs:
            if ins.kind == "WAIT":
                if waits:
                    out.append(f"wait({self.instrs[ins.target]})")
            elif ins.kind != "FREE" or waits:
                out.append(str(ins))
        return out

    def compute(self) -> list[Instr]:
        return [i for i in self.instrs if i.is_compute]


@dataclass(frozen=True)
class Plan:
    """Per-device instruction lists plus the tables the runtime and simulator share."""

    world: int
    devices: tuple[DevicePlan, ...]
    microbatches: int
    batch_size: int
    loss_scale: float
    regions: tuple = ()             # RegionInfo per region
    buckets: tuple = ()             # Bucket per bucket
    values: dict = field(default_factory=dict)        # name -> ValueInfo
    saved: dict = field(default_factory=dict)         # region -> saved activation bytes
    rows: dict = field(default_factory=dict)          # value -> symbol of its routed rows
    saved_rows: dict = field(default_factory=dict)    # region -> {symbol: saved bytes per row}
    params: dict = field(default_factory=dict)        # name -> (shape, dtype)
    frozen: tuple[str, ...] = ()    # parameters without requires_grad: never updated
    batch_names: tuple[str, ...] = ("inputs", "targets")   # the batch's tensors, in order
    dag: Any = None
    program: Any = None
    capture: Any = None

    def __getitem__(self, device: int) -> DevicePlan:
        return self.devices[device]

    def stamps(self) -> dict[int, int]:
        """Device -> the device its instructions were stamped from by the lowering (same
        instructions but for replica, peers and tags), for devices where that still holds:
        both instruction tuples are the very ones the lowering made."""
        templates = {id(dp.instrs): dp.device for dp in self.devices if dp.stamp is None}
        out = {}
        for dp in self.devices:
            if dp.stamp is not None and dp.stamp[1] is dp.instrs:
                t = templates.get(id(dp.stamp[0]))
                if t is not None and self.devices[t].instrs is dp.stamp[0]:
                    out[dp.device] = t
        return out

    def grid(self, waits: bool = False, compute_only: bool = False) -> str:
        """A text grid: one column per device, one row per step."""
        cols = []
        for dp in self.devices:
            rows = [str(i) for i in dp.instrs if i.is_compute] if compute_only else dp.text(waits)
            cols.append([f"dev{dp.device}", *rows])
        return _columns(cols)

    def text(self) -> str:
        return self.grid()

    def to_torch_csv(self, devices: tuple[int, ...] | list[int] | None = None) -> str:
        """The compute passes per device (or per one of `devices`) as PyTorch pipelining's
        schedule CSV (`0F1`, stage = PP index); see `piper_nb.schedules.torch_csv`."""
        from piper_nb.schedules.torch_csv import plan_to_torch_csv
        return plan_to_torch_csv(self, devices)

    def __repr__(self) -> str:
        n = sum(len(d.instrs) for d in self.devices)
        return (f"Plan(world={self.world}, microbatches={self.microbatches}, "
                f"regions={len(self.regions)}, buckets={len(self.buckets)}, instructions={n})")

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({
            "world": self.world, "microbatches": self.microbatches,
            "batch_size": self.batch_size, "loss_scale": self.loss_scale,
            "regions": [{"index": r.index, "tags": dict(r.tags), "inputs": list(r.inputs),
                         "outputs": list(r.outputs), "params": list(r.params)}
                        for r in self.regions],
            "buckets": [asdict(b) for b in self.buckets],
            "values": {k: {"shape": list(v.shape), "dtype": v.dtype,
                           "requires_grad": v.requires_grad} for k, v in self.values.items()},
            "saved": {str(k): v for k, v in self.saved.items()},
            "rows": self.rows,
            "saved_rows": {str(k): v for k, v in self.saved_rows.items()},
            "params": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.params.items()},
            "frozen": list(self.frozen),
            "batch_names": list(self.batch_names),
            "devices": [[i.to_json() for i in dp.instrs] for dp in self.devices],
        }, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        from piper_nb.capture.split import RegionInfo
        from piper_nb.compiler.shapes import ValueInfo
        from piper_nb.directives.replicate import Bucket
        from piper_nb.ir.filters import freeze_tags
        obj = json.loads(text)
        regions = tuple(RegionInfo(index=r["index"], tags=freeze_tags(r["tags"]), modules=(),
                                   params=tuple(r["params"]), buffers=(), inputs=tuple(r["inputs"]),
                                   outputs=tuple(r["outputs"])) for r in obj["regions"])
        buckets = tuple(Bucket(**{k: tuple(v) if isinstance(v, list) else v for k, v in b.items()})
                        for b in obj["buckets"])
        values = {k: ValueInfo(k, tuple(v["shape"]), v["dtype"], v["requires_grad"])
                  for k, v in obj["values"].items()}
        devices = tuple(DevicePlan(d, tuple(Instr.from_json(i) for i in instrs))
                        for d, instrs in enumerate(obj["devices"]))
        return cls(world=obj["world"], devices=devices, microbatches=obj["microbatches"],
                   batch_size=obj["batch_size"], loss_scale=obj["loss_scale"], regions=regions,
                   buckets=buckets, values=values,
                   saved={int(k): v for k, v in obj["saved"].items()},
                   rows=obj.get("rows", {}),
                   saved_rows={int(k): v for k, v in obj.get("saved_rows", {}).items()},
                   params={k: (tuple(v["shape"]), v["dtype"]) for k, v in obj["params"].items()},
                   frozen=tuple(obj.get("frozen", ())),
                   batch_names=tuple(obj.get("batch_names", ("inputs", "targets"))))


def _columns(cols: list[list[str]], mark: dict[int, int] | None = None) -> str:
    height = max(len(c) for c in cols)
    width = [max(len(x) for x in c) + 2 for c in cols]
    lines = []
    for r in range(height):
        cells = []
        for ci, c in enumerate(cols):
            cell = c[r] if r < len(c) else ""
            if mark and mark.get(ci) == r:
                cell = f">{cell}<"
            cells.append(cell.ljust(width[ci] + 2))
        lines.append("".join(cells).rstrip())
    return "\n".join(lines)
