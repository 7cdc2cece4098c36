"""The stored notebooks stay small and normalised (tools/strip_notebooks.py).

Every notebooks/*.ipynb is under 1 MB, keeps no widget state (no `metadata.widgets`, no
widget-state output) and is exactly what the normaliser writes, so that a notebook saved
after re-executing it, before `python tools/strip_notebooks.py`, fails here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_BYTES = 1_000_000
FIX = "run `python tools/strip_notebooks.py` (it normalises notebooks/*.ipynb in place)"


def _load_normaliser():
    """tools/strip_notebooks.py, by path: a maintainer's script, not part of the package."""
    path = ROOT / "tools" / "strip_notebooks.py"
    spec = importlib.util.spec_from_file_location("strip_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


strip_notebooks = _load_normaliser()


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_small_and_stored_without_widget_state(path):
    size = path.stat().st_size
    assert size < MAX_BYTES, (
        f"{path.name} is {size:,} bytes (at most {MAX_BYTES:,}): {FIX}; if it is still too "
        "big, store a smaller figure (fewer points, or a static image)")
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} stores widget state: {FIX}"
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            assert strip_notebooks.WIDGET_STATE not in out.get("data", {}), (
                f"{path.name}, cell {cell.get('id')}: an output stores widget state: {FIX}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_normalised(path):
    text = path.read_text(encoding="utf-8")
    assert strip_notebooks.normalise_text(text) == text, f"{path.name} is not normalised: {FIX}"


def test_the_normaliser_strips_what_jupyter_adds_and_keeps_the_rest():
    """A notebook as JupyterLab saves it after a run: widget state and session metadata go,
    the tags, ids, text alternatives and other outputs stay, and a second pass is a no-op."""
    widget = {"model_id": "0e57", "version_major": 2, "version_minor": 0}
    saved = {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"},
                     "language_info": {"name": "python", "version": "3.11.7"},
                     "widgets": {strip_notebooks.WIDGET_STATE: {"state": {}, "version_major": 2,
                                                                "version_minor": 0}}},
        "cells": [
            {"cell_type": "code", "id": "a1", "execution_count": 1, "source": "designer",
             "metadata": {"execution": {"iopub.status.idle": "2026-12-01T15:05:24Z"},
                          "collapsed": False, "scrolled": True, "tags": ["nbval-ignore-output"]},
             "outputs": [
                 {"output_type": "execute_result", "execution_count": 1, "metadata": {},
                  "data": {strip_notebooks.WIDGET_VIEW: widget, "text/plain": "Designer(...)"}},
                 {"output_type": "display_data", "metadata": {},
                  "data": {strip_notebooks.WIDGET_VIEW: widget}},
                 {"output_type": "stream", "name": "stdout", "text": "kept\n"}]},
            {"cell_type": "markdown", "id": "b2", "metadata": {"tags": []}, "source": "# hi"},
        ],
    }
    text = strip_notebooks.dumps(saved)
    out = strip_notebooks.normalise_text(text)
    assert strip_notebooks.normalise_text(out) == out
    nb = json.loads(out)
    assert set(nb["metadata"]) == {"kernelspec", "language_info"}
    assert nb["metadata"]["kernelspec"] == strip_notebooks.KERNELSPEC
    assert nb["metadata"]["language_info"]["version"] == "3.11.7"
    code, markdown = nb["cells"]
    assert [code["id"], markdown["id"]] == ["a1", "b2"]
    assert code["metadata"] == {"tags": ["nbval-ignore-output"]} and markdown["metadata"] == {}
    assert [o["output_type"] for o in code["outputs"]] == ["execute_result", "stream"]
    assert code["outputs"][0]["data"] == {"text/plain": ["Designer(...)"]}


def test_the_normaliser_stores_plotly_figures_smaller_drawing_the_same():
    step_line = {"type": "scatter", "mode": "lines", "line": {"shape": "hv"},
                 "x": [0.0, 0.1234567891, 0.1234567891, 0.5, 0.5, 0.5],
                 "y": [1.0, 2.0, 2.0, 2.0, 3.0, 3.0],
                 "customdata": [[1], [2], [2], [2], [3], [3]]}
    markers = {"type": "scatter", "mode": "markers", "x": [1, 1], "y": [2, 2]}
    bars = {"type": "bar", "x": [0.5, 0.25], "base": [0, 1], "width": [0.8, 0.8],
            "offset": [-0.4, -0.3]}
    fig = strip_notebooks.compact_figure({"data": [step_line, markers, bars], "layout": {}})
    line, same, bar = fig["data"]
    assert line["x"] == [0.0, 0.123457, 0.5, 0.5] and line["y"] == [1.0, 2.0, 2.0, 3.0]
    assert line["customdata"] == [[1], [2], [2], [3]]
    assert same == markers
    assert bar["width"] == 0.8 and bar["offset"] == [-0.4, -0.3]
    assert strip_notebooks.compact_figure(fig) == fig
