"""The Designer's Search tab: `pn.search` over the Designer's model and batch, its frontier
and table, and a click that loads a candidate into the directive rows.

The inputs are the device count, the GPU, the cost model, the precision, how many
candidates to verify and the pins, written as `tp=2; schedule=1f1b,zb1p` (`parse_pins`;
a bad pin is a PlanError shown in the tab before anything runs). *Search* runs the search
over a copy of the model on a background thread, so the Designer stays responsive; the
progress bar follows it through `pn.search(progress=callable)`, and *Stop* makes that
callable ask the search to stop, which keeps the best so far. The result fills the
frontier (`planner.frontier`: a plotly FigureWidget whose points are clicked), a table
sortable by any column, either way, and a picker. A click on a point, or *Load* in the
picker, hands the candidate to the Designer (`load`), which replaces the stage cut and the
program in one edit, so the DAG, timeline, JSON and Python tabs follow as for any edit.
A widget is made once and filled in place; the figure is drawn when the tab is shown.
"""

from __future__ import annotations

import copy
import html
import threading
from collections.abc import Callable

import ipywidgets as W
import plotly.graph_objects as go

from piper_nb.errors import PlanError
from piper_nb.planner.frontier import figure, points
from piper_nb.planner.knobs import check_pins
from piper_nb.planner.result import COLUMNS, Candidate, SearchResult, Status, html_table
from piper_nb.ui.render import placeholder_figure
from piper_nb.ui.widgets import replace_figure

__all__ = ["SearchPanel", "parse_pins", "sort_rows"]

TABLE_COLUMNS = (*COLUMNS, "status")


def parse_pins(text: str) -> dict:
    """`"tp=2; schedule=1f1b,zb1p; sp=yes"` as `pn.search`'s `pin` mapping: knobs split by
    `;`, values by `,`; numbers are ints, yes/no/true/false booleans, the rest words.
    Checked as `pn.search` checks them (a PlanError names the bad one)."""
    out: dict = {}
    for part in (p.strip() for p in text.replace("\n", ";").split(";")):
        if not part:
            continue
        knob, eq, values = (x.strip() for x in part.partition("="))
        if not eq or not knob or not values:
            raise PlanError(f"Search tab: pin {part!r}: write knob=value (several values "
                            "comma-separated), pins separated by ';', e.g. tp=2; "
                            "schedule=1f1b,zb1p")
        out[knob.lower()] = [_value(v.strip()) for v in values.split(",") if v.strip()]
    check_pins(out)
    return out


def _value(text: str):
    words = {"yes": True, "true": True, "no": False, "false": False}
    if text.lower() in words:
        return words[text.lower()]
    return int(text) if text.isdigit() else text.lower()


def sort_rows(rows: list[dict], column: str, descending: bool = False) -> list[dict]:
    """`rows` by `column` (numbers as numbers, words as words), those without a value last."""
    have = [r for r in rows if r.get(column) is not None]
    rest = [r for r in rows if r.get(column) is None]
    key = (lambda r: r[column]) if all(isinstance(r[column], (int, float)) for r in have) \
        else (lambda r: str(r[column]))
    return sorted(have, key=key, reverse=descending) + rest


def _box(children, cls: str = "pn-row-line") -> W.HBox:
    box = W.HBox(children, layout=W.Layout(flex_flow="row nowrap", align_items="center",
                                           width="100%"))
    box.add_class(cls)
    return box


