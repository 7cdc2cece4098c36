"""The notebook UI: `Designer` (ipywidgets + one anywidget view), thin wiring over the
pure `DesignerState` edits and `compile_state` / `evaluate` in this package."""

from piper_nb.ui.compute import Outcome, Problem, compile_state, evaluate
from piper_nb.ui.designer import Designer
from piper_nb.ui.state import DesignerState

__all__ = ["Designer", "DesignerState", "compile_state", "evaluate", "Outcome", "Problem"]
