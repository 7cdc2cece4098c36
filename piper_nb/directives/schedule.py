"""`schedule`: a named schedule builder, expanded into split/order (and place) directives.

Our JSON op `{"op": "schedule", "name": "1f1b", "ranks": 4, "microbatches": 8}`: the value
`Schedule` keeps the builder's name and arguments; the compiler expands it with
`schedules.build` (`compiler.compile.expand`). The builders' names, their aliases and the
`pn.schedules` function behind each live here once (`schedule_key` normalises a name), so
the registry, the Designer and its Python view agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from piper_nb.directives.base import Directive, py_literal
from piper_nb.errors import PlanError

__all__ = ["Schedule", "schedule_key", "FUNCTIONS", "ALIASES"]

# builder name -> its function in pn.schedules (None: reached through pn.schedules.build)
FUNCTIONS = {"gpipe": "gpipe", "1f1b": "one_f_one_b", "interleaved_1f1b": "interleaved_1f1b",
             "zb1p": "zero_bubble", "dualpipev": "dualpipev", "dualpipe": "dualpipe",
             "grid": None}
ALIASES = {"one_f_one_b": "1f1b", "interleaved": "interleaved_1f1b", "zero_bubble": "zb1p",
           "zbh1": "zb1p"}


def schedule_key(name: Any) -> Any:
    """The builder name `name` stands for: case, dashes and aliases normalised."""
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else name
    return ALIASES.get(key, key)


@dataclass(frozen=True)
class Schedule(Directive):
    """A named schedule builder with its arguments (`ranks`, `microbatches`, ...)."""

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    op = "schedule"
    json_open = True

    def to_json(self) -> dict:
        return {"op": "schedule", "name": self.name, **dict(self.args)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Schedule:
        name = obj.get("name")
        if not isinstance(name, str):
            raise PlanError("schedule: give the builder's name, e.g. {\"op\": \"schedule\", "
                            "\"name\": \"1f1b\", \"ranks\": 4, \"microbatches\": 8}")
        return cls(name, {k: v for k, v in obj.items() if k not in ("op", "name")})

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "schedule", "name": "1f1b", "ranks": stages, "microbatches": microbatches}

    def code(self) -> str:
        """`*pn.schedules.<builder>(...)`, starred: a builder returns a list of directives."""
        args = ", ".join(f"{k}={py_literal(v)}" for k, v in self.args.items())
        function = FUNCTIONS.get(schedule_key(self.name))
        if function:
            return f"*pn.schedules.{function}({args})"
        return f"*pn.schedules.build({py_literal(self.name)}{', ' + args if args else ''})"