class SearchPanel:
    """`widget`: the inputs, progress, frontier, table and picker. `state_of()` gives the
    Designer's state (model, batch, loss); `load(candidate)` loads one; `visible()` says
    whether the tab is shown (the figure waits for it)."""

    def __init__(self, state_of: Callable, load: Callable[[Candidate], None],
                 visible: Callable[[], bool] = lambda: True, devices: int = 4):
        from piper_nb.sim import HARDWARE
        self._state_of, self._load, self._visible = state_of, load, visible
        style = {"description_width": "initial"}
        self.devices = W.BoundedIntText(value=devices, min=1, max=1 << 20, description="devices",
                                        style=style, layout=W.Layout(width="150px"))
        self.hardware = W.Dropdown(options=sorted(HARDWARE), value="H100", description="GPU",
                                   style=style, layout=W.Layout(width="170px"))
        self.cost = W.Dropdown(options=[("analytic", "analytic"), ("profiled", "profile")],
                               value="analytic", description="cost", style=style,
                               layout=W.Layout(width="160px"))
        self.precision = W.Dropdown(options=["bf16", "fp32"], value="bf16",
                                    description="precision", style=style,
                                    layout=W.Layout(width="160px"))
        self.top = W.BoundedIntText(value=5, min=1, max=50, description="verify", style=style,
                                    tooltip="candidates compiled, checked and simulated in full",
                                    layout=W.Layout(width="120px"))
        self.pins = W.Text(value="", placeholder="tp=2; schedule=1f1b,zb1p", description="pin",
                           style=style, layout=W.Layout(width="300px"))
        self.run_button = W.Button(description="Search", button_style="primary",
                                   icon="search", layout=W.Layout(width="110px"))
        self.stop_button = W.Button(description="Stop", disabled=True, icon="stop",
                                    layout=W.Layout(width="90px"))
        self.run_button.on_click(lambda _: self.search())
        self.stop_button.on_click(lambda _: self.stop())
        self.bar = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="220px"))
        self.status = W.HTML("<span class='pn-muted'>Search the plans of this model: "
                             "set the devices and pins, then Search.</span>")
        self.figure = go.FigureWidget(placeholder_figure("no search yet"))
        self.sort = W.Dropdown(options=list(TABLE_COLUMNS), value="step s",
                               description="sort by", style=style,
                               layout=W.Layout(width="200px"))
        self.descending = W.Checkbox(value=False, description="descending", indent=False,
                                     layout=W.Layout(width="120px"))
        self.sort.observe(lambda _: self._show_table(), names=["value"])
        self.descending.observe(lambda _: self._show_table(), names=["value"])
        self.table = W.HTML(layout=W.Layout(max_height="320px", overflow="auto", width="100%"))
        self.table.add_class("pn-search-table")
        self.pick = W.Dropdown(options=[], description="candidate", style=style,
                               layout=W.Layout(width="420px"))
        self.load_button = W.Button(description="Load", icon="upload",
                                    tooltip="load this candidate into the directive rows",
                                    layout=W.Layout(width="90px"))
        self.load_button.on_click(lambda _: self.load(self.pick.value))
        self.widget = W.VBox([
            _box([self.devices, self.hardware, self.cost, self.precision, self.top]),
            _box([self.pins, self.run_button, self.stop_button, self.bar]),
            self.status, self.figure,
            _box([self.sort, self.descending, self.pick, self.load_button]), self.table])
        self.widget.add_class("pn-search")
        self.result: SearchResult | None = None
        self.drawn: list[Candidate] = []     # the figure's points, by customdata
        self.thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stale = False

    # ---- running ----------------------------------------------------------------------
    def search(self, wait: bool = False) -> None:
        """Start a search with the tab's inputs (on a thread; `wait=True`: here, now)."""
        if self.thread is not None and self.thread.is_alive():
            return
        try:
            pins = parse_pins(self.pins.value)
        except PlanError as err:
            self._say(str(err), bad=True)
            return
        self._stopping.clear()
        self.run_button.disabled, self.stop_button.disabled = True, False
        self._say(f"searching {self.devices.value} x {self.hardware.value} ...")
        if wait:
            self._run(pins)
        else:
            self.thread = threading.Thread(target=self._run, args=(pins,), daemon=True,
                                           name="pn-search")
            self.thread.start()

    def stop(self) -> None:
        """Ask the running search to stop; it returns the best so far."""
        self._stopping.set()
        self._say("stopping: keeping the best so far ...")

    def _progress(self, phase: str, done: int, total: int) -> bool:
        self.bar.max, self.bar.value = max(total, 1), min(done, max(total, 1))
        self.bar.description = phase
        return self._stopping.is_set()

    def _run(self, pins: dict) -> None:
        from piper_nb.planner import search
        state = self._state_of()
        try:
            # a copy: the Designer's refreshes trace its model on the kernel's thread while
            # this one captures (fx patches Module.__call__ while it traces); the
            # candidates name modules by path, so they load into the Designer's own
            model = copy.deepcopy(state.model)
            result = search(model, state.batch, self.devices.value, self.hardware.value,
                            pin=pins, precision=self.precision.value, cost=self.cost.value,
                            top=self.top.value, loss_fn=state.loss_fn,
                            progress=self._progress)
        except PlanError as err:
            self._say(str(err), bad=True)
        except Exception as err:   # surfaced in the tab: a thread's traceback is lost
            self._say(f"the search failed: {type(err).__name__}: {err}", bad=True)
        else:
            self.bar.value, self.bar.description = self.bar.max, "done"
            self.show(result)
        finally:
            self.run_button.disabled, self.stop_button.disabled = False, True

    def _say(self, text: str, bad: bool = False) -> None:
        cls = "pn-bad" if bad else "pn-muted"
        self.status.value = f"<span class='{cls}'>{html.escape(text)}</span>"

    # ---- showing ----------------------------------------------------------------------
    def show(self, result: SearchResult) -> None:
        """Fill the figure, table and picker from `result`."""
        self.result = result
        self.drawn = points(result)
        summary = html.escape(result.summary()).replace("\n", "<br>")
        cls = "pn-muted" if result.fits else "pn-bad"
        self.status.value = f"<span class='{cls}'>{summary}</span>"
        loadable = [c for c in result.ranked + result.estimated if c.program is not None]
        self.pick.options = [(f"{c.status}: {c.knobs.label()}", c) for c in loadable]
        self.pick.value = loadable[0] if loadable else None
        self._show_table()
        self._stale = True
        self.draw()

    def draw(self) -> None:
        """Draw the frontier if it is stale and the tab is shown (plotly sizes a figure
        drawn into a hidden tab wrong)."""
        if not self._stale or self.result is None or not self._visible():
            return
        self._stale = False
        replace_figure(self.figure, figure(self.result))
        for trace in self.figure.data:
            if trace.customdata is not None:
                trace.on_click(self._clicked)

    def _show_table(self) -> None:
        if self.result is None:
            return
        cands = self.result.ranked + self.result.estimated
        rows = sort_rows([c.row(self.result.batch) for c in cands], self.sort.value,
                         self.descending.value)
        self.table.value = html_table(rows, TABLE_COLUMNS)

    # ---- loading ----------------------------------------------------------------------
    def _clicked(self, trace, pts, _selector=None) -> None:
        if not pts.point_inds:
            return
        self.click(int(trace.customdata[pts.point_inds[0]]))

    def click(self, index: int) -> None:
        """What a click on the figure's point `index` (its customdata) does."""
        self.load(self.drawn[index])

    def load(self, candidate: Candidate | None) -> None:
        """Load `candidate` into the Designer (refused ones say why instead)."""
        if candidate is None:
            return
        if candidate.status is Status.REFUSED or candidate.program is None:
            self._say(f"{candidate.knobs.label()} was refused: {candidate.reason}", bad=True)
            return
        self._load(candidate)
        self._say(f"loaded {candidate.knobs.label()} ({candidate.status}) into the directives")
