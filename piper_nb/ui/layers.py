"""The Designer's Layers panel: the module tree with a tag editor per module.

Each module is a row: a fold toggle, its name, class and parameter count (and how the
model's own tensor-parallel plan shards it: `· TP colwise`), boxes for its
own PP and EP indices and for other tags (`TP=1, X=2`), and the tags it ends up with
(inherited ones included). Children rows are built when their parent is first unfolded,
so big models stay cheap. A toolbar cuts the model into N even stages by parameters or
FLOPs (`pn.cut_stages`). Every change goes through `on_edit(fn)` with a pure edit from
`ui/state.py`; `sync(state)` writes a new state back into the boxes in place.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as W
from torch import nn

from piper_nb.capture.annotate import pipeline_units
from piper_nb.tp import model_tp_plan, style_of
from piper_nb.ui.fields import parse_index, parse_tag_parts, tags_text
from piper_nb.ui.state import DesignerState, cut, effective_tags, set_tags
from piper_nb.ui.widgets import set_class

__all__ = ["LayersPanel", "LayerRow"]

_BOX = W.Layout(width="44px")
_NAME, _OTHER, _EFFECTIVE = "210px", "100px", "130px"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _unfolded(model: nn.Module) -> list[str]:
    """Rows shown unfolded at first: the ancestors of the pipeline units (`blocks` of
    `blocks.0`; `model` and `model.layers` of a Hugging Face `model.layers.0`), parents first."""
    out: list[str] = []
    for unit in pipeline_units(model):
        parts = unit.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            if path not in out:
                out.append(path)
    return out


class LayerRow:
    """One module's row; `children` holds its sub-rows once unfolded."""

    def __init__(self, panel: LayersPanel, path: str, depth: int, has_children: bool):
        self.panel, self.path = panel, path
        mod = panel.model.get_submodule(path)
        params = sum(p.numel() for p in mod.parameters())
        name = path.rsplit(".", 1)[-1]
        style = panel.tp_style(path)   # how the model's own tensor-parallel plan shards it
        badge = f" · TP {style}" if style else ""
        note = f"; pn.tensor_parallel shards it {style} (the model's own plan)" if style else ""
        self.toggle = W.Button(description="▸" if has_children else "",
                               disabled=not has_children, layout=W.Layout(width="30px", padding="0px"))
        self.name = W.HTML(
            f"<div style='margin-left:{depth * 12}px; white-space:nowrap; overflow:hidden; "
            f"text-overflow:ellipsis' title='{html.escape(path)}: {type(mod).__name__}, "
            f"{params:,} parameters{note}'><b>{html.escape(name)}</b> "
            f"<span class='pn-muted'>{type(mod).__name__} {_count(params)}"
            f"{badge}</span></div>", layout=W.Layout(width=_NAME))
        self.pp = W.Text(placeholder="PP", layout=_BOX, continuous_update=False)
        self.ep = W.Text(placeholder="EP", layout=_BOX, continuous_update=False)
        self.other = W.Text(placeholder="tag=index", layout=W.Layout(width=_OTHER),
                            continuous_update=False)
        self.effective = W.HTML(layout=W.Layout(width=_EFFECTIVE))
        for w in (self.toggle, self.name, self.pp, self.ep, self.other, self.effective):
            w.layout.flex = "0 0 auto"   # fixed columns, under the header's
        self.row = W.HBox([self.toggle, self.name, self.pp, self.ep, self.other, self.effective],
                          layout=W.Layout(flex_flow="row nowrap", align_items="center"))
        self.row.add_class("pn-layer")
        self.children_box = W.VBox(layout=W.Layout(display="none"))
        self.box = W.VBox([self.row, self.children_box])
        self.built = False
        self.toggle.on_click(lambda _: panel.fold(self))
        for w in (self.pp, self.ep, self.other):
            w.observe(self._changed, names=["value"])

    def tags(self) -> dict:
        tags = parse_tag_parts(self.other.value)
        for key, box in (("PP", self.pp), ("EP", self.ep)):
            tags.pop(key, None)
            value = parse_index(box.value)
            if value is not None:
                tags[key] = value
        return tags

    def _changed(self, change) -> None:
        if not self.panel.syncing:
            self.panel.on_edit(lambda s: set_tags(s, self.path, self.tags()))

    def sync(self, state: DesignerState) -> None:
        own = state.annotations.get(self.path, {})
        own = own if isinstance(own, dict) else {}
        self.pp.value = "" if own.get("PP") is None else str(own["PP"])
        self.ep.value = "" if own.get("EP") is None else str(own["EP"])
        self.other.value = tags_text(own, skip=("PP", "EP"))
        eff = effective_tags(state, self.path)
        text = (f"<code>{html.escape(tags_text(eff))}</code>" if eff
                else "<span class='pn-muted'>no tags</span>")
        self.effective.value = f"<div style='white-space: nowrap'>{text}</div>"


