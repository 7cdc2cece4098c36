"""The documentation site: `make docs` (Sphinx, myst-nb, warnings are errors) in small.

One build per module, into a temporary folder, from docs/ as `make docs` runs it: every
page is there, the API reference documents every name of `piper_nb.__all__`, each stored
plotly figure of a notebook is drawn by plotly.js and has its PNG beside it, and a real
chromium opening a notebook page over file:// sees a plotly figure render.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import piper_nb as pn

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PLOTLY = "application/vnd.plotly.v1+json"
SCREENSHOT = ROOT / "docs" / "_static" / "designer.png"   # committed; `make screenshots` refreshes it

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the docs build "
                    "renders the notebooks' figures to PNG with it")
    out = tmp_path_factory.mktemp("docs")
    # what the build finds: the screenshot, and each notebook's stored plotly figures
    (out / "screenshot").write_text(str(SCREENSHOT.exists()))
    (out / "figures.json").write_text(json.dumps({
        nb.stem: sum(PLOTLY in o.get("data", {}) for cell in json.loads(nb.read_text())["cells"]
                     for o in cell.get("outputs", []))
        for nb in ROOT.glob("notebooks/*.ipynb")}))
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")],
        capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out / "html"


@pytest.mark.full
def test_every_page_and_notebook_is_built(site):
    for page in ROOT.glob("docs/*.md"):
        assert (site / f"{page.stem}.html").exists(), page.name
    for nb in ROOT.glob("notebooks/*.ipynb"):
        assert (site / "notebooks" / f"{nb.stem}.html").exists(), nb.name


def test_the_designer_is_shown_as_a_screenshot_or_a_note_where_none_exists_yet(site):
    index = (site / "index.html").read_text()
    designer = (site / "notebooks" / "07_designer.html").read_text()
    if (site.parent / "screenshot").read_text() == "True":
        assert re.search(r'<img [^>]*src="_images/designer\.png"', index)
        assert "<figcaption>" in index and "The Designer in JupyterLab" in index
        assert 'src="../_static/designer.png"' in designer
    else:
        assert "appears here once the browser test" in index
        assert "open this notebook in JupyterLab" in designer


def test_the_api_reference_documents_every_public_name(site):
    text = (site / "api.html").read_text()
    missing = [n for n in pn.__all__
               if f'id="piper_nb.{n}"' not in text and f'id="module-piper_nb.{n}"' not in text]
    assert not missing, f"not in docs/api.md: {missing}"
    for name in ("piper_nb.schedules.one_f_one_b", "piper_nb.schedules.dualpipe",
                 "piper_nb.schedules.from_torch_csv", "piper_nb.CostModel.analytic"):
        assert f'id="{name}"' in text, name


def test_each_stored_figure_is_interactive_with_a_png_beside_it(site):
    figures = json.loads((site.parent / "figures.json").read_text())
    assert sum(figures.values()) >= 10, figures
    for stem, stored in figures.items():
        page = (site / "notebooks" / f"{stem}.html").read_text()
        pngs = re.findall(r'<img src="\.\./(_static/figures/[0-9a-f]+\.png)"', page)
        assert page.count('class="plotly-graph-div"') == stored == len(pngs), stem
        assert all((site / png).stat().st_size > 5000 for png in pngs), stem
        assert ("plotly.min.js" in page) == (stored > 0), stem
    assert (site / "_static" / "plotly.min.js").stat().st_size > 1_000_000


@pytest.mark.full
@pytest.mark.browser
def test_a_built_page_draws_its_plotly_figure_in_chromium(site):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    page_path = site / "notebooks" / "01_quickstart.html"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
            bars = page.locator(".js-plotly-plot g.trace.bars g.point").count()
            assert bars > 0, "the timeline figure drew no bars"
            assert not errors, errors
        finally:
            browser.close()
