"""The Designer's Python view: the code that builds the same spec, program and plan.

`python_code(state)` writes `pn.annotate(...)`, `pn.Program([...])` with the public
directive constructors (schedule rows become `*pn.schedules.<builder>(...)`), then
compile and simulate, so a design can be pasted into a cell and run without the UI. A
row that does not parse is written as a comment carrying its problem, never dropped
silently.
"""

from __future__ import annotations

from typing import Any

from piper_nb.directives.spec import (
    Order,
    Place,
    Replicate,
    Schedule,
    Shard,
    Split,
    directive_from_json,
)
from piper_nb.errors import PlanError
from piper_nb.ui.state import DesignerState

__all__ = ["python_code", "directive_code", "BUILDER_FUNCTIONS"]

# builder name -> function in pn.schedules
BUILDER_FUNCTIONS = {"gpipe": "gpipe", "1f1b": "one_f_one_b", "interleaved_1f1b": "interleaved_1f1b",
                     "zb1p": "zero_bubble", "dualpipev": "dualpipev", "dualpipe": "dualpipe"}
_ALIASES = {"one_f_one_b": "1f1b", "interleaved": "interleaved_1f1b", "zero_bubble": "zb1p",
            "zbh1": "zb1p"}


def _py(value: Any) -> str:
    """Python literal of JSON-ish data (dicts keep their order; tuples become lists)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _kwargs(**kw: Any) -> str:
    return "".join(f", {k}={_py(v)}" for k, v in kw.items() if v is not None)


def directive_code(d) -> str:
    """One directive as the constructor call that makes it (schedules starred)."""
    if isinstance(d, Place):
        return f"pn.place({_py(dict(d.filter))}, devices={_py(d.devices)}{_kwargs(stream=d.stream)})"
    if isinstance(d, Shard):
        return f"pn.shard({_py(dict(d.filter))}, devices={_py(d.devices)}{_kwargs(stream=d.stream)})"
    if isinstance(d, Replicate):
        extra = _kwargs(zero=d.zero or None, bucket_size=d.bucket_size,
                        reduce_stream=d.reduce_stream, gather_stream=d.gather_stream)
        return f"pn.replicate({_py(dict(d.filter))}, devices={_py(d.devices)}{extra})"
    if isinstance(d, Split):
        return f"pn.split({_py(dict(d.filter))}, dim={_py(d.dim)}, num={d.num})"
    if isinstance(d, Order):
        groups = [[dict(f) for f in g] for g in d.groups]
        return f"pn.order({_py(groups)})"
    if isinstance(d, Schedule):
        key = d.name.strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        args = ", ".join(f"{k}={_py(v)}" for k, v in d.args.items())
        if key in BUILDER_FUNCTIONS:
            return f"*pn.schedules.{BUILDER_FUNCTIONS[key]}({args})"
        return f"*pn.schedules.build({_py(d.name)}{', ' + args if args else ''})"
    raise TypeError(f"not a directive: {d!r}")


def _program_lines(state: DesignerState) -> list[str]:
    lines = []
    for i, row in enumerate(state.rows):
        try:
            lines.append(f"    {directive_code(directive_from_json(row))},")
        except PlanError as err:
            lines.append(f"    # directive #{i} does not parse ({err.reason}): {_py(dict(row))}")
    return lines


COST_CODE = {"uniform": "pn.CostModel.uniform(F=1, B=2, W=1)",
             "analytic": "pn.CostModel.analytic(plan)",
             "profiled": "pn.CostModel.profile(plan, comm=False)"}


def python_code(state: DesignerState, model: str = "model", batch: str = "batch") -> str:
    """Code for a notebook cell that rebuilds this design from `model` and `batch`."""
    ann = ["    " + f"{_py(p)}: {_py(dict(t)) if isinstance(t, dict) else _py(t)}," for p, t in
           state.annotations.items()]
    out = ["import piper_nb as pn", "",
           f"spec = pn.annotate({model}, {{", *ann, "})",
           "program = pn.Program([", *_program_lines(state), "])",
           f"plan = pn.compile(spec, program, {batch})",
           f"trace = pn.simulate(plan, {COST_CODE.get(state.cost, COST_CODE['uniform'])})",
           "trace.figure()"]
    return "\n".join(out) + "\n"
