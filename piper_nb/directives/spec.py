"""The directive registry and Piper's JSON list format for programs (`pn.Program`).

Each directive is a frozen dataclass in its own module (value type, JSON fields, rewrite,
Designer row defaults and code generation together; see `base.py`); `REGISTRY` maps each
JSON `op` to its class. The `op` and field names in JSON are Piper's (`place`, `replicate`,
`shard`, `split`, `order`), plus our `schedule` op that names a builder, `recompute`,
`float8`, `compile_regions` and `tensor_parallel`. A directive defined above this floor
(`tensor_parallel`, in its own package) adds itself with `register`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from piper_nb.directives.base import Directive
from piper_nb.directives.compile_regions import CompileRegions, compile_regions
from piper_nb.directives.float8 import Float8, float8
from piper_nb.directives.order import Order, order
from piper_nb.directives.place import Place, place
from piper_nb.directives.recompute import Recompute, recompute
from piper_nb.directives.replicate import Replicate, replicate
from piper_nb.directives.schedule import Schedule
from piper_nb.directives.shard import Shard, shard
from piper_nb.directives.split import Split, split
from piper_nb.errors import PlanError

__all__ = ["Directive", "Place", "Replicate", "Shard", "Split", "Order", "Schedule", "Recompute",
           "Float8", "CompileRegions", "Program", "place", "replicate", "shard", "split",
           "order", "recompute", "float8", "compile_regions",
           "directive_from_json", "REGISTRY", "register"]

REGISTRY: dict[str, type[Directive]] = {cls.op: cls for cls in
                                        (Place, Replicate, Shard, Split, Order, Schedule,
                                         Recompute, Float8, CompileRegions)}


def register(cls: type[Directive]) -> type[Directive]:
    """Add a directive class to the registry under its `op` (JSON, the Designer's rows)."""
    old = REGISTRY.get(cls.op, cls)
    if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"two directives claim the op {cls.op!r}")
    REGISTRY[cls.op] = cls
    return cls


def directive_from_json(obj: Any) -> Directive:
    """One directive from Piper's JSON object form (raises PlanError without an index)."""
    if isinstance(obj, Directive):
        return obj
    if not isinstance(obj, Mapping):
        raise PlanError(f"a directive must be a JSON object with an 'op', got {type(obj).__name__}")
    op = obj.get("op")
    cls = REGISTRY.get(op) if isinstance(op, str) else None
    if cls is None:
        raise PlanError(f"unknown op {op!r}; the ops are {', '.join(sorted(REGISTRY))}")
    extra = set(obj) - cls.json_keys()
    if extra and not cls.json_open:
        raise PlanError(f"{op}: unknown field(s) {', '.join(sorted(extra))}; "
                        f"allowed: {', '.join(sorted(cls.json_keys() - {'op'}))}")
    return cls.from_json(obj)


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

    def code(self) -> str:
        """`pn.Program([...])` with the public constructors: the code that makes this program."""
        return "pn.Program([\n" + "".join(f"    {d.code()},\n" for d in self.directives) + "])"

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

    def __str__(self) -> str:
        """The JSON list, one directive per line (an order's slots wrapped to lines of about
        100 characters): what `print(program)` shows; it reads back with `from_json`."""
        return "[" + ",\n ".join(_json_lines(d.to_json()) for d in self.directives) + "]"


def _json_lines(obj: dict, width: int = 100) -> str:
    """One directive's JSON; a long list of order slots continues on indented lines."""
    text = json.dumps(obj)
    if len(text) <= width or not isinstance(obj.get("filters"), list):
        return text
    head = json.dumps({k: v for k, v in obj.items() if k != "filters"})[:-1] + ', "filters": ['
    lines, line = [], head
    for i, slot in enumerate(obj["filters"]):
        item = json.dumps(slot) + ("," if i < len(obj["filters"]) - 1 else "]}")
        if len(line) + 1 + len(item) > width and line.strip():
            lines.append(line)
            line = "   " + item
        else:
            line = line + ("" if line.endswith("[") else " ") + item
    return "\n".join([*lines, line])
