"""The Designer's custom widget (`DagView`) and helpers that update widgets in place.

`DagView` is a thin anywidget: typed traitlets with `sync=True` and the front-end ES
module `widgets/dag_view.js` (with `widgets/dag_view.css`, which also styles the rest of
the Designer) loaded by path. The front end draws `svg` (opening at a scale where labels are legible,
panned by dragging and zoomed by the wheel), marks the `selected` node and posts a clicked
node's id back through `selected`, opening the details panel (`details`); Python only
sets and observes traits, so tests drive it by setting `selected` as a click would.

The assets live in `<repo>/widgets` in a checkout (and an editable install) and in
`piper_nb/widgets` inside an installed wheel (hatch force-includes the folder there);
`asset_dir` finds whichever exists.
"""

from __future__ import annotations

import pathlib

import anywidget
import traitlets

__all__ = ["asset_dir", "DagView", "replace_figure", "set_class"]

_PKG = pathlib.Path(__file__).resolve().parent.parent          # .../piper_nb


def asset_dir() -> pathlib.Path:
    """The folder holding `dag_view.js` and `dag_view.css` (installed or in the repo)."""
    for candidate in (_PKG / "widgets", _PKG.parent / "widgets"):
        if (candidate / "dag_view.js").is_file():
            return candidate
    raise FileNotFoundError(
        f"piper_nb's front-end files (dag_view.js) are in neither {_PKG / 'widgets'} nor "
        f"{_PKG.parent / 'widgets'}; reinstall piper_nb (pip install -e .) so the wheel ships them")


class DagView(anywidget.AnyWidget):
    """Clickable, pannable DAG picture: `svg` in, the clicked node's id out through
    `selected`; `zoom` and `details` are shared with the front end's buttons."""

    _esm = asset_dir() / "dag_view.js"
    _css = asset_dir() / "dag_view.css"

    svg = traitlets.Unicode("").tag(sync=True)          # graphviz SVG; node <g> ids are DAG ids
    selected = traitlets.Unicode("").tag(sync=True)     # id of the selected node ("" for none)
    message = traitlets.Unicode("").tag(sync=True)      # shown instead of the picture when set
    zoom = traitlets.Float(0.0).tag(sync=True)          # 0: readable; else the scale (1: 100%)
    details = traitlets.Bool(False).tag(sync=True)      # the node-details panel is open


def replace_figure(widget, fig) -> None:
    """Make FigureWidget `widget` show `fig`, keeping the widget: the front end gets
    delete/add-traces and one relayout of the layout keys that changed (re-validating an
    unchanged template costs more than the rest together)."""
    widget.data = ()
    if fig.data:
        widget.add_traces(list(fig.data))
    new, old = fig.layout.to_plotly_json(), widget.layout.to_plotly_json()
    if new.get("template") != old.get("template"):
        widget.layout = fig.layout
        return
    changed = {k: v for k, v in new.items() if k != "template" and old.get(k) != v}
    gone = [k for k in old if k not in new and k != "template"]
    with widget.batch_update():
        if changed:
            widget.update_layout(changed, overwrite=True)
        for key in gone:
            widget.layout[key] = None


def set_class(widget, name: str, on: bool) -> None:
    """Add or remove CSS class `name` on an ipywidget (idempotent)."""
    if on and name not in widget._dom_classes:
        widget.add_class(name)
    elif not on and name in widget._dom_classes:
        widget.remove_class(name)
