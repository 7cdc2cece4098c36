"""Drawing: TrainingDAG -> graphviz, Trace -> plotly timeline with memory, Chrome trace.

Walk-then-draw throughout: a function collects what to show, a small one renders it.
"""

from piper_nb.viz.dag import dag_to_graphviz
from piper_nb.viz.timeline import timeline_figure, to_chrome_trace

__all__ = ["dag_to_graphviz", "timeline_figure", "to_chrome_trace"]
