"""Normalise the stored notebooks: run it after re-executing one, before committing.

    python tools/strip_notebooks.py            # rewrite notebooks/*.ipynb in place
    python tools/strip_notebooks.py --check    # exit 1 listing the ones it would change
    python tools/strip_notebooks.py PATH ...   # only these notebooks

What it does to each notebook (idempotent: a second run changes nothing, and
tests/test_notebooks.py fails on a notebook it would still change):

- no widget state: the notebook-level `metadata.widgets` (ipywidgets' saved state, with a
  copy of plotly's JavaScript per figure widget) goes, and so do the outputs that only
  referred to it (`application/vnd.jupyter.widget-view+json`, and any
  `application/vnd.jupyter.widget-state+json`); a cell keeps the `text/plain` alternative
  of such an output where it has one (the Designer shows its repr until the cell runs).
- no metadata that JupyterLab rewrites or that records a session: per-cell `execution`
  timings, `collapsed`, `scrolled`, `jupyter` (hidden inputs/outputs) and the like, and empty
  `tags`. The nbval tags in `metadata.tags` stay, and so do the cell ids.
- `kernelspec` and `language_info` exactly as JupyterLab writes them when it starts the
  python3 kernel (it compares before it marks a notebook modified), the same in every
  notebook; only the Python version that executed the notebook is kept from the file.
- plotly figures (`application/vnd.plotly.v1+json`) stored smaller, drawing the same: every
  number rounded to 6 significant digits (a 14 s timeline to 0.1 ms; hover labels show 3 or
  4), a bar trace's `width` or `offset` that is one value for every bar stored once, and, in
  line traces, a point equal to the one before it dropped (the memory view's step lines
  store each point twice).
- written as Jupyter writes a notebook (nbformat: one-space indent, sorted keys, a final
  newline), and checked with `nbformat.validate`.

It never executes a notebook.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLOTLY = "application/vnd.plotly.v1+json"

NOTEBOOK_METADATA_DROPPED = ("widgets", "signature")
CELL_METADATA_DROPPED = ("execution", "ExecuteTime", "collapsed", "scrolled", "jupyter",
                         "heading_collapsed", "hidden")
# what JupyterLab sets when the kernel starts (NotebookPanel._updateSpec / _updateLanguage:
# ipykernel's kernel spec and kernel_info reply); equal values leave the notebook unmodified
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3"}

DIGITS = 6
# the per-point arrays of a line trace that dropping a repeated point keeps aligned
POINT_KEYS = ("x", "y", "customdata", "text", "hovertext", "ids")
STEP_OR_STRAIGHT = (None, "linear", "hv", "vh", "hvh", "vhv")


# ---- plotly -----------------------------------------------------------------------------
def _round(value):
    if isinstance(value, float):
        return float(f"{value:.{DIGITS}g}")
    if isinstance(value, list):
        return [_round(v) for v in value]
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    return value


def _has_list_of_length(value, n: int) -> bool:
    if isinstance(value, dict):
        return any(_has_list_of_length(v, n) for v in value.values())
    return isinstance(value, list) and len(value) == n


def _drop_repeated_points(trace: dict) -> None:
    """A line (no markers, no text on the points) draws the same without a point that
    equals the one before it, and hovers the same: drop such points."""
    if trace.get("type", "scatter") not in ("scatter", "scattergl") or trace.get("mode") != "lines":
        return
    if (trace.get("line") or {}).get("shape") not in STEP_OR_STRAIGHT:
        return
    x, y = trace.get("x"), trace.get("y")
    if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y) or len(x) < 3:
        return
    n = len(x)
    keys = [k for k in POINT_KEYS if isinstance(trace.get(k), list)]
    if any(len(trace[k]) != n for k in keys):
        return
    if any(_has_list_of_length(v, n) for k, v in trace.items() if k not in keys):
        return   # another per-point array (a marker colour, ...): leave the trace as it is
    points = [tuple(json.dumps(trace[k][i], sort_keys=True) for k in keys) for i in range(n)]
    keep = [i for i in range(n) if i == 0 or points[i] != points[i - 1]]
    if len(keep) < n:
        for k in keys:
            trace[k] = [trace[k][i] for i in keep]


def _one_value_per_trace(trace: dict) -> None:
    """A bar's `width` and `offset` may be one number for all the bars: the same bars."""
    if trace.get("type") != "bar":
        return
    for key in ("width", "offset"):
        value = trace.get(key)
        if isinstance(value, list) and value and all(v == value[0] for v in value) \
                and isinstance(value[0], int | float) and not isinstance(value[0], bool):
            trace[key] = value[0]


def compact_figure(fig: dict) -> dict:
    """The stored plotly figure, smaller and drawn the same."""
    fig = _round(fig)
    for trace in fig.get("data", []):
        if isinstance(trace, dict):
            _one_value_per_trace(trace)
            _drop_repeated_points(trace)
    return fig


# ---- notebooks --------------------------------------------------------------------------
def _normalise_output(out: dict) -> dict | None:
    """The output as stored, or None when nothing of it is left."""
    data = out.get("data")
    if data is None:
        return out
    for mime in (WIDGET_VIEW, WIDGET_STATE):
        if mime in data:
            del data[mime]
            (out.get("metadata") or {}).pop(mime, None)
    if not data:
        return None
    if PLOTLY in data:
        data[PLOTLY] = compact_figure(data[PLOTLY])
    return out


def normalise(nb: dict) -> dict:
    """A normalised copy of a notebook (the JSON as loaded); the input is left alone."""
    nb = copy.deepcopy(nb)
    meta = nb.setdefault("metadata", {})
    for key in NOTEBOOK_METADATA_DROPPED:
        meta.pop(key, None)
    meta["kernelspec"] = dict(KERNELSPEC)
    version = (meta.get("language_info") or {}).get("version")
    meta["language_info"] = copy.deepcopy(LANGUAGE_INFO)
    if isinstance(version, str) and version:
        meta["language_info"]["version"] = version
    for cell in nb.get("cells", []):
        cmeta = cell.setdefault("metadata", {})
        for key in CELL_METADATA_DROPPED:
            cmeta.pop(key, None)
        if cmeta.get("tags") == []:
            del cmeta["tags"]
        if "outputs" in cell:
            cell["outputs"] = [o for o in map(_normalise_output, cell["outputs"]) if o is not None]
    return nb


def dumps(nb: dict) -> str:
    """The notebook as Jupyter (nbformat, and JupyterLab's save) writes it; validated."""
    node = nbformat.from_dict(nb)
    nbformat.validate(node)
    text = nbformat.writes(node)
    return text if text.endswith("\n") else text + "\n"


def normalise_text(text: str) -> str:
    """A notebook file's text, normalised (equal to `text` when it already is)."""
    return dumps(normalise(json.loads(text)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path,
                        help="notebooks to normalise (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a notebook is not normalised")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(NOTEBOOKS.glob("*.ipynb"))
    changed = []
    for path in paths:
        before = path.read_text(encoding="utf-8")
        after = normalise_text(before)
        if after == before:
            continue
        changed.append(path)
        if args.check:
            print(f"not normalised: {path}")
        else:
            path.write_text(after, encoding="utf-8")
            print(f"{path}: {len(before.encode()):,} -> {len(after.encode()):,} bytes")
    if args.check and changed:
        print("run `python tools/strip_notebooks.py` to normalise them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