class LayersPanel:
    """The module tree plus the cut toolbar; `widget` is what the Designer shows."""

    def __init__(self, state: DesignerState, on_edit: Callable):
        self.model, self.on_edit, self.syncing = state.model, on_edit, False
        self.state = state
        self.kids: dict[str, list[str]] = {}
        for path in state.paths:
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            self.kids.setdefault(parent, []).append(path)
        self.rows: dict[str, LayerRow] = {}
        self.tp_plan = model_tp_plan(self.model)   # what pn.tensor_parallel shards how
        most = max(len(self.kids.get("", [])) * 8, len(pipeline_units(self.model)), 2)
        self.cut_n = W.BoundedIntText(value=2, min=1, max=most,
                                      description="stages", layout=W.Layout(width="140px"))
        self.cut_by = W.Dropdown(options=[("by parameters", "params"), ("by FLOPs", "flops")],
                                 value="params", layout=W.Layout(width="140px"))
        self.cut_button = W.Button(description="Cut evenly", button_style="primary",
                                   tooltip="tag PP on the pipeline units (pn.cut_stages)")
        self.cut_button.on_click(lambda _: self.cut())
        self.message = W.HTML()
        header = W.HBox([W.HTML(f"<span class='pn-muted'>{text}</span>",
                                layout=W.Layout(width=w, flex="0 0 auto"))
                         for text, w in (("", "30px"), ("module", _NAME), ("PP", _BOX.width),
                                         ("EP", _BOX.width), ("other tags", _OTHER),
                                         ("effective tags", _EFFECTIVE))],
                        layout=W.Layout(flex_flow="row nowrap"))
        header.add_class("pn-layer")
        self.tree = W.VBox(self._build(""))
        self.widget = W.VBox([W.HBox([self.cut_n, self.cut_by, self.cut_button]), self.message,
                              header, self.tree])
        for path in _unfolded(self.model):          # unfold down to the pipeline's blocks
            self.fold(self.rows[path])
        self.sync(state)

    def _build(self, parent: str) -> list[W.Widget]:
        depth = parent.count(".") + 1 if parent else 0
        boxes, was = [], self.syncing
        self.syncing = True
        try:
            for path in self.kids.get(parent, []):
                row = LayerRow(self, path, depth, bool(self.kids.get(path)))
                self.rows[path] = row
                row.sync(self.state)
                boxes.append(row.box)
        finally:
            self.syncing = was
        return boxes

    def tp_style(self, path: str) -> str:
        """How the model's own tensor-parallel plan shards module `path` ("" if not)."""
        sharding = style_of(self.tp_plan, path) if self.tp_plan else None
        return str(sharding.style) if sharding is not None else ""

    def fold(self, row: LayerRow) -> None:
        """Unfold (building the children the first time) or fold `row`."""
        if not row.built:
            row.children_box.children = self._build(row.path)
            row.built = True
        shown = row.children_box.layout.display != "none"
        row.children_box.layout.display = "none" if shown else "flex"
        row.toggle.description = "▸" if shown else "▾"

    def cut(self) -> None:
        n, by = self.cut_n.value, self.cut_by.value
        self.on_edit(lambda s: cut(s, n, by))

    def sync(self, state: DesignerState) -> None:
        self.state, self.syncing = state, True
        try:
            for row in self.rows.values():
                row.sync(state)
        finally:
            self.syncing = False

    def show_problems(self, problems) -> None:
        bad = {p.layer: p.message for p in problems if p.layer is not None}
        for path, row in self.rows.items():
            set_class(row.row, "pn-layer-error", path in bad)
        self.message.value = "".join(
            f"<div class='pn-bad'>layer <b>{html.escape(p)}</b>: {html.escape(m)}</div>"
            for p, m in bad.items())
