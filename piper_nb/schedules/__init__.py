"""Schedule builders: per-rank grids and the `split` + `order` directives that say them.

One technique per module: GPipe (`gpipe`), 1F1B (`one_f_one_b`), Megatron's interleaved
1F1B (`interleaved`), ZB1P / ZB-H1 (`zero_bubble`), DeepSeek's DualPipe and DualPipeV
(`dualpipe`), hand-written grids (`grid`) and PyTorch pipelining's schedule CSV
(`torch_csv`). Each `*_grid` returns a `Grid` in PyTorch pipelining's `0F1` text form
(`grid_text` prints one); the directive builders return Piper's directives. `build` is the
registry behind the JSON `{"op": "schedule", "name": ...}` directive.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from piper_nb.directives.schedule import ALIASES, FUNCTIONS, schedule_key
from piper_nb.directives.spec import Directive, Program, Schedule
from piper_nb.errors import PlanError
from piper_nb.ir.action import grid_text
from piper_nb.schedules.dualpipe import dualpipe, dualpipe_grid, dualpipev, dualpipev_grid
from piper_nb.schedules.gpipe import gpipe, gpipe_grid
from piper_nb.schedules.grid import from_grid, grid_directives, place_directives, validate_grid
from piper_nb.schedules.interleaved import interleaved_1f1b, interleaved_1f1b_grid
from piper_nb.schedules.one_f_one_b import one_f_one_b, one_f_one_b_grid
from piper_nb.schedules.torch_csv import from_torch_csv, grid_to_torch_csv, parse_torch_csv
from piper_nb.schedules.zero_bubble import zero_bubble, zero_bubble_grid

__all__ = ["gpipe_grid", "one_f_one_b_grid", "interleaved_1f1b_grid", "zero_bubble_grid",
           "dualpipev_grid", "dualpipe_grid", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zero_bubble", "dualpipev", "dualpipe", "from_grid", "validate_grid",
           "grid_directives", "place_directives", "from_torch_csv", "parse_torch_csv", "expand",
           "grid_to_torch_csv", "grid_text", "build", "BUILDERS", "ALIASES"]


def _grid(text: str, microbatches: int | None = None, place: bool = False) -> list[Directive]:
    return from_grid(text, microbatches, place)


# builder name -> function; names, aliases and function names are `directives.schedule`'s
BUILDERS: dict[str, Callable[..., list[Directive]]] = {
    key: globals()[fn] if fn else _grid for key, fn in FUNCTIONS.items()}


def build(name: str, **kwargs) -> list[Directive]:
    """The directives of the builder called `name` (an alias works too) with `kwargs`."""
    key = schedule_key(name)
    if key not in BUILDERS:
        known = ", ".join([*BUILDERS, *ALIASES])
        raise PlanError(f"unknown schedule {name!r}; the schedules are {known}")
    fn = BUILDERS[key]
    params = inspect.signature(fn).parameters
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError:
        required = [p for p, v in params.items() if v.default is inspect.Parameter.empty]
        optional = [p for p, v in params.items() if v.default is not inspect.Parameter.empty]
        unknown = sorted(set(kwargs) - set(params))
        missing = [p for p in required if p not in kwargs]
        problem = (f"unknown argument(s) {', '.join(unknown)}" if unknown
                   else f"missing argument(s) {', '.join(missing)}")
        raise PlanError(f"schedule {name!r}: {problem}; it takes {', '.join(required)}"
                        + (f" and optionally {', '.join(optional)}" if optional else "")) from None
    return fn(**kwargs)


def expand(program) -> list[tuple[int, Directive]]:
    """(index in the user's program, directive) with schedule builders expanded in place:
    what the compile's passes are handed."""
    if not isinstance(program, Program):
        program = Program(program)
    out: list[tuple[int, Directive]] = []
    for i, d in enumerate(program):
        if isinstance(d, Schedule):
            try:
                out += [(i, x) for x in build(d.name, **dict(d.args))]
            except PlanError as err:
                raise err.at(i, "schedule") from None
        else:
            out.append((i, d))
    return out
