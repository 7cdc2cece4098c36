"""One editable directive row of the Designer: fields per op, up/down/remove, its problem.

A row's fields come from the table `FIELDS`: each `Field` names the JSON key it edits,
makes its widget, reads the widget value from a row and writes a value back as
`(fields to set, keys to drop)`. The table is the whole difference between a place, a
replicate (ZeRO level), a shard, a split, an order (slots, one per line), a recompute
(its filter), a schedule row (builder, ranks, microbatches, chunks, place stages) and a
tensor-parallel row (its filter, device groups `0, 1 | 2, 3` and sequence parallelism);
rows of an unknown op are edited as raw JSON. Writes go through the panel's `on_edit` with `state.update_row`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from piper_nb.directives.compile_regions import MODES
from piper_nb.directives.schedule import schedule_key
from piper_nb.ui.fields import (
    devices_text,
    filter_text,
    groups_text,
    parse_devices,
    parse_filter,
    parse_groups,
    parse_slots,
    slots_text,
)
from piper_nb.ui.state import SCHEDULES, move_row, remove_row, update_row
from piper_nb.ui.widgets import set_class

__all__ = ["Field", "FIELDS", "DirectiveRow"]

_SMALL = W.Layout(width="34px", padding="0px")
_NAMES = {v: k for k, v in SCHEDULES.items()}


@dataclass(frozen=True)
class Field:
    key: str
    make: Callable[[], W.Widget]
    read: Callable[[dict], Any]                                  # row -> widget value
    write: Callable[[Any, dict], tuple[dict, tuple[str, ...]]]   # value, row -> (set, drop)


def _text(label: str, placeholder: str, width: str) -> Callable[[], W.Widget]:
    """A text field labelled `label` (a filled field keeps saying what it is)."""
    return lambda: W.Text(description=label, placeholder=placeholder, continuous_update=False,
                          layout=W.Layout(width=width), style={"description_width": "initial"})


def _int(description: str, width: str = "120px", cls: str = "") -> Callable[[], W.Widget]:
    def make():
        w = W.IntText(description=description, layout=W.Layout(width=width),
                      style={"description_width": "initial"})
        if cls:
            w.add_class(cls)
        return w
    return make


def _zero(row: dict) -> int:
    z = row.get("zero")
    if isinstance(z, int) and z in (0, 1, 2, 3):
        return z
    return 3 if row.get("shard_params") else 2 if row.get("shard_grads") else 0


def _name_write(value: str, row: dict) -> tuple[dict, tuple[str, ...]]:
    if value == "interleaved_1f1b":
        return {"name": value, "chunks": row.get("chunks", 2)}, ()
    return {"name": value}, ("chunks",)


def _options(row: dict) -> list[tuple[str, str]]:
    opts = [(label, name) for label, name in SCHEDULES.items()]
    name = schedule_key(row.get("name"))
    if name not in _NAMES:
        opts.append((str(row.get("name")), name))
    return opts


FILTER = Field("filter", _text("filter", "e.g. PP=0", "165px"),
               lambda r: filter_text(r.get("filter", {})), lambda v, r: ({"filter": parse_filter(v)}, ()))
DEVICES = Field("devices", _text("devices", "0,1", "130px"), lambda r: devices_text(r.get("devices")),
                lambda v, r: ({"devices": parse_devices(v)}, ()))
STREAM = Field("stream", _text("stream", "default", "135px"), lambda r: r.get("stream") or "",
               lambda v, r: ({"stream": v.strip()}, ()) if v.strip() else ({}, ("stream",)))
ZERO = Field("zero", lambda: W.Dropdown(options=[(f"ZeRO-{z}", z) for z in range(4)],
                                        layout=W.Layout(width="90px")),
             _zero, lambda v, r: ({"zero": v}, ("shard_grads", "shard_params")))
DIM = Field("dim_name", _text("dim", "MB", "80px"), lambda r: str(r.get("dim_name", "MB")),
            lambda v, r: ({"dim_name": v.strip()}, ()))
NUM = Field("num_microbatches", _int("microbatches", "150px", "pn-microbatches"),
            lambda r: r.get("num_microbatches") if isinstance(r.get("num_microbatches"), int) else 1,
            lambda v, r: ({"num_microbatches": v}, ()))
SLOTS = Field("filters", lambda: W.Textarea(continuous_update=False, rows=4, description="slots",
                                            style={"description_width": "initial"},
                                            placeholder="one slot per line: PP=0,MB=0,PASS=F | ...",
                                            layout=W.Layout(width="345px")),
              lambda r: slots_text(r.get("filters")), lambda v, r: ({"filters": parse_slots(v)}, ()))
NAME = Field("name", lambda: W.Dropdown(options=list(SCHEDULES.items()), layout=W.Layout(width="120px")),
             lambda r: schedule_key(r.get("name")), _name_write)
RANKS = Field("ranks", _int("ranks", "85px"),
              lambda r: r.get("ranks") if isinstance(r.get("ranks"), int) else 1,
              lambda v, r: ({"ranks": v}, ()))
MICRO = Field("microbatches", _int("microbatches", "150px", "pn-microbatches"),
              lambda r: r.get("microbatches") if isinstance(r.get("microbatches"), int) else 1,
              lambda v, r: ({"microbatches": v}, ()))
CHUNKS = Field("chunks", _int("chunks", "90px"),
               lambda r: r.get("chunks") if isinstance(r.get("chunks"), int) else 2,
               lambda v, r: ({"chunks": v}, ()) if "chunks" in r else ({}, ()))
PLACE = Field("place", lambda: W.Checkbox(description="place stages", indent=False,
                                          layout=W.Layout(width="112px")),
              lambda r: bool(r.get("place")),
              lambda v, r: ({"place": True}, ()) if v else ({}, ("place",)))
GROUPS = Field("devices", _text("groups", "0,1 | 2,3", "160px"),
               lambda r: groups_text(r.get("devices")),
               lambda v, r: ({"devices": parse_groups(v)}, ()))
SEQUENCE = Field("sequence_parallel",
                 lambda: W.Checkbox(description="sequence parallel", indent=False,
                                    layout=W.Layout(width="140px")),
                 lambda r: bool(r.get("sequence_parallel")),
                 lambda v, r: ({"sequence_parallel": True}, ()) if v else
                 ({}, ("sequence_parallel",)))
MODE = Field("mode", lambda: W.Dropdown(options=[("full", "full"), ("selective", "selective")],
                                        tooltip="full: keep each region's inputs; selective: "
                                        "recompute only the attention cores",
                                        layout=W.Layout(width="100px")),
             lambda r: r.get("mode") if r.get("mode") in ("full", "selective") else "full",
             lambda v, r: ({"mode": v}, ()) if v == "selective" else ({}, ("mode",)))
BALANCE = Field("load_balance",
                lambda: W.Dropdown(options=[("zigzag", "zigzag"), ("contiguous", "contiguous")],
                                   tooltip="zigzag: device r holds chunks r and 2n-1-r "
                                   "(the causal mask's work evened out); contiguous: chunk r",
                                   layout=W.Layout(width="110px")),
                lambda r: r.get("load_balance") if r.get("load_balance") in (
                    "zigzag", "contiguous") else "zigzag",
                lambda v, r: ({"load_balance": v}, ()) if v == "contiguous" else
                ({}, ("load_balance",)))
ROTATE = Field("rotate",
               lambda: W.Dropdown(options=[("all-gather", "all_gather"), ("p2p ring", "p2p")],
                                  tooltip="all-gather: every member's keys and values "
                                  "gathered before attention; p2p ring: passed member to "
                                  "member, each exchange beside the block before",
                                  layout=W.Layout(width="110px")),
               lambda r: "p2p" if r.get("rotate") == "p2p" else "all_gather",
               lambda v, r: ({"rotate": v}, ()) if v == "p2p" else ({}, ("rotate",)))
COMPILE_MODE = Field("mode", lambda: W.Dropdown(
    options=[(m, m) for m in MODES], tooltip="torch.compile's mode",
    layout=W.Layout(width="150px")),
    lambda r: r.get("mode") if r.get("mode") in MODES else "default",
    lambda v, r: ({"mode": v}, ()) if v != "default" else ({}, ("mode",)))
BACKEND = Field("backend", lambda: W.Dropdown(
    options=[("inductor", "inductor"), ("aot_eager", "aot_eager")],
    tooltip="inductor: generated kernels; aot_eager: AOTAutograd's graphs run eagerly "
    "(quick to compile, for checking)", layout=W.Layout(width="100px")),
    lambda r: "aot_eager" if r.get("backend") == "aot_eager" else "inductor",
    lambda v, r: ({"backend": v}, ()) if v != "inductor" else ({}, ("backend",)))
RAW = Field("*", lambda: W.Textarea(continuous_update=False, rows=2, layout=W.Layout(width="300px")),
            lambda r: json.dumps(r), lambda v, r: _raw_write(v, r))


def _raw_write(value: str, row: dict) -> tuple[dict, tuple[str, ...]]:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError:
        return {}, ()
    return (obj, tuple(row)) if isinstance(obj, dict) else ({}, ())


FIELDS = {"place": (FILTER, DEVICES, STREAM), "shard": (FILTER, DEVICES, STREAM),
          "replicate": (FILTER, DEVICES, ZERO), "split": (FILTER, DIM, NUM), "order": (SLOTS,),
          "schedule": (NAME, RANKS, MICRO, CHUNKS, PLACE), "recompute": (FILTER, MODE),
          "float8": (FILTER,),
          "tensor_parallel": (FILTER, GROUPS, SEQUENCE),
          "context_parallel": (FILTER, GROUPS, BALANCE, ROTATE),
          "compile_regions": (FILTER, COMPILE_MODE, BACKEND)}


class DirectiveRow:
    """Widgets of directive row `index`; `panel` gives `on_edit`, `syncing` and `state`."""

    def __init__(self, panel, index: int, row: dict):
        self.panel, self.index = panel, index
        self.op = row.get("op")
        self.fields = {f.key: (f, f.make()) for f in FIELDS.get(self.op, (RAW,))}
        self.label = W.HTML(f"<b>#{index}</b> {html.escape(str(self.op))}",
                            layout=W.Layout(width="115px", flex="0 0 auto"))
        self.up = W.Button(description="↑", tooltip="move up", layout=_SMALL)
        self.down = W.Button(description="↓", tooltip="move down", layout=_SMALL)
        self.remove = W.Button(description="✕", tooltip="remove", layout=_SMALL)
        self.error = W.HTML()
        self.error.add_class("pn-row-message")
        fields = W.HBox([w for _, w in self.fields.values()],
                        layout=W.Layout(flex="0 0 auto", flex_flow="row nowrap",
                                        align_items="center"))
        buttons = W.HBox([self.up, self.down, self.remove],
                         layout=W.Layout(flex="0 0 auto", margin="0 0 0 8px"))
        # one line: label | fields | move and remove beside them; scrolls, never wraps
        line = W.HBox([self.label, fields, buttons],
                      layout=W.Layout(align_items="center", flex_flow="row nowrap",
                                      width="100%", overflow="auto hidden"))
        line.add_class("pn-row-line")
        self.box = W.VBox([line, self.error])
        self.box.add_class("pn-row")
        self.up.on_click(lambda _: panel.on_edit(lambda s: move_row(s, self.index, -1)))
        self.down.on_click(lambda _: panel.on_edit(lambda s: move_row(s, self.index, 1)))
        self.remove.on_click(lambda _: panel.on_edit(lambda s: remove_row(s, self.index)))
        for key, (_, w) in self.fields.items():
            w.observe(lambda change, key=key: self._changed(key, change["new"]), names=["value"])
        self.sync(row)

    def widget(self, key: str) -> W.Widget:
        return self.fields[key][1]

    def _changed(self, key: str, value: Any) -> None:
        if self.panel.syncing:
            return
        field = self.fields[key][0]
        i = self.index

        def edit(state):
            fields, drop = field.write(value, dict(state.rows[i]))
            return update_row(state, i, fields, drop)
        self.panel.on_edit(edit)

    def sync(self, row: dict) -> None:
        for key, (field, w) in self.fields.items():
            if key == "name" and tuple(w.options) != tuple(_options(row)):
                w.options = _options(row)
            w.value = field.read(row)
        if "chunks" in self.fields:
            self.widget("chunks").disabled = schedule_key(row.get("name")) != "interleaved_1f1b"

    def show_problem(self, message: str | None) -> None:
        set_class(self.box, "pn-row-error", message is not None)
        self.error.value = "" if message is None else f"&#9888; {html.escape(message)}"
