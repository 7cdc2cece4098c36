"""Sphinx extension of the piper_nb docs: the notebooks as pages, with their stored outputs.

The notebooks live in `notebooks/` and are never executed by the docs build. Before Sphinx
reads anything, each is staged into `docs/notebooks/` (generated, git-ignored) with two kinds
of output rewritten so that myst-nb can show them:

- a stored plotly figure (`application/vnd.plotly.v1+json`) becomes HTML that draws it with
  plotly.js (interactive), a `<noscript>` copy of the figure as a PNG and a link to that PNG
  (the static image beside it). The PNGs are rendered by kaleido driving the system chromium,
  all in one browser session, and cached by the figure's content in `docs/_static/figures/`.
- a Designer output becomes the screenshot in `docs/_static/designer.png` (committed;
  `make screenshots` refreshes it from the browser test), or a note saying where it comes
  from when it is not there. The notebooks are stored without widget state
  (tools/strip_notebooks.py), so that output is the Designer's `text/plain` repr
  (`Designer(...)`); a widget view left in a notebook is shown as the screenshot too.

`{designer-screenshot}` is the directive pages use to show that screenshot with a caption;
plotly.js (shipped in the plotly package) is copied next to the pages and loaded by those
that hold a figure.
"""

from __future__ import annotations

import copy
import hashlib
import html
import json
import re
import shutil
from pathlib import Path

import plotly
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

LOG = logging.getLogger(__name__)
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
DESIGNER_REPR = re.compile(r"Designer\(.*\)")   # piper_nb.Designer.__repr__
SCREENSHOT = "_static/designer.png"
SCREENSHOT_CAPTION = ("The Designer in JupyterLab: directives on the left, the DAG of the "
                      "compiled plan with one node selected and its details beside it. The "
                      "screenshot is taken by the browser test (tests/ui/test_browser.py).")
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _write_if_changed(path: Path, data: bytes) -> None:
    """Write only a changed file, so that Sphinx rereads only what changed."""
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _figure_html(fig: dict, div_id: str, png: str) -> str:
    """The figure drawn by plotly.js once the page is laid out (so it takes the width of
    the column, not of the page as it was while loading), its PNG for readers without
    JavaScript, and a link to that PNG."""
    height = fig.get("layout", {}).get("height", 450)
    spec = json.dumps({"data": fig.get("data", []), "layout": fig.get("layout", {})})
    spec = spec.replace("</", "<\\/")   # never end the script early
    div = (f'<div id="{div_id}" class="plotly-graph-div" style="width:100%;height:{height}px">'
           f'</div><script>window.addEventListener("load", function () {{ '
           f'var f = {spec}; Plotly.newPlot("{div_id}", f.data, f.layout, '
           f'{{"responsive": true, "displaylogo": false}}); }});</script>')
    return (f'<div class="pn-figure">{div}'
            f'<noscript><img src="{png}" alt="the figure as a static image"></noscript>'
            f'<p class="pn-figure-static"><a href="{png}">Static image of this figure '
            f'(PNG)</a></p></div>')


def _screenshot_html(srcdir: Path) -> str:
    if (srcdir / SCREENSHOT).exists():
        return (f'<figure class="pn-screenshot"><img src="../{SCREENSHOT}" '
                f'alt="the Designer" style="max-width:100%">'
                f'<figcaption>{html.escape(SCREENSHOT_CAPTION)}</figcaption></figure>')
    return ("<p><em>The Designer is a live widget: open this notebook in JupyterLab to use "
            "it. A screenshot appears here once the browser test "
            "(tests/ui/test_browser.py, run by make screenshots) has taken one.</em></p>")


def _is_designer(out: dict) -> bool:
    """A cell's result that is a Designer stored without its widget: only its repr."""
    data = out.get("data", {})
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    return (out.get("output_type") in ("execute_result", "display_data")
            and set(data) == {"text/plain"} and DESIGNER_REPR.fullmatch(text.strip()) is not None)


