"""The Designer's Directives panel: the program as editable rows, a schedule picker,
Piper JSON import/export and the equivalent Python.

Rows are `ui/directive_row.py` widgets, rebuilt only when the list's shape changes (a row added,
removed, moved or imported); otherwise `sync(state)` writes values into the existing
widgets. The schedule picker inserts a `{"op": "schedule", ...}` row (its builder expands
at compile time; export can write the expansion out for Piper). Problems from a refresh
are shown on their rows (`show_problems`) and the Python view is regenerated.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as W

from piper_nb.errors import PlanError
from piper_nb.ui.codegen import python_code
from piper_nb.ui.directive_row import DirectiveRow
from piper_nb.ui.state import (
    OPS,
    SCHEDULES,
    DesignerState,
    add_row,
    import_json,
    new_row,
    program_json,
    schedule_row,
    stage_count,
)

__all__ = ["DirectivesPanel"]


class DirectivesPanel:
    """`widget` (the rows with their toolbars), `json_widget` and `python_widget`."""

    def __init__(self, state: DesignerState, on_edit: Callable):
        self.state, self.on_edit, self.syncing = state, on_edit, False
        self.rows: list[DirectiveRow] = []
        # add a directive
        self.op = W.Dropdown(options=[o for o in OPS if o != "schedule"], value="place",
                             layout=W.Layout(width="110px"))
        self.add = W.Button(description="Add directive", icon="plus")
        self.add.on_click(lambda _: self.on_edit(lambda s: add_row(s, new_row(self.op.value, s))))
        # schedule picker
        n = stage_count(state)
        self.schedule = W.Dropdown(options=list(SCHEDULES.items()), value="1f1b",
                                   layout=W.Layout(width="120px"))
        self.ranks = W.BoundedIntText(value=n, min=1, max=1024, description="ranks",
                                      layout=W.Layout(width="85px"),
                                      style={"description_width": "initial"})
        self.micro = W.BoundedIntText(value=4, min=1, max=4096, description="microbatches",
                                      layout=W.Layout(width="130px"),
                                      style={"description_width": "initial"})
        self.chunks = W.BoundedIntText(value=2, min=1, max=64, description="chunks",
                                       layout=W.Layout(width="90px"),
                                       style={"description_width": "initial"})
        self.place = W.Checkbox(value=False, description="place stages", indent=False,
                                layout=W.Layout(width="112px"))
        self.add_schedule = W.Button(description="Add schedule", icon="plus")
        self.add_schedule.on_click(lambda _: self._add_schedule())
        self.list = W.VBox()
        nowrap = W.Layout(flex_flow="row nowrap", align_items="center", overflow="auto hidden")
        label = W.Layout(width="115px", flex="0 0 auto")
        adds = W.VBox([
            W.HBox([W.HTML("<b>add a directive</b>", layout=label), self.op, self.add],
                   layout=nowrap),
            W.HBox([W.HTML("<b>add a schedule</b>", layout=label), self.schedule, self.ranks,
                    self.micro, self.chunks, self.place, self.add_schedule], layout=nowrap)])
        adds.add_class("pn-add")
        self.widget = W.VBox([adds, W.HTML("<b>program</b>"), self.list])
        # Piper JSON
        self.json = W.Textarea(rows=14, layout=W.Layout(width="100%"),
                               placeholder='[{"op": "place", "filter": {"PP": 0}, "devices": [0]}]')
        self.export_button = W.Button(description="Export", icon="download",
                                      tooltip="write the program into the box (it follows "
                                              "edits until you type into it)")
        self.import_button = W.Button(description="Import", icon="upload",
                                      tooltip="replace the program by the box's JSON")
        self.expand = W.Checkbox(value=False, description="expand schedules (for Piper)",
                                 indent=False)
        self.json_status = W.HTML()
        self._exported: str | None = None   # the box's text as last written by export()
        self.export_button.on_click(lambda _: self.export())
        self.import_button.on_click(lambda _: self.import_())
        self.json_widget = W.VBox([W.HBox([self.export_button, self.import_button, self.expand]),
                                   self.json_status, self.json])
        # Python
        self.python = W.Textarea(rows=16, layout=W.Layout(width="100%"))
        self.python.add_class("pn-python")
        self.python_widget = W.VBox([W.HTML("<span class='pn-muted'>Paste into a cell where "
                                            "<code>model</code> and <code>batch</code> are "
                                            "defined.</span>"), self.python])
        self.sync(state)
        self.export()

    # ---- rows -----------------------------------------------------------------------
    def _add_schedule(self) -> None:
        row = schedule_row(self.schedule.value, self.ranks.value, self.micro.value,
                           self.chunks.value, self.place.value)
        self.on_edit(lambda s: add_row(s, row))

    def sync(self, state: DesignerState) -> None:
        """Show `state`'s rows: in place when only values changed, rebuilt otherwise."""
        self.state, self.syncing = state, True
        try:
            if [r.op for r in self.rows] == [row.get("op") for row in state.rows]:
                for widget_row, row in zip(self.rows, state.rows, strict=True):
                    widget_row.sync(dict(row))
            else:
                self.rows = [DirectiveRow(self, i, dict(row)) for i, row in enumerate(state.rows)]
                self.list.children = [r.box for r in self.rows] or [
                    W.HTML("<p class='pn-muted'>No directives yet: add one or a schedule.</p>")]
        finally:
            self.syncing = False

    def show(self, problems, state: DesignerState) -> None:
        """Problems on their rows, and the Python view of `state`."""
        by_row: dict[int, list[str]] = {}
        for p in problems:
            if p.row is not None:
                by_row.setdefault(p.row, []).append(p.message)
        for r in self.rows:
            msgs = by_row.get(r.index)
            r.show_problem("; ".join(msgs) if msgs else None)
        self.python.value = python_code(state)
        if self.json.value == self._exported:   # live, until the user types into the box
            self.export()

    def microbatch_widget(self):
        """The first row's microbatch box (a schedule's or an MB split's), or None."""
        for r in self.rows:
            for key in ("microbatches", "num_microbatches"):
                if key in r.fields:
                    return r.widget(key)
        return None

    # ---- JSON -----------------------------------------------------------------------
    def export(self) -> None:
        """Write the program into the JSON box (it then follows every edit until typed in)."""
        try:
            self.json.value = self._exported = program_json(self.state, expand=self.expand.value)
            n = len(self.state.rows)
            self.json_status.value = f"<span class='pn-muted'>exported {n} directives</span>"
        except PlanError as err:
            self.json_status.value = (f"<span class='pn-bad'>cannot expand the schedules: "
                                      f"{html.escape(str(err))}</span>")

    def import_(self) -> None:
        text = self.json.value
        try:
            import_json(self.state, text)
        except PlanError as err:
            self.json_status.value = f"<span class='pn-bad'>not imported: {html.escape(str(err))}</span>"
            return
        self._exported = text   # imported: the box follows the program again
        self.on_edit(lambda s: import_json(s, text))
        self.json_status.value = (f"<span class='pn-good'>imported {len(self.state.rows)} "
                                  "directives</span>")
