"""The Designer's Python view: the code that builds the same spec, program and plan.

`python_code(state)` writes `pn.annotate(...)`, `pn.Program([...])` with the public
directive constructors (schedule rows become `*pn.schedules.<builder>(...)`), then
compile and simulate, so a design can be pasted into a cell and run without the UI. A
row that does not parse is written as a comment carrying its problem, never dropped
silently.
"""

from __future__ import annotations

from piper_nb.directives.base import py_literal as _py
from piper_nb.directives.spec import directive_from_json
from piper_nb.errors import PlanError
from piper_nb.ui.state import DesignerState

__all__ = ["python_code"]


def _program_lines(state: DesignerState) -> list[str]:
    lines = []
    for i, row in enumerate(state.rows):
        try:
            lines.append(f"    {directive_from_json(row).code()},")
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
           *(["# loss_fn: the loss given to pn.Designer(..., loss_fn=)"]
             if state.loss_fn is not None else []),
           f"plan = pn.compile(spec, program, {batch}"
           + (", loss_fn=loss_fn)" if state.loss_fn is not None else ")"),
           f"trace = pn.simulate(plan, {COST_CODE.get(state.cost, COST_CODE['uniform'])})",
           "trace.figure()"]
    return "\n".join(out) + "\n"