def _stage(nb: dict, srcdir: Path, figures: dict[str, dict]) -> dict:
    """A copy of the notebook with plotly and widget outputs replaced by HTML."""
    nb = copy.deepcopy(nb)
    count = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                fig = data.pop(PLOTLY_MIME)
                key = hashlib.sha1(json.dumps(fig, sort_keys=True).encode()).hexdigest()[:16]
                figures[key] = fig
                count += 1
                data["text/html"] = _figure_html(fig, f"pn-figure-{count}",
                                                 f"../_static/figures/{key}.png")
            elif WIDGET_MIME in data or _is_designer(out):
                data.pop(WIDGET_MIME, None)
                data["text/html"] = _screenshot_html(srcdir)
    nb.setdefault("metadata", {}).pop("widgets", None)
    return nb


def _render_pngs(figures: dict[str, dict], folder: Path) -> None:
    """Render the figures not cached yet, in one kaleido (system chromium) session."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        if old.stem not in figures:
            old.unlink()
    for attempt in range(3):   # a loaded machine can drop kaleido's browser session: retry
        todo = [{"fig": fig, "path": str(folder / f"{key}.png"),
                 "opts": {"format": "png", "width": 1100, "scale": 1}}
                for key, fig in figures.items() if not (folder / f"{key}.png").exists()]
        if not todo:
            return
        import kaleido  # only when a figure is new: starting the browser takes seconds
        LOG.info(f"rendering {len(todo)} plotly figure(s) to PNG with kaleido")
        try:
            kaleido.write_fig_from_object_sync(todo, kopts={"mathjax": False},
                                               cancel_on_error=True)
        except Exception as exc:  # noqa: BLE001 - retried, then reported with its cause
            if attempt == 2:
                raise RuntimeError("could not render the notebooks' plotly figures to PNG with "
                                   f"kaleido ({type(exc).__name__}: {exc}); it needs chromium "
                                   "(apt-get install chromium)") from exc


def stage_notebooks(app: Sphinx) -> None:
    srcdir = Path(app.srcdir)
    source = (srcdir / app.config.pn_notebooks_dir).resolve()
    staged = srcdir / "notebooks"
    figures: dict[str, dict] = {}
    names = set()
    for path in sorted(source.glob("*.ipynb")):
        nb = _stage(json.loads(path.read_text()), srcdir, figures)
        _write_if_changed(staged / path.name, (json.dumps(nb, indent=1) + "\n").encode())
        names.add(path.name)
    for old in staged.glob("*.ipynb"):
        if old.name not in names:
            old.unlink()
    _render_pngs(figures, srcdir / "_static" / "figures")


def copy_plotly_js(app: Sphinx, exc: Exception | None) -> None:
    if exc is None and app.builder.format == "html":
        static = Path(app.outdir) / "_static"
        static.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PLOTLY_JS, static / "plotly.min.js")


def add_plotly_js(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if "pn-figure" in context.get("body", ""):
        app.add_js_file("plotly.min.js", priority=200)


def fix_links(app: Sphinx, docname: str, source: list[str]) -> None:
    """Links written for the repository's layout, pointed at the site's.

    A page in docs/ links a notebook as `../notebooks/N.ipynb` and a notebook links a page
    as `../docs/P.md` (both right on GitHub); on the site the notebooks sit in docs/notebooks/.
    """
    if docname.startswith("notebooks/"):
        source[0] = source[0].replace("](../docs/", "](../")
    else:
        source[0] = source[0].replace("](../notebooks/", "](notebooks/")


class DesignerScreenshot(SphinxDirective):
    """`{designer-screenshot}`: the Designer's screenshot with its caption, or a note."""

    def run(self) -> list[nodes.Node]:
        if not (Path(self.env.srcdir) / SCREENSHOT).exists():
            note = nodes.paragraph(text="(The screenshot of the Designer appears here once the "
                                        "browser test tests/ui/test_browser.py has taken one: "
                                        "make screenshots.)")
            return [note]
        figure = nodes.figure(classes=["pn-screenshot"])
        figure += nodes.image(uri="/" + SCREENSHOT, alt="the Designer")
        figure += nodes.caption(text=SCREENSHOT_CAPTION)
        return [figure]


def setup(app: Sphinx) -> dict:
    app.add_config_value("pn_notebooks_dir", "../notebooks", "env")
    app.connect("builder-inited", stage_notebooks)
    app.connect("source-read", fix_links)
    app.connect("html-page-context", add_plotly_js)
    app.connect("build-finished", copy_plotly_js)
    app.add_directive("designer-screenshot", DesignerScreenshot)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
