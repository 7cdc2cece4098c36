"""`Instr`: one instruction of a device plan, the atom the runtime and the simulator read.

An instruction is a small immutable value; its text form (`r0:F1`, `r0:SEND_F1>2`, `b0:AR`,
`b0:AG@F1`, `wait(...)`, `free(...)`) is the notation of `piper_nb.ir.text`, whose
docstring is the glossary, and its JSON form (`to_json`, fields off their defaults) is
exact. Its `kind` is an `Op`; what only one kind has lives in that kind's payload, `data`
(a pass's overlap slot, a message's peer, a collective's group and `Purpose`, a wait's
target, ...), so a field for one kind touches that kind's payload and the code that
handles it, not every reader of instructions. The questions every
interpreter asks of an instruction (is it compute, is it issued then waited for, is it
the token dispatch whose counts the host exchanges first, is it clipping's norm) are the
properties below, asked in one way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from piper_nb.ir.kinds import COLLECTIVES, COMM, COMPUTE, P2P, PASSES, Held, Op, Purpose, Unit
from piper_nb.ir.text import instr_text

__all__ = ["Instr", "Pass", "Update", "Message", "Collective", "Wait", "Free", "Payload",
           "PAYLOADS", "free_key", "parse_free", "slice_name"]


@dataclass(frozen=True, slots=True)
class Pass:
    """F, B, BI, BW: a pass of a region over a microbatch."""

    overlap: int = -1               # passes sharing an overlap slot (F&B)
    recompute: bool = False         # a pass of a recomputed region (`pn.recompute`)
    unit: Unit = Unit.NONE          # a forward of a layer recomputed as one unit
    keep: tuple[str, ...] = ()      # the outputs such a forward's second run stores
    slices: tuple[str, ...] = ()    # SP: inputs kept as this device's slice (F), gathered
                                    # again and read by the backwards (`compiler.regather`)
    compiled: str = ""              # run through torch.compile (`pn.compile_regions`):
                                    # "backend[:mode][:dynamic]"


@dataclass(frozen=True, slots=True)
class Update:
    """U: the optimizer step of what this device updates here."""

    params: tuple[str, ...] = ()    # parameters updated whole
    buckets: tuple[int, ...] = ()   # sharded buckets (ZeRO) updated by their shard


@dataclass(frozen=True, slots=True)
class Message:
    """SEND, RECV: values sent to, or received from, one peer."""

    peer: int = -1
    tag: int = -1                   # matches a SEND with its RECV
    values: tuple[str, ...] = ()    # the value names it carries
    grad: bool = False              # gradients (backward) rather than activations


@dataclass(frozen=True, slots=True)
class Collective:
    """ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL over a device group."""

    group: tuple[int, ...] = ()
    purpose: Purpose = Purpose.NONE  # why (see `ir.kinds.Purpose`)
    bucket: int = -1                # over a parameter bucket (-1: over values)
    values: tuple[str, ...] = ()    # value names (tensor parallelism, the all-to-alls)
    grad: bool = False              # in the backward
    owners: tuple[int, ...] = ()    # ALL_TO_ALL: per value, the device holding its expert
    split_by: tuple[str, ...] = ()  # ALL_TO_ALL: per value, the dispatched value whose
                                    # per-replica token counts size its pieces
    regather: bool = False          # TP ALL_GATHER of the slices a forward kept (`slice_name`)


@dataclass(frozen=True, slots=True)
class Wait:
    """WAIT: complete the issued instruction at index `target` of the same list."""

    target: int = -1


@dataclass(frozen=True, slots=True)
class Free:
    """FREE: release buffers ("act:x@1", "grad:x@1", "param:0"; `free_key`)."""

    keys: tuple[str, ...] = ()


Payload = Pass | Update | Message | Collective | Wait | Free

PAYLOADS: dict[Op, type] = {
    **{k: Pass for k in PASSES}, Op.U: Update, **{k: Message for k in P2P},
    **{k: Collective for k in COLLECTIVES}, Op.WAIT: Wait, Op.FREE: Free}


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction: what every kind has (which pass or message, where, for which
    replica), and its kind's own fields in `data` (`PAYLOADS[kind]`: `Pass`, `Update`,
    `Message`, `Collective`, `Wait`, `Free`). `Instr.of` takes the kind's fields flat."""

    kind: Op                        # F B BI BW U SEND RECV ALL_* REDUCE_SCATTER WAIT FREE
    node: str = ""                  # the DAG node it comes from
    stream: str = "compute"
    region: int = -1
    mb: int = -1
    replica: int = 0                # position of this device in the region's replica group
    replicas: int = 1
    data: Payload | None = None     # the kind's fields; None: the kind's defaults

    def __post_init__(self):
        if self.data is None:
            object.__setattr__(self, "data", PAYLOADS[self.kind]())
        elif type(self.data) is not PAYLOADS[self.kind]:
            raise TypeError(f"a {self.kind} instruction carries a {PAYLOADS[self.kind].__name__}, "
                            f"not a {type(self.data).__name__}")

    @classmethod
    def of(cls, kind: Op | str, node: str = "", stream: str = "compute", region: int = -1,
           mb: int = -1, replica: int = 0, replicas: int = 1, **fields_) -> Instr:
        """An instruction with its kind's fields given flat: `Instr.of("SEND", peer=1)`."""
        payload = PAYLOADS[kind]
        wrong = [k for k in fields_ if k not in payload.__dataclass_fields__]
        if wrong:
            raise TypeError(f"a {kind} instruction has no field {', '.join(wrong)} "
                            f"({payload.__name__}: {', '.join(payload.__dataclass_fields__)})")
        return cls(Op(kind), node, stream, region, mb, replica, replicas, payload(**fields_))

    def with_data(self, **changes) -> Instr:
        """This instruction with some of its kind's fields changed."""
        return Instr(self.kind, self.node, self.stream, self.region, self.mb, self.replica,
                     self.replicas, replace(self.data, **changes))

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
        return (self.kind == Op.ALL_TO_ALL and self.data.purpose == Purpose.DISPATCH
                and not self.data.grad)

    @property
    def overlap(self) -> int:
        """The overlap slot of a pass (-1: none, and for every other kind)."""
        return self.data.overlap if self.kind in PASSES else -1

    @property
    def purpose(self) -> Purpose:
        """Why a collective moves what it moves (`Purpose.NONE` for every other kind)."""
        return self.data.purpose if self.kind in COLLECTIVES else Purpose.NONE

    @property
    def bucket(self) -> int:
        """The parameter bucket a collective moves (-1: none, and for every other kind)."""
        return self.data.bucket if self.kind in COLLECTIVES else -1

    @property
    def sums_values(self) -> bool:
        """A collective over values between the parts of a region cut over a group (tensor
        or context parallelism), not over a bucket: partial sums, gathered slices, and the
        dual sums of their gradients."""
        return self.kind in COLLECTIVES and self.data.purpose in (Purpose.TP, Purpose.CP)

    @property
    def is_regather(self) -> bool:
        """Sequence parallelism's all-gather, before a backward, of the slices its forward
        kept of an input (`compiler.regather`)."""
        return self.kind == Op.ALL_GATHER and self.data.regather

    @property
    def is_norm(self) -> bool:
        """Clipping's all-reduce of this device's share of the squared gradient norm."""
        return self.kind == Op.ALL_REDUCE and self.data.purpose == Purpose.NORM

    @property
    def is_count(self) -> bool:
        """The global-batch loss's all-reduce of what this device's losses count."""
        return self.kind == Op.ALL_REDUCE and self.data.purpose == Purpose.COUNT

    @property
    def is_scalar(self) -> bool:
        """An all-reduce of one float64 (the norm or the count): no gradient, no bucket."""
        return self.is_norm or self.is_count

    def __str__(self) -> str:
        return instr_text(self)

    def to_json(self) -> dict:
        """The flat JSON object: the shared fields and the kind's, each off its default."""
        out = {"kind": str(self.kind)}
        shared = fields(self)[1:-1]          # between `kind` and `data`: node ... replicas
        for obj, fs in ((self, shared), (self.data, fields(self.data))):
            for f in fs:
                v = getattr(obj, f.name)
                if v != f.default:
                    out[f.name] = list(v) if isinstance(v, tuple) else str(v) if isinstance(
                        v, (Op, Purpose, Unit)) else v
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Instr:
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in obj.items()}
        if "purpose" in kw:
            kw["purpose"] = Purpose(kw["purpose"])
        if "unit" in kw:
            kw["unit"] = Unit(kw["unit"])
        return cls.of(**kw)


def slice_name(value: str) -> str:
    """The value a forward stores for input `value` it keeps as its sequence slice
    (`Pass.slices`): s/t of the sequence, gathered again before the backward."""
    return f"{value}#slice"


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
