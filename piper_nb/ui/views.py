"""The Designer's views, in tabs: DAG, Timeline, Memory, Plan, Problems (and Run, from
`ui/launch.py`).

Every widget here is made once; `show(outcome, state)` copies a refresh's results into
them (the SVG and the details of the selected node, FigureWidget traces and layout, HTML
values, tab titles), so the page never re-creates a view and plotly keeps its zoom
controls. The drawn views (DAG, Timeline, Memory) are drawn when their tab is shown: a
refresh redraws the visible one and marks the others stale (`lazy=False` draws all), which
keeps an edit's redraw fast and never draws plotly into a hidden tab. The *group replicas*
box draws identical data-parallel replicas on one timeline row (or every device). The DAG view's
`selected` trait (set by a click in the browser, or by a test) drives the node details, and
its `details` trait (the *details* button, or selecting a node) opens or collapses their
panel, which otherwise leaves the DAG the full width.
"""

from __future__ import annotations

import ipywidgets as W
import plotly.graph_objects as go

from piper_nb.ui.compute import COST_MODELS, Outcome
from piper_nb.ui.dag_draw import DagGroups, dag_svg, node_details
from piper_nb.ui.render import (
    grid_html,
    memory_figure,
    placeholder_figure,
    problems_html,
    summary_html,
    timeline_figure,
)
from piper_nb.ui.widgets import DagView, replace_figure

__all__ = ["ViewsPanel", "TABS"]

TABS = ("DAG", "Timeline", "Memory", "Plan", "Problems", "Run")


class ViewsPanel:
    """`widget`: a status line, view options and the tabs; `show` fills them in place."""

    def __init__(self, on_option, run_widget: W.Widget | None = None, lazy: bool = True):
        self.lazy = lazy
        self.stale: set[str] = set()
        self._outcome, self._state = Outcome(), None
        self.status = W.HTML()
        self.collapse = W.Dropdown(options=[("auto", "auto"), ("none", "none"),
                                            ("microbatches", "MB")], value="auto",
                                   description="collapse", layout=W.Layout(width="190px"),
                                   style={"description_width": "initial"})
        self.cost = W.Dropdown(options=list(COST_MODELS.items()), value="uniform",
                               description="cost model", layout=W.Layout(width="290px"),
                               style={"description_width": "initial"})
        self.group = W.Checkbox(value=True, description="group replicas", indent=False,
                                layout=W.Layout(width="140px"))
        self.group.observe(self._regroup, names=["value"])
        self.collapse.observe(lambda c: on_option("collapse", c["new"]), names=["value"])
        self.cost.observe(lambda c: on_option("cost", c["new"]), names=["value"])
        # DAG
        self.dag = DagView(layout=W.Layout(width="100%"))
        self.details = W.HTML(layout=W.Layout(width="32%", overflow="auto", max_height="600px",
                                              display="none"))
        self.details.add_class("pn-details-panel")
        self.dag.observe(self._selected, names=["selected"])
        self.dag.observe(self._toggle_details, names=["details"])
        self._dag = None
        self._groups: DagGroups | None = None
        # Timeline, Memory, Plan, Problems
        self.timeline = go.FigureWidget(placeholder_figure("compiling ..."))
        self.timeline_info = W.HTML()
        self.memory = go.FigureWidget(placeholder_figure("compiling ..."))
        self.grid = W.HTML()
        self.problems = W.HTML()
        self.tabs = W.Tab(children=[
            W.HBox([self.dag, self.details]),
            W.VBox([self.timeline_info, self.timeline]),
            W.VBox([self.memory]),
            W.VBox([self.grid]),
            W.VBox([self.problems]),
            run_widget if run_widget is not None else W.HTML("no launcher")])
        self.tabs.titles = TABS
        self.tabs.observe(lambda _: self._draw_visible(), names=["selected_index"])
        self.widget = W.VBox([W.HBox([self.status]),
                              W.HBox([self.collapse, self.cost, self.group]), self.tabs])

    # ---- DAG --------------------------------------------------------------------------
    def _selected(self, change) -> None:
        self.draw("DAG")
        self.details.value = node_details(self._dag, change["new"], self._groups)
        if change["new"]:
            self.dag.details = True

    def _toggle_details(self, change) -> None:
        """The details panel takes a third of the width when open, none when closed."""
        self.dag.layout.width = "68%" if change["new"] else "100%"
        self.details.layout.display = "" if change["new"] else "none"

    def _show_dag(self, dag, collapse: str) -> None:
        self._dag = dag
        if dag is None:
            self._groups = None
            self.dag.message = "No DAG: the program does not compile (see Problems)."
            self.details.value = node_details(None, "")
            return
        try:
            svg, self._groups = dag_svg(dag, collapse)
        except Exception as err:   # no `dot` binary, or graphviz failed: say so in the view
            self.dag.message = f"Cannot draw the DAG ({type(err).__name__}: {err}); install graphviz."
            return
        self.dag.svg = svg
        self.dag.message = ""
        selected = self.dag.selected
        if selected and selected in dag:
            selected = self._groups.of.get(selected, selected)
            self.dag.selected = selected
        self.details.value = node_details(dag, selected, self._groups)

    # ---- everything -------------------------------------------------------------------
    def show(self, outcome: Outcome, state, refresh_seconds: float | None = None) -> None:
        self._outcome, self._state = outcome, state
        self.stale = {"DAG", "Timeline", "Memory"}
        self.grid.value = grid_html(outcome.plan)
        self.problems.value = problems_html(outcome.problems)
        n = len(outcome.problems)
        self.tabs.set_title(TABS.index("Problems"), f"Problems ({n})" if n else "Problems")
        self.set_status(outcome, refresh_seconds)
        if self.lazy:
            self._draw_visible()
        else:
            self.draw_all()

    def _draw_visible(self) -> None:
        self.draw(TABS[self.tabs.selected_index or 0])

    def draw_all(self) -> None:
        for name in sorted(self.stale):
            self.draw(name)

    def draw(self, name: str) -> None:
        """Draw view `name` from the last outcome if it is stale."""
        if name not in self.stale:
            return
        self.stale.discard(name)
        plan, trace = self._outcome.plan, self._outcome.trace
        if name == "DAG":
            self._show_dag(plan.dag if plan is not None else None, self._state.collapse)
        elif name == "Timeline":
            replace_figure(self.timeline, timeline_figure(trace, group=self.group.value))
            self.timeline_info.value = _bubbles(trace)
        elif name == "Memory":
            replace_figure(self.memory, memory_figure(trace))

    def _regroup(self, _change) -> None:
        """The *group replicas* box: identical replicas on one row, or every device."""
        self.stale.add("Timeline")
        self._draw_visible()

    def set_status(self, outcome: Outcome, refresh_seconds: float | None = None) -> None:
        self.status.value = summary_html(outcome, refresh_seconds)


def _bubbles(trace) -> str:
    if trace is None:
        return "<span class='pn-bad'>no timeline: see Problems</span>"
    per = ", ".join(f"dev{d} {trace.bubble_fraction(d):.0%}" for d in trace.devices)
    return (f"<span class='pn-muted'>cost model {trace.meta.get('cost_model', '?')}; bubble per "
            f"device: {per}</span>")
