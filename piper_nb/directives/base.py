"""What every directive shares: the `Directive` base, argument checks, and the code writer.

A directive is a frozen dataclass whose module (one per directive: `place.py`,
`replicate.py`, `shard.py`, `split.py`, `order.py`, `schedule.py`) holds its value type, its
JSON fields, its rewrite of the DAG, its Designer row defaults and the Python code that
makes it. `spec.py` registers them. Names follow one vocabulary: the Python field names are
the dataclass's; `json_names` maps the few that Piper spells differently in JSON
(`dim` <-> `dim_name`, `num` <-> `num_microbatches`, `groups` <-> `filters`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter

__all__ = ["Directive", "Context", "CaptureContext", "Directives", "each", "check_devices", "check_groups",
           "groups_of", "groups_code", "check_stream", "check_choice", "whole_regions",
           "py_literal", "call_code"]


@dataclass(frozen=True, slots=True)
class Context:
    """What a rewrite may read besides the DAG and its directives: the captured model (its
    regions, parameters and the values between regions), the values' shapes and dtypes
    (`ValueInfo` by name), the frozen parameters, the buffers each region's forward
    changes, and the inputs and outputs whose buffers autograd saves (`shapes.propagate`).
    The same for every pass of one compile."""

    capture: Any
    values: Mapping[str, Any]
    frozen: frozenset[str] = frozenset()
    changed: Mapping[int, tuple[str, ...]] = field(default_factory=dict)   # region -> buffers
    kept: Mapping[int, tuple] = field(default_factory=dict)   # region -> (inputs, outputs) saved


@dataclass(frozen=True, slots=True)
class CaptureContext:
    """What a capture pass may read besides the captured model and its directives: the
    named batch the compile is for, and whether the compile checks."""

    batch: Mapping[str, Any]
    check: bool = True


Directives = tuple[tuple[int, "Directive"], ...]   # (index in the user's program, directive)


def each(dag: TrainingDAG, directives: Directives,
         rewrite: Callable[[TrainingDAG, Any], TrainingDAG]) -> TrainingDAG:
    """`rewrite(dag, directive)` for each directive in turn, a PlanError it raises attributed
    to that directive's index and op."""
    for idx, d in directives:
        try:
            dag = rewrite(dag, d)
        except PlanError as err:
            raise err.at(idx, d.op) from None
    return dag


def check_devices(value: Any, where: str) -> tuple[int, ...]:
    """A non-empty tuple of distinct non-negative device ids (an int is one device)."""
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


def check_groups(value: Any, where: str) -> tuple:
    """One device group (`[0, 1]`: a tuple of ids) or several (`[[0, 1], [4, 5]]`: a tuple
    of tuples), checked: each a device list, all of one size, no device in two."""
    nested = isinstance(value, (list, tuple)) and value and all(
        isinstance(g, (list, tuple)) for g in value)
    groups = [check_devices(g, where) for g in (value if nested else [value])]
    if len({len(g) for g in groups}) > 1:
        raise PlanError(f"{where}: groups {[list(g) for g in groups]} differ in size; "
                        "give every group the same number of devices")
    seen = [d for g in groups for d in g]
    if len(set(seen)) != len(seen):
        raise PlanError(f"{where}: a device is in two groups of {[list(g) for g in groups]}")
    return tuple(groups) if nested else groups[0]


def groups_of(devices: tuple) -> tuple[tuple[int, ...], ...]:
    """The groups `check_groups` gave: several as they are, one as a group of one."""
    return devices if devices and isinstance(devices[0], tuple) else (devices,)


def groups_code(devices: tuple) -> list:
    """Devices as a program writes them: `[0, 1]`, or `[[0, 1], [4, 5]]`."""
    return [list(g) for g in devices] if devices and isinstance(devices[0], tuple) \
        else list(devices)


def check_stream(value: Any, where: str) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise PlanError(f"{where}: stream must be a non-empty name or null, got {value!r}")


def check_choice(op: str, name: str, value: Any, choices: tuple) -> None:
    """PlanError unless `value` (argument `name` of directive `op`) is one of `choices`."""
    if value not in choices:
        raise PlanError(f"{op}: {name} is one of {', '.join(map(str, choices))}, got "
                        f"{value!r}")


def whole_regions(filt: Mapping[str, Any], op: str, why: str) -> dict:
    """The filter of a directive that changes whole regions (`why`: what it does to them,
    for every pass and microbatch): naming `PASS` or `MB` is a PlanError."""
    filt = as_filter(filt, where=f"{op} filter")
    for key in ("PASS", "MB"):
        if key in filt:
            raise PlanError(f"{op} filter {filt} names {key}; {why}, for every pass and "
                            f"microbatch: drop {key} from the filter")
    return filt


def py_literal(value: Any) -> str:
    """Python literal of JSON-ish data (mappings keep their order; tuples become lists)."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)                       # escapes quotes, newlines, ...
    return repr(value)


def call_code(name: str, fn: Callable, values: Mapping[str, Any], positional: int = 1) -> str:
    """`name(...)` calling `fn` with `values`: the first `positional` parameters by position,
    the rest by keyword where they differ from `fn`'s defaults."""
    args = []
    for i, (key, param) in enumerate(inspect.signature(fn).parameters.items()):
        value = values[key]
        if i < positional:
            args.append(py_literal(value))
        elif param.default is inspect.Parameter.empty or value != param.default:
            args.append(f"{key}={py_literal(value)}")
    return f"{name}({', '.join(args)})"


@dataclass(frozen=True)
class Directive:
    """One scheduling directive. Subclasses set `op` and implement the hooks below."""

    op: ClassVar[str] = "directive"
    json_names: ClassVar[Mapping[str, str]] = {}      # Python field -> Piper's JSON key
    json_extra: ClassVar[frozenset[str]] = frozenset()  # JSON keys read besides the fields
    json_open: ClassVar[bool] = False                  # any other key is an argument
    json_skip: ClassVar[frozenset[str]] = frozenset()  # fields never written nor read

    # ---- JSON -------------------------------------------------------------------------
    @classmethod
    def json_keys(cls) -> frozenset[str]:
        """Every key a JSON object of this op may carry (`op` included)."""
        return frozenset({"op", *(cls.json_names.get(f.name, f.name) for f in fields(cls)
                                  if f.name not in cls.json_skip), *cls.json_extra})

    def to_json(self) -> dict:
        """Piper's JSON object: every field under its JSON name, mappings as dicts; a field
        that is None (unset, e.g. `stream`) is left out, and reads back as its default."""
        out = {"op": self.op}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name not in self.json_skip:
                out[self.json_names.get(f.name, f.name)] = _plain(value)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Directive:
        """The value of a JSON object already checked for unknown keys."""
        kwargs = {}
        for f in fields(cls):
            key = cls.json_names.get(f.name, f.name)
            if f.name in cls.json_skip:
                continue
            if key in obj:
                kwargs[f.name] = obj[key]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise PlanError(f"{cls.op}: missing field {key!r}")
        return cls(**kwargs)

    # ---- the Designer and its Python view ---------------------------------------------
    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        """A sensible fresh Designer row (JSON) for a model of `stages` PP stages."""
        raise NotImplementedError

    def code(self) -> str:
        """The public constructor call that makes this directive (`pn.<op>(...)`)."""
        raise NotImplementedError


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
