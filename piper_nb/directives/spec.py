"""Directive values and Piper's JSON list format for them (`pn.Program`).

Each directive is a frozen dataclass with a JSON form whose `op` and field names are
Piper's (`place`, `replicate`, `shard`, `split`, `order`), plus our `schedule` op that
expands a builder. The rewrites themselves live beside this file, one module each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from piper_nb.errors import PlanError
from piper_nb.ir.filters import as_filter

__all__ = ["Directive", "Place", "Replicate", "Shard", "Split", "Order", "Schedule", "Program",
           "place", "replicate", "shard", "split", "order", "directive_from_json"]


def _devices(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise PlanError(f"{where}: devices must be a non-empty list of device ids, got {value!r}")
    out = []
    for d in value:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise PlanError(f"{where}: device ids are non-negative integers, got {d!r}")
        out.append(d)
    if len(set(out)) != len(out):
        raise PlanError(f"{where}: devices {out} repeat a device id; list each device once")
    return tuple(out)


def _stream(value: Any, where: str) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise PlanError(f"{where}: stream must be a non-empty name or null, got {value!r}")


@dataclass(frozen=True)
class Directive:
    op = "directive"

    def to_json(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class Place(Directive):
    """Run the matched compute on `devices` (a group: SPMD replicas when replicated)."""

    filter: Mapping[str, Any]
    devices: tuple[int, ...]
    stream: str | None = None
    op = "place"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="place filter"))
        object.__setattr__(self, "devices", _devices(self.devices, "place"))
        object.__setattr__(self, "stream", _stream(self.stream, "place"))

    def to_json(self) -> dict:
        return {"op": "place", "filter": dict(self.filter), "devices": list(self.devices),
                "stream": self.stream}


@dataclass(frozen=True)
class Replicate(Directive):
    """Data-parallel replicas of the matched regions, with ZeRO level 0-3.

    zero=0 all-reduces gradients; 1 shards optimizer state (reduce-scatter, update the
    shard, all-gather parameters); 2 also shards gradients (reduce-scatter after each
    microbatch's backward); 3 also shards parameters (all-gather before each pass that
    needs them, freed after). `bucket_size` is in MB (None: one bucket per region).
    `reshard=False` (zero 3 only) keeps a region's parameters gathered from its first pass
    to its last in the step and reduce-scatters gradients once after the last backward
    (FSDP's no-reshard + no-sync accumulation): fewer collectives, full parameters and
    gradients held within the step.
    """

    filter: Mapping[str, Any]
    devices: tuple[int, ...]
    zero: int = 0
    bucket_size: float | None = None
    reduce_stream: str | None = None
    gather_stream: str | None = None
    reshard: bool = True
    op = "replicate"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="replicate filter"))
        object.__setattr__(self, "devices", _devices(self.devices, "replicate"))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError(f"replicate: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.bucket_size is not None and (
                isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, float))
                or self.bucket_size <= 0):
            raise PlanError(f"replicate: bucket_size is a positive number of MB, got {self.bucket_size!r}")
        if not isinstance(self.reshard, bool):
            raise PlanError(f"replicate: reshard is true or false, got {self.reshard!r}")
        if not self.reshard and self.zero != 3:
            raise PlanError("replicate: reshard=false only applies to zero=3 (parameters are "
                            "sharded between uses only there); drop it or use zero=3")
        object.__setattr__(self, "reduce_stream", _stream(self.reduce_stream, "replicate"))
        object.__setattr__(self, "gather_stream", _stream(self.gather_stream, "replicate"))

    def to_json(self) -> dict:
        out = {"op": "replicate", "filter": dict(self.filter), "devices": list(self.devices),
               "zero": self.zero}
        if self.zero >= 2:
            out["shard_grads"] = True
        if self.zero == 3:
            out["shard_params"] = True
        for key in ("bucket_size", "reduce_stream", "gather_stream"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if not self.reshard:
            out["reshard"] = False
        return out


@dataclass(frozen=True)
class Shard(Directive):
    """Expert parallelism: the matched (EP) regions are spread over `devices`, with
    all-to-all on the edges into and out of them; they are not replicated."""

    filter: Mapping[str, Any]
    devices: tuple[int, ...]
    stream: str | None = None
    op = "shard"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="shard filter"))
        object.__setattr__(self, "devices", _devices(self.devices, "shard"))
        object.__setattr__(self, "stream", _stream(self.stream, "shard"))

    def to_json(self) -> dict:
        return {"op": "shard", "filter": dict(self.filter), "devices": list(self.devices),
                "stream": self.stream}


@dataclass(frozen=True)
class Split(Directive):
    """Copy the matched sub-DAG `num` times, copy i tagged `dim=i` (microbatches)."""

    filter: Mapping[str, Any]
    dim: str = "MB"
    num: int = 1
    op = "split"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="split filter"))
        if not isinstance(self.dim, str) or not self.dim or self.dim == "PASS":
            raise PlanError(f"split: dim_name must be a tag name such as 'MB', got {self.dim!r}")
        if isinstance(self.num, bool) or not isinstance(self.num, int) or self.num < 1:
            raise PlanError(f"split: num_microbatches must be a positive integer, got {self.num!r}")

    def to_json(self) -> dict:
        return {"op": "split", "filter": dict(self.filter), "dim_name": self.dim,
                "num_microbatches": self.num}


@dataclass(frozen=True)
class Order(Directive):
    """Temporal edges from each slot to the next; a slot of several filters may overlap."""

    groups: tuple[tuple[Mapping[str, Any], ...], ...]
    op = "order"

    def __post_init__(self):
        groups = self.groups
        if not isinstance(groups, (list, tuple)) or not groups:
            raise PlanError("order: filters must be a non-empty list of slots, each a list of filters")
        out = []
        for i, group in enumerate(groups):
            if isinstance(group, Mapping):
                group = [group]
            if not isinstance(group, (list, tuple)) or not group:
                raise PlanError(f"order: slot {i} must be a non-empty list of filters, got {group!r}")
            out.append(tuple(as_filter(f, where=f"order slot {i}") for f in group))
        object.__setattr__(self, "groups", tuple(out))

    def to_json(self) -> dict:
        return {"op": "order", "filters": [[dict(f) for f in g] for g in self.groups]}


@dataclass(frozen=True)
class Schedule(Directive):
    """A named schedule builder, expanded into split/order (and optionally place) directives
    by the compiler (`compiler.compile.expand`, with `schedules.build`)."""

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    op = "schedule"

    def to_json(self) -> dict:
        return {"op": "schedule", "name": self.name, **dict(self.args)}


# ---- constructors (the public, Piper-like spelling) -----------------------------------
def place(filter: Mapping[str, Any], devices: Sequence[int] | int, stream: str | None = None) -> Place:
    return Place(filter, devices, stream)


def replicate(filter: Mapping[str, Any], devices: Sequence[int], zero: int = 0,
              bucket_size: float | None = None, reduce_stream: str | None = None,
              gather_stream: str | None = None, reshard: bool = True) -> Replicate:
    return Replicate(filter, devices, zero, bucket_size, reduce_stream, gather_stream, reshard)


def shard(filter: Mapping[str, Any], devices: Sequence[int], stream: str | None = None) -> Shard:
    return Shard(filter, devices, stream)


def split(filter: Mapping[str, Any], dim: str = "MB", num: int = 4) -> Split:
    return Split(filter, dim, num)


def order(groups: Sequence[Any]) -> Order:
    return Order(groups)


# ---- JSON -----------------------------------------------------------------------------
_FIELDS = {
    "place": {"op", "filter", "devices", "stream"},
    "replicate": {"op", "filter", "devices", "zero", "shard_grads", "shard_params", "bucket_size",
                  "reduce_stream", "gather_stream", "reshard"},
    "shard": {"op", "filter", "devices", "stream"},
    "split": {"op", "filter", "dim_name", "num_microbatches"},
    "order": {"op", "filters"},
}


def directive_from_json(obj: Any) -> Directive:
    """One directive from Piper's JSON object form (raises PlanError without an index)."""
    if isinstance(obj, Directive):
        return obj
    if not isinstance(obj, Mapping):
        raise PlanError(f"a directive must be a JSON object with an 'op', got {type(obj).__name__}")
    op = obj.get("op")
    if op == "schedule":
        name = obj.get("name")
        if not isinstance(name, str):
            raise PlanError("schedule: give the builder's name, e.g. {\"op\": \"schedule\", "
                            "\"name\": \"1f1b\", \"ranks\": 4, \"microbatches\": 8}")
        return Schedule(name, {k: v for k, v in obj.items() if k not in ("op", "name")})
    if op not in _FIELDS:
        known = ", ".join(sorted([*_FIELDS, "schedule"]))
        raise PlanError(f"unknown op {op!r}; the ops are {known}")
    extra = set(obj) - _FIELDS[op]
    if extra:
        raise PlanError(f"{op}: unknown field(s) {', '.join(sorted(extra))}; "
                        f"allowed: {', '.join(sorted(_FIELDS[op] - {'op'}))}")

    def need(key: str) -> Any:
        if key not in obj:
            raise PlanError(f"{op}: missing field {key!r}")
        return obj[key]

    if op == "place":
        return Place(need("filter"), need("devices"), obj.get("stream"))
    if op == "shard":
        return Shard(need("filter"), need("devices"), obj.get("stream"))
    if op == "split":
        return Split(obj.get("filter", {}), obj.get("dim_name", "MB"), need("num_microbatches"))
    if op == "order":
        return Order(need("filters"))
    zero = obj.get("zero")
    if zero is None:
        zero = 3 if obj.get("shard_params") else 2 if obj.get("shard_grads") else 0
    elif obj.get("shard_params") and zero != 3 or obj.get("shard_grads") and zero < 2:
        raise PlanError(f"replicate: zero={zero!r} contradicts shard_grads/shard_params; give one")
    return Replicate(need("filter"), need("devices"), zero, obj.get("bucket_size"),
                     obj.get("reduce_stream"), obj.get("gather_stream"), obj.get("reshard", True))


class Program:
    """An ordered list of directives; loads and writes Piper's JSON list format."""

    def __init__(self, directives: Iterable[Directive | Mapping[str, Any]] = ()):
        items = []
        for i, d in enumerate(directives):
            try:
                items.append(directive_from_json(d))
            except PlanError as err:
                raise err.at(i, d.get("op") if isinstance(d, Mapping) else None) from None
        self.directives: tuple[Directive, ...] = tuple(items)

    @classmethod
    def from_json(cls, text: str | bytes | list) -> Program:
        if isinstance(text, (str, bytes)):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as err:
                raise PlanError(f"the program is not valid JSON: {err}") from None
        if not isinstance(text, list):
            raise PlanError("a directive program is a JSON list of objects, each with an 'op'")
        return cls(text)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps([d.to_json() for d in self.directives], indent=indent)

    def __iter__(self):
        return iter(self.directives)

    def __len__(self) -> int:
        return len(self.directives)

    def __getitem__(self, i):
        return self.directives[i]

    def __add__(self, other: Iterable[Directive]) -> Program:
        return Program([*self.directives, *other])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Program) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return f"Program({len(self.directives)} directives)"
