"""`Instr`: one instruction of a device plan, the atom the runtime and the simulator read.

An instruction is a small immutable value; its text form (`r0:F1`, `r0:SEND_F1>2`, `b0:AR`,
`b0:AG@F1`, `wait(...)`, `free(...)`) is the notation of `piper_nb.ir.text`, whose
docstring is the glossary, and its JSON form (`to_json`, fields off their defaults) is
exact. Its `kind` is an `Op` and its `purpose` a `Purpose`: the questions every
interpreter asks of an instruction (is it compute, is it issued then waited for, is it
the token dispatch whose counts the host exchanges first, is it clipping's norm) are the
properties below, asked in one way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from piper_nb.ir.kinds import COMM, COMPUTE, Held, Op, Purpose
from piper_nb.ir.text import instr_text

__all__ = ["Instr", "free_key", "parse_free"]


@dataclass(frozen=True, slots=True)
class Instr:
    kind: Op                        # F B BI BW U SEND RECV ALL_* REDUCE_SCATTER WAIT FREE
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
    purpose: Purpose = Purpose.NONE  # collectives: why (see `ir.kinds.Purpose`)
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
        """Runs on the compute stream: a pass or the update."""
        return self.kind in COMPUTE

    @property
    def is_issue(self) -> bool:
        """Issued asynchronously and completed by a later WAIT: a message or collective."""
        return self.kind in COMM

    @property
    def is_counted_dispatch(self) -> bool:
        """A forward token dispatch: before issuing it the host exchanges the token counts
        with its group (a blocking host step), since the pieces' sizes depend on routing."""
        return self.kind == Op.ALL_TO_ALL and self.purpose == Purpose.DISPATCH and not self.grad

    @property
    def is_norm(self) -> bool:
        """Clipping's all-reduce of this device's share of the squared gradient norm."""
        return self.kind == Op.ALL_REDUCE and self.purpose == Purpose.NORM

    @property
    def is_count(self) -> bool:
        """The global-batch loss's all-reduce of what this device's losses count."""
        return self.kind == Op.ALL_REDUCE and self.purpose == Purpose.COUNT

    @property
    def is_scalar(self) -> bool:
        """An all-reduce of one float64 (the norm or the count): no gradient, no bucket."""
        return self.is_norm or self.is_count

    def __str__(self) -> str:
        return instr_text(self)

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else str(v) if isinstance(
                    v, (Op, Purpose)) else v
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Instr:
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in obj.items()}
        kw["kind"] = Op(kw["kind"])
        if "purpose" in kw:
            kw["purpose"] = Purpose(kw["purpose"])
        return cls(**kw)


def free_key(held: Held, name: str | int, mb: int | None = None) -> str:
    """A FREE key: `act:x@1`, `grad:x@1` (value and microbatch) or `param:0` (a bucket)."""
    return f"{held}:{name}" if mb is None else f"{held}:{name}@{mb}"


def parse_free(key: str) -> tuple[Held, object]:
    """A FREE key -> (Held.PARAM, bucket) | (Held.ACT or Held.GRAD, (value, microbatch))."""
    kind, _, rest = key.partition(":")
    held = Held(kind)
    if held == Held.PARAM:
        return held, int(rest)
    value, _, mb = rest.rpartition("@")
    return held, (value, int(mb))
