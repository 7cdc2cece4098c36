"""`pn.Designer(model, batch)`: annotate layers and compose directives in a notebook while
the DAG, timeline, memory and plan redraw live; launch the plan and compare.

The Designer is wiring: it owns a `DesignerState` and passes every edit (a pure function
from `ui/state.py`) through `edit`, which swaps the state, writes it back into the panels
in place and asks for a refresh. Refreshes are debounced (150 ms by default, on the
kernel's asyncio loop when there is one, else a timer thread) so a burst of keystrokes
compiles once; `refresh()` runs one synchronously and records `last_refresh_seconds`.
"""

from __future__ import annotations

import asyncio
import html
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ipywidgets as W

from piper_nb.capture.batch import Batch
from piper_nb.errors import PlanError
from piper_nb.ui.compute import Outcome, evaluate
from piper_nb.ui.directives import DirectivesPanel
from piper_nb.ui.launch import LaunchPanel
from piper_nb.ui.layers import LayersPanel
from piper_nb.ui.search_panel import SearchPanel
from piper_nb.ui.state import DesignerState, load_plan, schedule_row, set_microbatches
from piper_nb.ui.views import ViewsPanel

__all__ = ["Designer", "default_design", "EDITOR_TABS"]

EDITOR_TABS = ("Layers", "Directives", "JSON", "Python", "Search")
PANE = 820   # px the widest rows of a pane take (the Search tab's controls, the DAG's bar)


def default_design(model, batch_size: int | None = None, stages: int = 2,
                   microbatches: int = 4) -> tuple[dict, list[dict]]:
    """Annotations cutting `model` into `stages` by parameters, each stage placed on its own
    device, and a 1F1B schedule (a plain microbatch split when there is one stage)."""
    from piper_nb.capture.annotate import cut_stages, pipeline_units
    if batch_size:
        microbatches = next(m for m in (microbatches, 4, 2, 1) if batch_size % m == 0)
    stages = max(1, min(stages, len(pipeline_units(model))))
    if stages == 1:
        return {}, [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": microbatches}]
    rows = [{"op": "place", "filter": {"PP": s}, "devices": [s]} for s in range(stages)]
    return cut_stages(model, stages), [*rows, schedule_row("1f1b", stages, microbatches)]


class Designer:
    """The notebook app. Display it (last expression of a cell); `state`, `outcome`
    (`plan`, `trace`, `problems`), `refresh()` and `launch()` are the Python face.
    `loss_fn=(output, targets) -> loss` is the loss, as `pn.compile` takes it (None: the
    model's own); `optimizer=` what a launch trains with, as `pn.train` takes it (None: SGD
    at the Run tab's rate); `result` is the last launch's `pn.Result`; `arrange("below" |
    "beside")` puts the views below the editors (the default) or beside them."""

    def __init__(self, model, batch, cluster=None, *, program: Iterable | str | None = None,
                 annotations: Mapping[str, Mapping[str, int]] | None = None,
                 debounce: float | None = 0.15, cost: str = "uniform", lazy_views: bool = True,
                 loss_fn=None, optimizer=None):
        batch = Batch.of(batch, "pn.Designer")   # (inputs, targets) or a dict: named once
        ann, rows = default_design(model, batch.size)
        if annotations is not None:
            ann = {k: dict(v) for k, v in annotations.items()}
        if program is not None:
            from piper_nb.directives.spec import Program
            prog = Program.from_json(program) if isinstance(program, str) else Program(program)
            rows = [d.to_json() for d in prog]
        self.state = DesignerState(model=model, batch=batch, annotations=ann,
                                   rows=tuple(rows), cost=cost, loss_fn=loss_fn)
        self.cluster, self._own_cluster = cluster, None
        self.debounce = debounce
        self.outcome = Outcome()
        self.last_refresh_seconds: float | None = None
        self.refreshes = 0
        self._cache: dict = {}
        self._lock = threading.RLock()
        self._pending: Any = None
        self.layers = LayersPanel(self.state, self.edit)
        self.directives = DirectivesPanel(self.state, self.edit)
        if optimizer is not None:   # a bad one is a PlanError now, not at the first launch
            from piper_nb.optim import check_optimizer
            check_optimizer(optimizer, "pn.Designer")
        self.launcher = LaunchPanel(self._run_args, self._cluster_for, optimizer)
        self.views = ViewsPanel(self._option, self.launcher.widget, lazy=lazy_views)
        self.views.cost.value = cost
        self.message = W.HTML()
        self.search = SearchPanel(lambda: self.state, self.load, visible=lambda: (
            self.editors.selected_index == EDITOR_TABS.index("Search")))
        editors = W.Tab(children=[self.layers.widget, self.directives.widget,
                                  self.directives.json_widget, self.directives.python_widget,
                                  self.search.widget])
        editors.titles = EDITOR_TABS
        editors.observe(lambda _: self.search.draw(), names=["selected_index"])
        self.editors = editors
        self.left = W.VBox([editors, self.message])
        self.right = W.VBox([self.views.widget])
        # the views below the editors, each the full width (rows never wrap), or beside them
        self.arrangement = W.ToggleButtons(options=[("views below", "below"),
                                                    ("side by side", "beside")],
                                           value="below", tooltip="where the views sit")
        self.arrangement.add_class("pn-arrangement")
        self.arrangement.observe(lambda c: self.arrange(c["new"]), names=["value"])
        self.panes = W.Box([self.left, self.right])
        self.widget = W.VBox([self.arrangement, self.panes], layout=W.Layout(width="100%"))
        self.widget.add_class("pn-designer")
        self.arrange("below")
        self.refresh()

    def arrange(self, how: str) -> None:
        """"below": editors above the views, each the full width; "beside": side by side
        where both fit (each pane needs `PANE` px for its rows, so on a narrower screen
        the views wrap below the editors rather than clip them)."""
        below = how == "below"
        self.panes.layout = W.Layout(display="flex", width="100%",
                                     flex_flow="column" if below else "row wrap")
        self.left.layout = W.Layout(width="100%" if below else "auto", min_width="0px",
                                    overflow="auto", flex="none" if below else f"1 1 {PANE}px")
        self.right.layout = W.Layout(width="100%" if below else "auto", min_width="0px",
                                     flex="none" if below else f"1 1 {PANE}px")
        if self.arrangement.value != how:
            self.arrangement.value = how

    # ---- display ------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        plan = self.outcome.plan
        what = (f"{plan.world} devices x {plan.microbatches} microbatches" if plan is not None
                else f"{len(self.outcome.problems)} problems")
        return f"Designer({type(self.state.model).__name__}, {len(self.state.rows)} directives, {what})"

    # ---- editing ------------------------------------------------------------------------
    def edit(self, fn: Callable[[DesignerState], DesignerState]) -> None:
        """Apply a pure edit to the state, show it in the panels, schedule a refresh."""
        try:
            new = fn(self.state)
        except PlanError as err:
            self.message.value = f"<span class='pn-bad'>{html.escape(str(err))}</span>"
            return
        self.message.value = ""
        self.state = new
        self.layers.sync(new)
        self.directives.sync(new)
        self.request_refresh()

    def load(self, candidate) -> None:
        """Load a search's candidate (`pn.search`, the Search tab): its stage cut and
        program replace the annotations and directive rows in one edit."""
        self.edit(lambda s: load_plan(s, candidate.annotation, candidate.program))

    def _option(self, key: str, value: str) -> None:
        self.edit(lambda s: s.replace(**{key: value}))

    def set_microbatches(self, n: int) -> None:
        """Every schedule / MB split asks for `n` microbatches (like typing it in a row)."""
        self.edit(lambda s: set_microbatches(s, n))

    @property
    def microbatches(self) -> W.Widget | None:
        """The microbatch box of the first schedule or split row (what a user edits)."""
        return self.directives.microbatch_widget()

    # ---- refreshing ---------------------------------------------------------------------
    def request_refresh(self) -> None:
        """Refresh after `debounce` seconds of quiet (now, when `debounce` is None)."""
        if self.debounce is None:
            self.refresh()
            return
        with self._lock:
            self._cancel_pending()
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._pending = loop.call_later(self.debounce, self.refresh)
            else:
                self._pending = threading.Timer(self.debounce, self.refresh)
                self._pending.daemon = True
                self._pending.start()

    def _cancel_pending(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def refresh(self) -> Outcome:
        """Recompile, re-simulate and redraw every view now (in place)."""
        with self._lock:
            self._cancel_pending()
            t0 = time.perf_counter()
            state = self.state
            outcome = evaluate(state, self._cache)
            self.directives.show(outcome.problems, state)
            self.layers.show_problems(outcome.problems)
            self.views.show(outcome, state)
            self.outcome = outcome
            self.refreshes += 1
            self.last_refresh_seconds = time.perf_counter() - t0
            self.views.set_status(outcome, self.last_refresh_seconds)
            return outcome

    @property
    def plan(self):
        return self.outcome.plan

    @property
    def trace(self):
        return self.outcome.trace

    @property
    def problems(self):
        return list(self.outcome.problems)

    # ---- launching ----------------------------------------------------------------------
    @property
    def result(self):
        """The last launch's `pn.Result` (None before one finishes)."""
        return self.launcher.result

    def _run_args(self) -> tuple:
        if self._pending is not None:
            self.refresh()
        return (self.outcome.plan, self.outcome.trace, self.state.model, self.state.batch,
                self.state.loss_fn)

    def _cluster_for(self, world: int):
        if self.cluster is not None:
            return self.cluster
        if self._own_cluster is None or self._own_cluster.n < world:
            from piper_nb.cluster.local import LocalCluster
            if self._own_cluster is not None:
                self._own_cluster.close()
            self._own_cluster = LocalCluster(world)
        return self._own_cluster

    def launch(self, steps: int | None = None, wait: bool = False) -> None:
        """Run the current plan for `steps` (default: the Run tab's) steps; see the Run tab."""
        if steps is not None:
            self.launcher.steps.value = steps
        self.launcher.launch(wait=wait)

    def close(self) -> None:
        """Stop the Designer's own local cluster and pending refreshes."""
        self._cancel_pending()
        if self._own_cluster is not None:
            self._own_cluster.close()
            self._own_cluster = None
